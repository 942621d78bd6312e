"""Qwen3-VL's deepstack (issue 27): the served decoder (mlx-lm's qwen3_vl, in the step core)
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

    from pipeline.tiny_vlm import ensure_model
    from pipeline.vision.encoder import VisionEncoder

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
    embedded = encoder.embed(ids[0].tolist(), {"pixel_values": np.array(inputs["pixel_values"]),
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
