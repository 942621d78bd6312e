"""Owns the generated vision-language test models (`model=tiny_vlm`): deterministic random-weight
mlx-vlm checkpoints (a language model, a vision tower and its projector) with the byte-level BPE
of pipeserve/model/tiny/text.py plus each family's image tokens, and the image processor config its
processor reads. Loadable by mlx_vlm.load and, for the language model, mlx_lm.load. Engine
thread (weights are numpy; mlx only builds shapes and writes safetensors)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeserve.model.tiny import audio as tiny_audio, text as tiny
from pipeserve.model.cache import cache_root, publish

ARCHS = ("gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
         "gemma4")   # gemma4: + an audio tower (tiny_audio.py)
QWEN3_ARCHS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")   # Qwen3-VL's tower
VLM_SIZES = ("tiny", "medium", "large")   # tests; the decoder at Qwen3-0.6B's / 8B's shape
FORMAT_VERSION = 3
IMAGE_TOKENS = {    # added after tiny.py's tokens, in this order
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
}
IMAGE_TOKENS.update({arch: IMAGE_TOKENS["qwen2_5_vl"] for arch in QWEN3_ARCHS})
# What a user message's image part renders as: the family's own placeholder, which its
# processor expands to one token per image feature.
IMAGE_MARK = {"gemma3": "<start_of_image>",
              "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
IMAGE_MARK.update({arch: IMAGE_MARK["qwen2_5_vl"] for arch in QWEN3_ARCHS})
# and a video part, for a family whose processor takes video (as Qwen2.5-VL's own template)
VIDEO_PART = {arch: "{%- elif part.type == 'video' %}"
                    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
              for arch in ("qwen2_5_vl", *QWEN3_ARCHS)}
GEMMA_IMAGE_SIZE, GEMMA_PATCH, GEMMA_TOKENS_PER_IMAGE = 32, 8, 4
QWEN_PATCH, QWEN_MERGE = 14, 2
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 112 * 112   # 4 to 16 merged tokens per image
QWEN3_PATCH = 16   # Qwen3-VL's tower: 16-pixel patches, 32-pixel merged tokens
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 64 * 64, 128 * 128   # 4 to 16 merged tokens per image


def chat_template(arch: str) -> str:
    """ChatML, with content parts: text as is, an image (a video) as the family's placeholder."""
    mark = IMAGE_MARK[arch]
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.content is string %}{{- message.content }}"
        "{%- else %}{%- for part in message.content %}"
        "{%- if part.type == 'image' or part.type == 'image_url' %}{{- '" + mark + "' }}"
        + VIDEO_PART.get(arch, "") +
        "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def gemma_shape(size: str) -> tuple[int, int, int]:
    """(image side, patch, tokens per image) of a generated Gemma 3: the tiny test shape, or for
    the benchmark sizes a 224-pixel SigLIP pooled to 64 tokens."""
    return (GEMMA_IMAGE_SIZE, GEMMA_PATCH, GEMMA_TOKENS_PER_IMAGE) if size == "tiny" else (224, 14, 64)


def _vision_dims(size: str) -> dict[str, int]:
    """The vision tower's width: 2 narrow layers for tests; for the benchmark sizes (the decoder
    at model=tiny's medium/large shapes) 4 layers of 384, so the tower costs something."""
    if size == "tiny":
        return {"hidden_size": 32, "intermediate_size": 64, "layers": 2, "heads": 2}
    return {"hidden_size": 384, "intermediate_size": 1536, "layers": 4, "heads": 6}


def _config(arch: str, ids: dict[str, int], eos: list[int], size: str = "tiny") -> dict[str, Any]:
    vocab = len(ids)   # one embedding row per token (mlx-vlm's detokenizer has no others)
    dims = _vision_dims(size)
    if arch == "gemma3":
        side, patch, per_image = gemma_shape(size)
        text = tiny._model_config("gemma3", size, eos)
        text.update(vocab_size=vocab, rope_global_base_freq=text["rope_theta"],
                    mm_tokens_per_image=per_image, tie_word_embeddings=True)
        vision = {"model_type": "siglip_vision_model", "hidden_size": dims["hidden_size"],
                  "intermediate_size": dims["intermediate_size"],
                  "num_hidden_layers": dims["layers"], "num_attention_heads": dims["heads"],
                  "patch_size": patch, "image_size": side, "layer_norm_eps": 1e-6}
        return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": text, "vision_config": vision, "vocab_size": vocab,
                "hidden_size": text["hidden_size"], "mm_tokens_per_image": per_image,
                "image_token_index": ids["<image_soft_token>"],
                "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
                "pad_token_id": eos[1], "eos_token_id": eos}
    token_ids = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                 "vision_start_token_id": ids["<|vision_start|>"],
                 "vision_end_token_id": ids["<|vision_end|>"],
                 "vision_token_id": ids["<|vision_start|>"]}
    if arch in QWEN3_ARCHS:
        return _qwen3_vl_config(arch, ids, eos, size, token_ids)
    text = tiny._model_config("qwen3", size, eos)
    for key in ("head_dim", "attention_bias"):
        text.pop(key)
    half = text["hidden_size"] // text["num_attention_heads"] // 2   # rotary pairs per head
    text.update(model_type="qwen2_5_vl", vocab_size=vocab, tie_word_embeddings=size != "large",
                rope_scaling={"type": "mrope",   # [2, 3, 3] at head_dim 16, as Qwen's 1:3:3
                              "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]})
    vision = {"model_type": "qwen2_5_vl", "depth": dims["layers"],
              "hidden_size": dims["hidden_size"], "intermediate_size": dims["intermediate_size"],
              "out_hidden_size": text["hidden_size"], "num_heads": dims["heads"], "patch_size": QWEN_PATCH,
              "spatial_patch_size": QWEN_PATCH, "spatial_merge_size": QWEN_MERGE,
              "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
              "in_channels": 3, "tokens_per_second": 2}
    # the text fields at the top (mlx-vlm reads them there) and under text_config (mlx-lm)
    return {**text, "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "text_config": dict(text), "vision_config": vision, **token_ids}


def _interleaved_sections(pairs: int) -> list[int]:
    """Qwen3's interleaved M-RoPE sections (t, h, w) over `pairs` rotary pairs: h and w take
    every third pair from the second (third) on, t the rest, as [24, 20, 20] of 64 pairs."""
    h = w = pairs * 20 // 64 or 1
    return [pairs - h - w, h, w]


def _qwen3_vl_config(arch: str, ids: dict[str, int], eos: list[int], size: str,
                     token_ids: dict[str, int]) -> dict[str, Any]:
    """A Qwen3-VL: the Qwen3 decoder (mlx-lm's qwen3_vl serves it) with interleaved M-RoPE,
    and a tower whose first layer's features also feed the decoder's first layer (deepstack).
    A Qwen3.5: model=tiny's qwen3_5 decoder (gated delta layers, attention every 2nd layer,
    its rotary on a quarter of each head) with the same tower, without deepstack (as
    Qwen3.5's), and with model=tiny's MTP head beside it (draft=mtp serves it text only:
    model.vision=false)."""
    dims = _vision_dims(size)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text = tiny._model_config("qwen3_5", size, eos)["text_config"]
        if arch == "qwen3_5_moe":   # 4 experts, 2 a token, and the shared expert
            inter = text["intermediate_size"]
            text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=inter // 2, shared_expert_intermediate_size=inter,
                        norm_topk_prob=True)
        pairs = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
        text.update(vocab_size=len(ids), tie_word_embeddings=False)
        text["rope_parameters"].update(mrope_interleaved=True,
                                       mrope_section=_interleaved_sections(pairs))
    else:
        text = tiny._model_config("qwen3", size, eos)
        if arch == "qwen3_vl_moe":   # 4 experts, 2 a token, in every layer
            text.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                        mlp_only_layers=[], moe_intermediate_size=text["intermediate_size"] // 2,
                        norm_topk_prob=True)
        pairs = text["head_dim"] // 2
        text.update(model_type=f"{arch}_text", vocab_size=len(ids),   # (mlx-lm's MoE wants lm_head)
                    tie_word_embeddings=size != "large" and arch == "qwen3_vl",
                    rope_scaling={"rope_type": "default", "mrope_interleaved": True,
                                  "mrope_section": _interleaved_sections(pairs)})
        text.pop("architectures", None)
    vision = {"model_type": arch, "depth": dims["layers"],
              "hidden_size": dims["hidden_size"], "intermediate_size": dims["intermediate_size"],
              "out_hidden_size": text["hidden_size"], "num_heads": dims["heads"],
              "patch_size": QWEN3_PATCH, "spatial_merge_size": QWEN_MERGE,
              "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0] if arch.startswith("qwen3_vl") else []}
    name = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
            "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[arch]
    return {"model_type": arch, "architectures": [name],
            "text_config": text, "vision_config": vision,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "eos_token_id": eos, "pad_token_id": eos[1], **token_ids}


def _processor_files(arch: str, size: str = "tiny") -> dict[str, Any]:
    norm = {"do_normalize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_convert_rgb": True, "resample": 3}
    if arch == "gemma3":
        side, _, per_image = gemma_shape(size)
        return {"preprocessor_config.json": {
                    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                    "size": {"height": side, "width": side}, "do_resize": True,
                    "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": False,
                    **norm, "resample": 2},
                "processor_config.json": {"processor_class": "Gemma3Processor",
                                          "image_seq_length": per_image}}
    if arch in QWEN3_ARCHS:
        low, high = (QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS) if size == "tiny" else (64 * 64, 448 * 448)
        return {"preprocessor_config.json": {
                    "image_processor_type": "Qwen2VLImageProcessorFast",
                    "processor_class": "Qwen3VLProcessor", "do_resize": True,
                    "size": {"shortest_edge": low, "longest_edge": high},
                    "patch_size": QWEN3_PATCH, "merge_size": QWEN_MERGE, "temporal_patch_size": 2,
                    "image_mean": [0.5] * 3, "image_std": [0.5] * 3, **norm},
                "processor_config.json": {"processor_class": "Qwen3VLProcessor"}}
    low, high = (QWEN_MIN_PIXELS, QWEN_MAX_PIXELS) if size == "tiny" else (56 * 56, 448 * 448)
    return {"preprocessor_config.json": {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor", "do_resize": True,
                "min_pixels": low, "max_pixels": high,
                "size": {"shortest_edge": low, "longest_edge": high},
                "patch_size": QWEN_PATCH, "merge_size": QWEN_MERGE, "temporal_patch_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], **norm},
            "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor"}}


def _vision_fill(name: str, shape: tuple[int, ...]) -> Any:
    """Deterministic value of a vision-side parameter, seeded by (SEED, crc32(name))."""
    import zlib

    import numpy as np

    rng = np.random.default_rng([tiny.SEED, zlib.crc32(name.encode())])
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        return (np.ones(shape, np.float32) if "norm" in name and leaf == "weight"
                else np.zeros(shape, np.float32))
    fan_in = int(np.prod(shape[1:])) if "mm_input_projection" not in name else shape[0]
    # Qwen3-VL's deepstack features join a residual stream the decoder's branches have grown
    # (tiny.BRANCH_GAIN): at the same gain they move the answer, so a test sees them
    out = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)
    if "deepstack_merger_list" in name and "fc2" in name:
        out *= np.float32(tiny.BRANCH_GAIN["qwen3"])
    return out


def _write(out: Path, arch: str, dtype: str, size: str = "tiny") -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from tokenizers import AddedToken

    tok = tiny.build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in IMAGE_TOKENS[arch]])
    ids = tok.get_vocab()
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = _config(arch, ids, eos, size)
    config["torch_dtype"] = dtype
    module, _ = get_model_and_args(json.loads(json.dumps(config)))
    built = json.loads(json.dumps(config))
    model_config = module.ModelConfig.from_dict(built)
    model_config = update_module_configs(model_config, module, built, ["text", "vision", "projector"])
    model = module.Model(model_config)
    hidden = config.get("text_config", config)["hidden_size"]
    weights: dict[str, Any] = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        if name.startswith("language_model."):   # the text trunk's weights, as model=tiny's
            lm_name = name.removeprefix("language_model.")
            arr = tiny._fill(lm_name, tuple(param.shape), "gemma3" if arch == "gemma3" else "qwen3",
                             hidden)
            if arch == "gemma3" and lm_name == "lm_head.weight":   # tied, as gemma3 is
                arr = tiny._fill("model.embed_tokens.weight", tuple(param.shape), "gemma3", hidden)
        else:   # vision tower and projector: plain norms (weight 1), fan-in scaled matrices
            arr = _vision_fill(name, tuple(param.shape))
        weights[name] = mx.array(arr).astype(getattr(mx, dtype))
    mtp_layers = config.get("text_config", {}).get("mtp_num_hidden_layers")
    if mtp_layers:   # Qwen3.5's MTP head beside the trunk, as model=tiny's qwen3_5 has it
        from mlx_lm.models.qwen3_5 import TextModelArgs
        args = TextModelArgs.from_dict(json.loads(json.dumps(config["text_config"])))
        weights.update(tiny._mtp_weights(args, mtp_layers, "qwen3_5", getattr(mx, dtype)))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    special = tiny.SPECIAL_TOKENS + IMAGE_TOKENS[arch]
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in special}
             for t in tiny.SPECIAL_TOKENS + tiny.ADDED_TOKENS + IMAGE_TOKENS[arch]}
    extra = ({"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
              "eoi_token": "<end_of_image>"} if arch == "gemma3" else
             {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"})
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "extra_special_tokens": extra, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": 4096, "split_special_tokens": False, "chat_template": chat_template(arch),
    }
    files: dict[str, Any] = {
        "config.json": config, "tokenizer_config.json": tok_cfg,
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "generation_config.json": {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                                   "eos_token_id": eos, "pad_token_id": eos[1]},
        **_processor_files(arch, size),
    }
    for fname, obj in files.items():
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(chat_template(arch), encoding="utf-8")


def ensure_model(arch: str = "gemma3", dtype: str = "float32",
                 cache_dir: str | Path | None = None, size: str = "tiny") -> Path:
    """A generated VLM directory (config.json with vision_config, model.safetensors, tokenizer,
    preprocessor_config.json), made on first use into the model cache and reused after."""
    if arch not in ARCHS:
        raise ValueError(f"unknown vision arch {arch!r}; expected one of {ARCHS}")
    if dtype not in tiny.DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tiny.DTYPES}")
    if size not in VLM_SIZES:
        raise ValueError(f"unknown vision-model size {size!r}; expected one of {VLM_SIZES}")
    if arch == "gemma4":
        if size != "tiny":
            raise ValueError("the generated gemma4 (audio) model comes in size tiny only")
        final = cache_root(cache_dir) / f"vlm-gemma4-tiny-{dtype}-v{tiny_audio.FORMAT_VERSION}"
        return publish(final, lambda tmp: tiny_audio.write(tmp, dtype))
    final = cache_root(cache_dir) / f"vlm-{arch}-{size}-{dtype}-v{FORMAT_VERSION}"
    return publish(final, lambda tmp: _write(tmp, arch, dtype, size))
