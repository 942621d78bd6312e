"""A generated Gemma 4 assistant drafter for the generated Gemma 4 target (draft=assistant on
model=tiny model.arch=gemma4), in the layout mlx-vlm's gemma4_assistant reads (Hugging
Face's Gemma4AssistantConfig): config.json with model_type `gemma4_assistant`,
`backbone_hidden_size` and a nested gemma4 `text_config` whose layers all read shared KV;
`model.embed_tokens`, `model.layers.*` (no k/v projections), `model.norm`, `pre_projection`,
`post_projection`. Written beside the target in the model cache on first use. Main thread at
launch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import publish

FORMAT_VERSION = 1
BLOCK_SIZE = 4   # the released assistants' block: three drafts per round


def ensure_assistant(target: Path) -> Path:
    """The generated assistant drafter for the generated Gemma 4 model at `target` (made
    once)."""
    final = target.parent / f"{target.name}-assistant-v{FORMAT_VERSION}"
    return publish(final, lambda tmp: _write(tmp, target))


def _write(out: Path, target: Path) -> None:
    import mlx.core as mx

    config = json.loads((target / "config.json").read_text())
    if config.get("model_type") != "gemma4_text":
        raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 model; {target} is a "
                         f"{config.get('model_type')}")
    source = mx.load(str(target / "model.safetensors"))
    weights = {k: mx.array(v) for k, v in _weights(config, source).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(config), indent=2) + "\n")


def _config(target: dict[str, Any]) -> dict[str, Any]:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "global_head_dim", "rms_norm_eps", "vocab_size", "sliding_window",
            "max_position_embeddings", "rope_parameters", "final_logit_softcapping",
            "hidden_activation")
    text = {k: target[k] for k in keep if k in target}
    text.update(model_type="gemma4_text", num_hidden_layers=1, num_kv_shared_layers=1,
                layer_types=["full_attention"], hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=target["vocab_size"], use_double_wide_mlp=False,
                tie_word_embeddings=True)
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            "backbone_hidden_size": target["hidden_size"], "use_ordered_embeddings": False,
            "tie_word_embeddings": True, "block_size": BLOCK_SIZE, "text_config": text,
            "torch_dtype": "float32"}


def _weights(config: dict[str, Any], source: dict[str, Any]) -> dict[str, np.ndarray]:
    """A drafter that is the target's last layer run on the next token's embedding alone
    (that layer's attention reads the target's own KV of that layer), with the target's final
    norm and tied output rows: its drafts are the target skipping its earlier layers."""
    import mlx.core as mx

    hidden = config["hidden_size"]
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    w = {k: np.array(v.astype(mx.float32)) for k, v in source.items()}
    eye, zero = np.eye(hidden, dtype=np.float32), np.zeros((hidden, hidden), np.float32)
    out = {"model.embed_tokens.weight": w.get("lm_head.weight", w["model.embed_tokens.weight"]),
           "model.norm.weight": w["model.norm.weight"],
           "pre_projection.weight": np.concatenate([eye, zero], axis=1),   # [token | hidden]
           "post_projection.weight": eye}
    for name, value in w.items():
        if not name.startswith(last):
            continue
        part = name[len(last):]
        if part.startswith(("self_attn.k_", "self_attn.v_")):
            continue   # the assistant's layers read the target's K/V
        out[f"model.layers.0.{part}"] = value
    return out
