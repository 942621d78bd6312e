"""Qwen3-VL's deepstack: the served decoder (mlx-lm's qwen3_vl, in the step core)
adds the tower's deepstack features at the visual tokens of its first layers, chunk by chunk,
as mlx-vlm's own language model does over the whole prompt. Real models: the generated
`model=tiny_vlm model.arch=qwen3_vl` checkpoint through mlx-lm's loader and mlx-vlm's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")


def test_chunked_prefill_logits_equal_mlx_vlms_forward(model_cache: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    from pipeserve.model.tiny.vlm import ensure_model
    from pipeserve.vision.encoder import VisionEncoder

    path = ensure_model("qwen3_vl", "float32", model_cache)
    vlm, processor = load(str(path))
    image = Image.fromarray((np.random.default_rng(5).random((100, 130, 3)) * 255).astype("uint8"))
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Context. " * 3}, {"type": "image"},
        {"type": "text", "text": "What is in the picture?"}]}], tokenize=False,
        add_generation_prompt=True)
    inputs = prepare_inputs(processor, images=[image], prompts=[prompt])
    ids = inputs["input_ids"]
    reference = vlm(ids, pixel_values=inputs["pixel_values"], mask=inputs["attention_mask"],
                    image_grid_thw=inputs["image_grid_thw"]).logits

    lm, config = load_model(path)
    encoder = VisionEncoder.load(path, json.loads((path / "config.json").read_text()), lm)
    embedded = encoder.embed(ids[0].tolist(), {
        "pixel_values": np.array(inputs["pixel_values"]),
        "image_grid_thw": np.array(inputs["image_grid_thw"])})
    visual = embedded.visual
    assert len(visual) >= 8   # several visual tokens, so a chunk edge can fall among them
    chunk = int(visual[len(visual) // 2] - visual[0]) + 1   # an edge inside the image

    def served(deepstack: bool) -> mx.array:
        cache = make_prompt_cache(lm)
        if not deepstack:
            embedded.deepstack = None
        out = []
        for start in range(0, ids.shape[1], chunk):
            num = min(chunk, ids.shape[1] - start)
            with encoder.chunk(embedded, start, num) as kwargs:
                out.append(lm(ids[:, start:start + num], cache=cache, **kwargs))
        return mx.concatenate(out, axis=1)

    ours = served(deepstack=True)
    assert mx.abs(ours - reference).max().item() < 1e-3
    assert (ours.argmax(-1) == reference.argmax(-1)).all().item()
    # the deepstack features matter (without them the logits move far off mlx-vlm's)
    assert mx.abs(served(deepstack=False) - reference).max().item() > 0.1


def test_an_image_and_a_video_with_deepstack_equal_mlx_vlms_merge(model_cache: Path) -> None:
    """Qwen3-VL-MoE's get_input_embeddings takes one kind per prompt; pipeserve's
    (pipeserve/vision/mixed.py) runs the tower on each kind and merges both kinds' features
    and deepstack features in prompt order. The reference: mlx-vlm's own Qwen3-VL merge
    (_merge_deepstack_features) on its tower's outputs, through its language model."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from mlx_vlm import load
    from mlx_vlm.models.qwen3_vl.qwen3_vl import Model as Qwen3VL
    from mlx_vlm.models.qwen3_vl.qwen3_vl import masked_scatter

    from pipeserve.model.tiny.vlm import ensure_model
    from pipeserve.vision.encoder import VisionEncoder

    path = ensure_model("qwen3_vl_moe", "float32", model_cache)
    vlm, processor = load(str(path))
    rng = np.random.default_rng(6)
    image = Image.fromarray((rng.random((70, 100, 3)) * 255).astype("uint8"))
    frames = (rng.random((4, 64, 96, 3)) * 255).astype("uint8")
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
        {"type": "text", "text": "What is in them?"}]}], tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], videos=[list(frames)])
    ids = mx.array(inputs["input_ids"])
    grids = mx.array(inputs["image_grid_thw"]), mx.array(inputs["video_grid_thw"])
    config, tower = vlm.config, vlm.vision_tower
    image_features, image_deepstack = tower(mx.array(inputs["pixel_values"]), grids[0])
    video_features, video_deepstack = tower(mx.array(inputs["pixel_values_videos"]), grids[1])
    embeds = vlm.language_model.model.embed_tokens(ids)
    for token, features in ((config.image_token_id, image_features),
                            (config.video_token_id, video_features)):
        embeds = masked_scatter(embeds, mx.broadcast_to((ids == token)[..., None], embeds.shape),
                                features)
    deepstack = Qwen3VL._merge_deepstack_features(vlm, ids, image_deepstack, video_deepstack)
    positions, deltas = vlm.language_model.get_rope_index(ids, *grids,
                                                          mx.ones(ids.shape, dtype=mx.int32))
    reference = vlm.language_model(
        ids, inputs_embeds=embeds, position_ids=positions, rope_deltas=deltas,
        visual_pos_masks=(ids == config.image_token_id) | (ids == config.video_token_id),
        deepstack_visual_embeds=deepstack).logits

    lm, _ = load_model(path)
    encoder = VisionEncoder.load(path, json.loads((path / "config.json").read_text()), lm)
    pixels = {k: np.array(inputs[k]) for k in ("pixel_values", "image_grid_thw",
                                               "pixel_values_videos", "video_grid_thw")}
    embedded = encoder.embed(ids[0].tolist(), pixels)
    cache, out, chunk = make_prompt_cache(lm), [], 16
    for start in range(0, ids.shape[1], chunk):
        num = min(chunk, ids.shape[1] - start)
        with encoder.chunk(embedded, start, num) as kwargs:
            out.append(lm(ids[:, start:start + num], cache=cache, **kwargs))
    ours = mx.concatenate(out, axis=1)
    assert int(mx.sum(ids == config.video_token_id).item()) > 0
    assert mx.abs(ours - reference).max().item() < 1e-3
