"""Owns the generated encoder models: `model=tiny_embed`, a deterministic random-weight BERT that
mlx-embeddings loads (its `bert` architecture: mean pooling, L2-normalised), and
`model=tiny_rerank`, a ModernBERT cross-encoder (ModernBertForSequenceClassification, one
sigmoid score per query-document pair), both with the tiny models' byte-level BPE. Any thread:
weights are numpy; mlx only builds shapes and writes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import cache_root, publish
from pipeserve.model.tiny.text import VOCAB_SIZE, build_tokenizer

FORMAT_VERSION = 1
SEED = 20261201
CONFIG: dict[str, Any] = {
    "model_type": "bert", "architectures": ["BertModel"], "vocab_size": VOCAB_SIZE,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "hidden_act": "gelu", "torch_dtype": "float32",
}
RERANK_CONFIG: dict[str, Any] = {
    "model_type": "modernbert", "architectures": ["ModernBertForSequenceClassification"],
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512,
    "classifier_pooling": "mean", "pipeline_config": {"binary_sigmoid": True},
    "torch_dtype": "float32",
}


def model_dir_name(task: str = "embed") -> str:
    return (f"tiny-bert-embed-v{FORMAT_VERSION}" if task == "embed"
            else f"tiny-modernbert-rerank-v{FORMAT_VERSION}")


def _write(out: Path, task: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if task == "embed":
        from mlx_embeddings.models.bert import Model, ModelArgs
        config = CONFIG
    else:
        from mlx_embeddings.models.modernbert import Model, ModelArgs  # type: ignore[assignment]
        config = RERANK_CONFIG
    model = Model(ModelArgs.from_dict(config))
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if ("LayerNorm" in name or "norm" in name.split(".")[-2:][0]) and name.endswith("weight"):
            array = np.ones(value.shape, np.float32)
        elif name.endswith("bias"):
            array = np.zeros(value.shape, np.float32)
        else:
            array = rng.normal(0.0, 0.05, value.shape).astype(np.float32)
        weights[name] = mx.array(array)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = build_tokenizer()
    if task != "embed":   # a cross-encoder reads "<start> query <end> document <end>"
        from tokenizers.processors import TemplateProcessing
        start, end = "<|im_start|>", "<|im_end|>"
        tok.post_processor = TemplateProcessing(
            single=f"{start} $A {end}", pair=f"{start} $A {end} $B:1 {end}:1",
            special_tokens=[(start, tok.token_to_id(start)), (end, tok.token_to_id(end))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    (out / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))


def ensure_embed_model(cache_dir: str | os.PathLike[str] | None = None,
                       task: str = "embed") -> Path:
    """The generated embedding (`task` embed) or reranking (rerank) model's directory, made
    once per cache."""
    root = cache_root(cache_dir)
    final = root / model_dir_name(task)
    if (final / "config.json").exists():
        return final
    return publish(final, lambda out: _write(out, task))
