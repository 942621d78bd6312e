"""Owns the generated audio-language test model (`model=tiny_vlm model.arch=gemma4`): a
deterministic random-weight Gemma 4 checkpoint with an audio tower (a 2-layer conformer) and
a vision tower, both tiny, the byte-level BPE of pipeserve/model/tiny/text.py plus Gemma 4's image and audio
tokens, and the processor config mlx-vlm's Gemma4Processor reads (its own numpy feature
extractor: no torch). The decoder is Gemma 4's E2B shape class shrunk: per-layer inputs,
KV-shared layers, sliding and full attention. Loadable by mlx_vlm.load and, for the language
model, mlx_lm.load. Engine thread (weights are numpy; mlx only builds shapes and writes
safetensors)."""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.tiny import text as tiny

FORMAT_VERSION = 2
# Gemma 4's own names (the released tokenizer's): image and audio begin/end and soft tokens
TOKENS = ("<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>")
AUDIO_MARK, IMAGE_MARK = "<|audio|>", "<|image|>"   # what a content part renders as
AUDIO_MS_PER_TOKEN = 40          # Gemma 4: one audio soft token per 40 ms
AUDIO_SEQ_LENGTH = 750           # at most 30 s of audio per clip, as released
SAMPLING_RATE = 16_000
IMAGE_PATCH, IMAGE_POOL, IMAGE_TOKENS = 8, 2, 16
BRANCH_GAIN = 48.0


def chat_template() -> str:
    """ChatML, with content parts: text as is, an image or an audio clip as its soft token
    (which the processor expands to the clip's tokens between its begin/end markers)."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.content is string %}{{- message.content }}"
        "{%- else %}{%- for part in message.content %}"
        "{%- if part.type == 'image' or part.type == 'image_url' %}{{- '" + IMAGE_MARK + "' }}"
        "{%- elif part.type == 'audio' or part.type == 'input_audio' %}{{- '" + AUDIO_MARK + "' }}"
        "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _config(ids: dict[str, int], eos: list[int]) -> dict[str, Any]:
    vocab = len(ids)
    text = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "global_head_dim": 32, "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 16, "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab, "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            # as released (mlx-lm's and mlx-vlm's defaults differ: name them)
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                      "rope_type": "default"}},
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
            # as the 26B and 31B: image tokens attend to their image's other tokens both ways
            "use_bidirectional_attention": "vision",
            "pad_token_id": eos[1], "eos_token_id": eos}
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 16, "global_head_dim": 16, "patch_size": IMAGE_PATCH,
              "position_embedding_size": 64, "pooling_kernel_size": IMAGE_POOL,
              "default_output_length": IMAGE_TOKENS}
    audio = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5, "output_proj_dims": 32}
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
            "vocab_size": vocab, "text_config": text, "vision_config": vision,
            "audio_config": audio, "hidden_size": text["hidden_size"],
            "image_token_id": ids["<|image|>"], "audio_token_id": ids["<|audio|>"],
            "video_token_id": ids["<|video|>"], "boi_token_id": ids["<|image>"],
            "eoi_token_id": ids["<image|>"], "boa_token_id": ids["<|audio>"],
            "eoa_token_id": ids["<audio|>"], "vision_soft_tokens_per_image": IMAGE_TOKENS,
            "audio_soft_tokens_per_image": AUDIO_SEQ_LENGTH,
            "audio_ms_per_token": AUDIO_MS_PER_TOKEN, "pad_token_id": eos[1],
            "eos_token_id": eos, "tie_word_embeddings": True}


def _fill(name: str, shape: tuple[int, ...], hidden: int) -> np.ndarray:
    """Deterministic value of one parameter, seeded by (SEED, crc32(name)): norms and layer
    scalars 1, clip bounds open, the text trunk as model=tiny's, towers fan-in scaled."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("input_min", "output_min"):
        return np.full(shape, -np.inf, np.float32)
    if leaf in ("input_max", "output_max"):
        return np.full(shape, np.inf, np.float32)
    if leaf == "layer_scalar" or ("norm" in name and leaf == "weight" and len(shape) == 1):
        # Gemma's post-branch norms carry the branch gain (as pipeserve/model/tiny/text.py's gemma3), so
        # greedy text does not just repeat one token
        post = name.startswith("language_model.") and any(k in name for k in tiny.GEMMA_POST_NORMS)
        return np.full(shape, BRANCH_GAIN if post else 1.0, np.float32)
    if len(shape) <= 1:
        return np.zeros(shape, np.float32)
    if name.startswith("language_model."):
        return tiny._fill(name.removeprefix("language_model."), shape, "qwen3", hidden)
    rng = np.random.default_rng([tiny.SEED, zlib.crc32(name.encode())])
    fan_in = shape[0] if "embedding_projection" in name else int(np.prod(shape[1:]))
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)


def write(out: Path, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from tokenizers import AddedToken

    tok = tiny.build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOKENS])
    ids = tok.get_vocab()
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = _config(ids, eos)
    config["torch_dtype"] = dtype
    module, _ = get_model_and_args(json.loads(json.dumps(config)))
    built = json.loads(json.dumps(config))
    model_config = update_module_configs(module.ModelConfig.from_dict(built), module, built,
                                         ["text", "vision", "audio"])
    model = module.Model(model_config)
    hidden = config["text_config"]["hidden_size"]
    weights = {name: mx.array(_fill(name, tuple(p.shape), hidden)).astype(getattr(mx, dtype))
               for name, p in sorted(tree_flatten(model.parameters()))}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    special = tiny.SPECIAL_TOKENS + TOKENS
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in special}
             for t in tiny.SPECIAL_TOKENS + tiny.ADDED_TOKENS + TOKENS}
    extra = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
             "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
             "video_token": "<|video|>"}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "extra_special_tokens": extra, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": 4096, "split_special_tokens": False, "chat_template": chat_template(),
    }
    processor = {"processor_class": "Gemma4Processor", "audio_seq_length": AUDIO_SEQ_LENGTH,
                 "audio_ms_per_token": AUDIO_MS_PER_TOKEN,
                 "image_processor": {"patch_size": IMAGE_PATCH, "max_soft_tokens": IMAGE_TOKENS,
                                     "pooling_kernel_size": IMAGE_POOL},
                 "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor",
                                       "feature_size": 128, "sampling_rate": SAMPLING_RATE}}
    files: dict[str, Any] = {
        "config.json": config, "tokenizer_config.json": tok_cfg,
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "generation_config.json": {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                                   "eos_token_id": eos, "pad_token_id": eos[1]},
        "processor_config.json": processor,
    }
    for fname, obj in files.items():
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    (out / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
