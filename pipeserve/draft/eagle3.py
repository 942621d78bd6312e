"""EAGLE-3 draft heads (draft=eagle3): a one-layer Llama-style decoder that drafts from the
target's hidden states at three layers, loaded from the published checkpoint layout (the
EAGLE-3 reference release and SpecForge, as vLLM's and SGLang's llama_eagle3 read them).
Engine thread.

Layout (a directory: config.json + *.safetensors):
    fc.weight (H, 3·H_target)        fuses the three taps (the residual stream entering the
                                     target's layers `eagle_aux_hidden_state_layer_ids`,
                                     default (2, L // 2, L - 3))
    midlayer.* (or layers.0.*)       input_layernorm, hidden_norm, post_attention_layernorm,
                                     self_attn.{q,k,v,o}_proj (q/k/v read 2H: [embedding | hidden]),
                                     mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight (draft_vocab, H)
    d2t (draft_vocab,)               draft id d is target id d + d2t[d]; t2d is not needed
    embed_tokens.weight (optional)   else the target's embedding
One step at position t (hidden: the fused taps at t, or the previous step's output):
    r = hidden;  x = [input_layernorm(embed(token[t+1])) | hidden_norm(hidden)]
    r = r + attn(x);  out = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out)) predict token[t+2];  `out` feeds the next chained step.
The head's KV has one entry per target position (RoPE offset t), as draft=mtp's does, so the
MTP proposer's bookkeeping drives it unchanged."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from pipeserve.draft.taps import install_taps


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or hidden // self.n_heads
        self.scale = self.head_dim ** -0.5
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.rope = initialize_rope(self.head_dim, cfg.get("rope_theta", 10000.0), False,
                                    cfg.get("rope_scaling"),
                                    cfg.get("max_position_embeddings", 8192))

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        mask = create_attention_mask(x, cache)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class Eagle3Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Eagle3Mlp(hidden, cfg["intermediate_size"])
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any) -> mx.array:
        normed = self.hidden_norm(hidden)
        r = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        r = r + self.self_attn(x, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Block(nn.Module):
    """The checkpoint's parameters, named as vLLM names them (midlayer → layers.0)."""

    def __init__(self, cfg: dict[str, Any], target_hidden: int, embed: bool) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.layers = [Eagle3Layer(cfg)]
        self.norm = nn.RMSNorm(hidden, eps=cfg.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(hidden, cfg.get("draft_vocab_size") or cfg["vocab_size"],
                                 bias=False)
        if embed:
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)


class Eagle3Head:
    """An EAGLE-3 drafter bound to its target (the MTP proposer's head interface)."""

    num_layers = 1

    def __init__(self, block: Eagle3Block, embed: Callable[[mx.array], mx.array],
                 d2t: mx.array | None, hidden_size: int) -> None:
        self.block, self.embed, self.hidden_size = block, embed, hidden_size
        # draft id → target id (identity when the draft vocabulary is the target's)
        self.to_target = (None if d2t is None
                          else mx.arange(d2t.shape[0], dtype=mx.int32) + d2t.astype(mx.int32))

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, hidden: mx.array, next_ids: mx.array, cache: list[Any],
                 step: int = 0) -> tuple[mx.array, mx.array]:
        """hidden (B, L, 3·H_target) fused taps, or (B, L, H) a chained step's output;
        next_ids (B, L) the tokens at t+1..t+L. Returns (draft-vocabulary logits, out)."""
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.block.fc(hidden)
        out = self.block.layers[0](self.embed(next_ids), hidden, cache[0])
        return self.block.lm_head(self.block.norm(out)), out

    def pick(self, logits: mx.array) -> mx.array:
        """Greedy draft ids in the target's vocabulary from (B, V_draft) logits."""
        ids = mx.argmax(logits, axis=-1)
        return ids if self.to_target is None else self.to_target[ids]


def aux_layers(cfg: dict[str, Any], num_target_layers: int) -> list[int]:
    """The target layers whose input the head reads: the checkpoint's
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else the reference default."""
    given = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = list(given) if given else [2, num_target_layers // 2, num_target_layers - 3]
    if len(ids) != 3 or any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads the target's layers {ids}, but the target has "
                         f"{num_target_layers} layers (set eagle_config."
                         "eagle_aux_hidden_state_layer_ids in the draft's config.json)")
    return ids


def _tensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    found: dict[str, mx.array] = {}
    for f in files:
        found.update(mx.load(str(f)))
    return {k.replace("midlayer.", "layers.0.").removeprefix("model."): v
            for k, v in found.items() if k != "t2d"}


def load_eagle3(path: str | Path, model: Any) -> Eagle3Head:
    """The EAGLE-3 head at `path`, bound to the loaded target `model` (its taps installed),
    cast to the target's dtype and evaluated. Raises ValueError on a layout it cannot read."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json (an EAGLE-3 checkpoint directory)")
    cfg = json.loads(config_file.read_text())
    text = getattr(model, "language_model", model)
    trunk = text.model
    target_hidden = trunk.embed_tokens.weight.shape[1]
    if cfg["vocab_size"] != trunk.embed_tokens.weight.shape[0]:
        raise ValueError(f"{path}: vocab_size {cfg['vocab_size']} but the target's vocabulary "
                         f"has {trunk.embed_tokens.weight.shape[0]} rows")
    weights = _tensors(path)
    if any(k.endswith(".scales") for k in weights):
        raise ValueError(f"{path}: quantized EAGLE-3 weights are not supported")
    d2t = weights.pop("d2t", None)
    block = Eagle3Block(cfg, target_hidden, embed="embed_tokens.weight" in weights)
    dtype = trunk.norm.weight.dtype
    block.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    block.eval()
    mx.eval(block.parameters())
    install_taps(model, aux_layers(cfg, len(trunk.layers)))
    embed = block.embed_tokens if "embed_tokens.weight" in weights else trunk.embed_tokens
    return Eagle3Head(block, embed, d2t, cfg["hidden_size"])
