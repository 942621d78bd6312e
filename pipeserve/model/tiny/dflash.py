"""A generated DFlash draft checkpoint for a generated target (draft=dflash on model=tiny and
friends), in the published layout pipeserve/draft/dflash.py reads: config.json with
`architectures: ["DFlashDraftModel"]`, `block_size` and `dflash_config` {target_layer_ids,
mask_token_id}; `fc`, `hidden_norm`, `norm` and Qwen3-shaped `layers.{i}.*` (q_norm and
k_norm included); no embedding or lm_head (the target's are used). Random weights with a fixed
seed: the drafts are rarely right, which is what the lossless tests need. Written beside the
target in the model cache on first use. Main thread at launch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import publish

FORMAT_VERSION = 1
BLOCK_SIZE = 8


def ensure_dflash(target: Path) -> Path:
    """The generated DFlash drafter for the generated model at `target` (made once)."""
    final = target.parent / f"{target.name}-dflash-v{FORMAT_VERSION}"
    return publish(final, lambda tmp: _write(tmp, target))


def _write(out: Path, target: Path) -> None:
    import mlx.core as mx

    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    cfg = _config(text["hidden_size"], text["vocab_size"], text["num_hidden_layers"])
    weights = {k: mx.array(v) for k, v in _weights(cfg, text["hidden_size"]).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _config(hidden: int, vocab: int, layers: int) -> dict[str, Any]:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": hidden // 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "vocab_size": vocab, "block_size": BLOCK_SIZE, "num_target_layers": layers,
            "dflash_config": {"target_layer_ids": [0, layers - 1], "mask_token_id": vocab - 1},
            "torch_dtype": "float32"}


def _weights(cfg: dict[str, Any], target_hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    taps = len(cfg["dflash_config"]["target_layer_ids"])

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)   # noqa: E731
    w = {"fc.weight": dense(hidden, taps * target_hidden), "hidden_norm.weight": ones(hidden),
         "norm.weight": ones(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": dense(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": dense(kv * head_dim, hidden),
                  p + "self_attn.v_proj.weight": dense(kv * head_dim, hidden),
                  p + "self_attn.o_proj.weight": 0.5 * dense(hidden, heads * head_dim),
                  p + "self_attn.q_norm.weight": ones(head_dim),
                  p + "self_attn.k_norm.weight": ones(head_dim),
                  p + "mlp.gate_proj.weight": dense(inner, hidden),
                  p + "mlp.up_proj.weight": dense(inner, hidden),
                  p + "mlp.down_proj.weight": 0.5 * dense(hidden, inner),
                  p + "input_layernorm.weight": ones(hidden),
                  p + "post_attention_layernorm.weight": ones(hidden)})
    return w
