"""A generated EAGLE-3 draft checkpoint for a generated target (draft=eagle3 on model=tiny and
friends), in the published layout pipeserve/draft/eagle3.py reads: config.json with
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`, `midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t` and `t2d`; no embed_tokens (the target's is shared). Written beside
the target in the model cache on first use. Main thread at launch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import publish

FORMAT_VERSION = 1
ATTEND_GAIN = 8.0   # q·k scale on the token embedding: each position attends to its own token
CONTEXT_GAIN = 0.25   # how much of the fused taps the head keeps


def ensure_eagle3(target: Path) -> Path:
    """The generated EAGLE-3 head for the generated model at `target` (made once)."""
    final = target.parent / f"{target.name}-eagle3-v{FORMAT_VERSION}"
    return publish(final, lambda tmp: _write(tmp, target))


def _write(out: Path, target: Path) -> None:
    import mlx.core as mx

    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, vocab, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    weights = {k: mx.array(v) for k, v in _weights(target, hidden, vocab, layers).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(hidden, vocab, layers), indent=2) + "\n")


def _config(hidden: int, vocab: int, layers: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": hidden,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "vocab_size": vocab,
            "draft_vocab_size": vocab // 2, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]},
            "torch_dtype": "float32"}


def _weights(target: Path, hidden: int, vocab: int, layers: int) -> dict[str, np.ndarray]:
    """A head that reads mostly the next token's own embedding (attention onto its own
    position) plus a little of the taps, and scores the even target ids with the target's
    output rows: its drafts are the target's guess from that token alone."""
    import mlx.core as mx

    target_w = mx.load(str(target / "model.safetensors"))
    trunk = "language_model." if "language_model.model.embed_tokens.weight" in target_w else ""
    embed = np.array(target_w[f"{trunk}model.embed_tokens.weight"].astype(mx.float32))
    head = (np.array(target_w[f"{trunk}lm_head.weight"].astype(mx.float32))
            if f"{trunk}lm_head.weight" in target_w else embed)   # (Qwen3.5: under its trunk)
    rng = np.random.default_rng(3)
    eye, zero = np.eye(hidden, dtype=np.float32), np.zeros((hidden, hidden), np.float32)
    draft_ids = np.arange(0, vocab, 2)   # the draft vocabulary: the even target ids
    fc = np.concatenate([zero, zero, CONTEXT_GAIN * eye], axis=1)
    mid = "midlayer."
    w = {"fc.weight": fc, "norm.weight": np.ones(hidden, np.float32),
         "lm_head.weight": head[draft_ids],
         "d2t": (draft_ids - np.arange(len(draft_ids))).astype(np.int64),
         "t2d": np.isin(np.arange(vocab), draft_ids)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{mid}{norm}.weight"] = np.ones(hidden, np.float32)
    embed_part = np.concatenate([eye, zero], axis=1)   # (H, 2H): reads [embedding | hidden]
    w[f"{mid}self_attn.q_proj.weight"] = ATTEND_GAIN * embed_part
    w[f"{mid}self_attn.k_proj.weight"] = ATTEND_GAIN * embed_part
    w[f"{mid}self_attn.v_proj.weight"] = embed_part
    w[f"{mid}self_attn.o_proj.weight"] = eye
    small = 0.1 / np.sqrt(hidden)
    w[f"{mid}mlp.gate_proj.weight"] = rng.standard_normal((2 * hidden, hidden)).astype(np.float32) * small
    w[f"{mid}mlp.up_proj.weight"] = rng.standard_normal((2 * hidden, hidden)).astype(np.float32) * small
    w[f"{mid}mlp.down_proj.weight"] = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32) * small
    return w
