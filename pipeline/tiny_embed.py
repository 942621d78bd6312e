"""Owns the generated embedding model (`model=tiny_embed`): a deterministic random-weight BERT
that mlx-embeddings loads (its `bert` architecture: mean pooling, L2-normalised), with the
tiny models' byte-level BPE. Any thread: weights are numpy; mlx only builds shapes and writes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model_cache import cache_root, publish
from pipeline.tiny import VOCAB_SIZE, build_tokenizer

FORMAT_VERSION = 1
SEED = 20261201
CONFIG: dict[str, Any] = {
    "model_type": "bert", "architectures": ["BertModel"], "vocab_size": VOCAB_SIZE,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "hidden_act": "gelu", "torch_dtype": "float32",
}


def model_dir_name() -> str:
    return f"tiny-bert-embed-v{FORMAT_VERSION}"


def _write(out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models.bert import Model, ModelArgs

    model = Model(ModelArgs.from_dict(CONFIG))
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if "LayerNorm" in name and name.endswith("weight"):
            array = np.ones(value.shape, np.float32)
        elif name.endswith("bias"):
            array = np.zeros(value.shape, np.float32)
        else:
            array = rng.normal(0.0, 0.05, value.shape).astype(np.float32)
        weights[name] = mx.array(array)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    (out / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))


def ensure_embed_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The generated embedding model's directory, made once per cache."""
    root = cache_root(cache_dir)
    final = root / model_dir_name()
    if (final / "config.json").exists():
        return final
    return publish(final, _write)
