"""Reading a GGUF file's `<arch>.*` metadata into config.json fields: the typed getters and the
fields every transformer architecture shares (sizes, heads, norm epsilon, rope). Pure data."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import ConfigError


def meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise ConfigError(f"GGUF metadata lacks {key!r}")
    return int(v)


def meta_float(meta: dict[str, Any], key: str, default: float) -> float:
    """GGUF floats are float32: the shortest decimal of that float32 (1e-05, not 9.99999974e-06)."""
    import numpy as np
    return float(str(np.float32(meta.get(key, default))))


def common(meta: dict[str, Any], a: str, default_theta: float = 10000.0) -> dict[str, Any]:
    heads = meta_int(meta, f"{a}.attention.head_count")
    hidden = meta_int(meta, f"{a}.embedding_length")
    head_dim = meta_int(meta, f"{a}.attention.key_length", hidden // heads)
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": meta_int(meta, f"{a}.block_count"),
        "intermediate_size": meta_int(meta, f"{a}.feed_forward_length",
                                  meta.get(f"{a}.expert_feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": meta_int(meta, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta_float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta_float(meta, f"{a}.rope.freq_base", default_theta),
        "max_position_embeddings": meta_int(meta, f"{a}.context_length", 4096),
    }
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": meta_float(meta, f"{a}.rope.scaling.factor", 1.0)}
    elif scaling == "yarn" and a.startswith(("qwen", "gpt-oss")):
        cfg["rope_scaling"] = {
            "type": "yarn", "rope_type": "yarn", "factor": meta_float(meta, f"{a}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": meta_int(meta, f"{a}.rope.scaling.original_context_length")}
    elif scaling != "none":
        raise ConfigError(f"GGUF {a}.rope.scaling.type={scaling!r} is not supported for {a}; "
                          f"supported: none, linear{', yarn' if a.startswith('qwen') else ''}")
    rope_dim = meta_int(meta, f"{a}.rope.dimension_count", head_dim)
    cfg["_rope_dim"] = rope_dim
    return cfg


def full_rotary(cfg: dict[str, Any], a: str) -> dict[str, Any]:
    rope_dim = cfg.pop("_rope_dim")
    if rope_dim != cfg["head_dim"]:
        raise ConfigError(f"GGUF {a}.rope.dimension_count={rope_dim} is partial rotary (head dim "
                          f"{cfg['head_dim']}); mlx-lm's {a} model rotates the whole head")
    return cfg
