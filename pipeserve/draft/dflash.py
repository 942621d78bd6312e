"""DFlash block-diffusion drafters (draft=dflash), loaded from the published layout (z-lab's
DFlash releases, as its reference MLX code and SGLang read them). Engine thread.

Layout (a directory: config.json + *.safetensors):
    config.json  architectures ["DFlashDraftModel"], block_size, dflash_config
                 {target_layer_ids, mask_token_id}, a Qwen3-shaped decoder (hidden_size,
                 num_hidden_layers, heads, head_dim, intermediate_size, rope_theta, …)
    fc.weight (H, len(target_layer_ids)·H_target), hidden_norm.weight, norm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj, .q_norm, .k_norm, layers.{i}.mlp.{gate,up,down}_proj,
    layers.{i}.input_layernorm, .post_attention_layernorm   (embedding and lm_head: the target's)
The target's hidden states leaving `target_layer_ids` are fused (ctx = hidden_norm(fc(·))) and
each draft layer projects them into its own KV (kept per row: the context). A proposal is one
non-causal forward of the block [last token, mask, …, mask] at the positions after the context:
every mask position's logits give its token, so the whole block is drafted at once. The block's
own keys are never cached, so a rejected draft needs no rollback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from pipeserve.draft.eagle3 import Eagle3Mlp
from pipeserve.draft.taps import install_taps, load_head
from pipeserve.draft.mtp import output_head
from pipeserve.core.rows import RowStore
from pipeserve.model.tiny.dflash import ensure_dflash

ARCHITECTURES = ("DFlashDraftModel",)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        head_dim = cfg.get("head_dim") or hidden // self.n_heads
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, length, _ = x.shape
        return x.reshape(b, length, n, -1).transpose(0, 2, 1, 3)

    def extend(self, ctx: mx.array, rope: Any, cache: KVCache) -> None:
        """Append the context entries of ctx (1, S, H) (positions cache.offset on)."""
        k = rope(self.k_norm(self._heads(self.k_proj(ctx), self.n_kv)), offset=cache.offset)
        cache.update_and_fetch(k, self._heads(self.v_proj(ctx), self.n_kv))

    def __call__(self, x: mx.array, rope: Any, cache: KVCache) -> mx.array:
        """x (1, L, H) the block, at the positions after the context; it sees the whole
        context and all of itself (non-causal); nothing is cached."""
        b, length, _ = x.shape
        start = cache.offset
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start)
        keys = rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), offset=start)
        values = self._heads(self.v_proj(x), self.n_kv)
        if start:
            keys = mx.concatenate([cache.keys[..., :start, :], keys], axis=2)
            values = mx.concatenate([cache.values[..., :start, :], values], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Eagle3Mlp(hidden, cfg["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, x: mx.array, rope: Any, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashBlock(nn.Module):
    """The checkpoint's parameters, under their published names."""

    def __init__(self, cfg: dict[str, Any], num_taps: int, target_hidden: int) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.fc = nn.Linear(num_taps * target_hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.layers = [DFlashLayer(cfg) for _ in range(cfg["num_hidden_layers"])]
        self.norm = nn.RMSNorm(hidden, eps=eps)


class DFlashHead:
    """A DFlash drafter bound to its target: the target's embedding and output head."""

    def __init__(self, block: DFlashBlock, cfg: dict[str, Any], embed: Any, head: Any) -> None:
        self.block, self.embed, self.head = block, embed, head
        dflash = cfg.get("dflash_config") or {}
        self.block_size = int(dflash.get("block_size", cfg.get("block_size", 16)))
        self.mask_id = int(dflash["mask_token_id"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rope = initialize_rope(head_dim, cfg.get("rope_theta", 10000.0), False,
                                    cfg.get("rope_scaling"),
                                    cfg.get("max_position_embeddings", 8192))

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.block.layers]

    def extend(self, hidden: mx.array, cache: list[Any]) -> None:
        """Append the target's fused taps `hidden` (1, S, n·H_target) to the row's context."""
        ctx = self.block.hidden_norm(self.block.fc(hidden))
        for layer, c in zip(self.block.layers, cache):
            layer.self_attn.extend(ctx, self.rope, c)

    def draft(self, last: int, num: int, cache: list[Any]) -> mx.array:
        """`num` tokens after `last` (the row's input, at the position after its context), in
        one forward of the block [last, mask × num]: (num,) target ids."""
        ids = mx.array([[last] + [self.mask_id] * num], dtype=mx.uint32)
        h = self.embed(ids)
        for layer, c in zip(self.block.layers, cache):
            h = layer(h, self.rope, c)
        return mx.argmax(self.head(self.block.norm(h[:, 1:])), axis=-1)[0]


def load_dflash(path: str | Path, model: Any) -> DFlashHead:
    """The DFlash drafter at `path`, bound to the loaded target `model` (taps installed on
    the outputs of its `target_layer_ids`), cast to the target's dtype and evaluated.
    Raises ValueError on a layout it cannot read."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json (a DFlash checkpoint directory)")
    cfg = json.loads(config_file.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not a DFlash drafter "
                         f"(expected one of {list(ARCHITECTURES)})")
    dflash = cfg.get("dflash_config") or {}
    layer_ids = list(dflash.get("target_layer_ids") or [])
    trunk = getattr(model, "language_model", model).model
    if not layer_ids or any(not 0 <= i < len(trunk.layers) for i in layer_ids):
        raise ValueError(f"{path}: dflash_config.target_layer_ids {layer_ids} must name layers "
                         f"of the target, which has {len(trunk.layers)}")
    if "mask_token_id" not in dflash:
        raise ValueError(f"{path}: dflash_config has no mask_token_id")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    weights = {k: v for f in files for k, v in mx.load(str(f)).items()}
    block = DFlashBlock(cfg, len(layer_ids), trunk.embed_tokens.weight.shape[1])
    dtype = trunk.norm.weight.dtype
    block.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    block.eval()
    mx.eval(block.parameters())
    install_taps(model, layer_ids, outputs=True)
    return DFlashHead(block, cfg, trunk.embed_tokens, output_head(model))


class _Context:
    """Where one row's DFlash context is: `end` the next target position it lacks (None:
    nothing yet), `pending` the target's fused taps (position, (1, n, ·)) not yet fed."""

    __slots__ = ("end", "pending")

    def __init__(self) -> None:
        self.end: int | None = None
        self.pending: list[tuple[int, mx.array]] = []


class DFlashProposer:
    """draft=dflash: the target's forwards return its fused taps (Logits.hidden); each row's
    context takes the positions the target kept, then one block forward drafts up to
    block_size - 1 tokens. Positions never computed here (a prompt-cache hit) are left out of
    the context, which starts at the first position this server computed (RoPE is relative).
    Its per-row caches live in its own RowStore; nothing is rolled back (the block's keys are
    never cached)."""

    name = "dflash"

    def __init__(self, cfg: Any, ctx: Any) -> None:
        _, self.head = load_head(cfg, ctx, "DFlash", ensure_dflash, load_dflash)
        self.rows: dict[str, _Context] = {}
        self.kv = RowStore(self.head.make_cache)

    def capture(self, req: Any, position: int, hidden: mx.array) -> None:
        self.rows.setdefault(req.request_id, _Context()).pending.append((position, hidden))

    def propose(self, reqs: list[Any], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out = []
        for req, ctx, k in zip(reqs, contexts, limits):
            row = self.rows.setdefault(req.request_id, _Context())
            cache = self.kv.own(req.request_id)
            if not self._catch_up(row, cache, len(ctx) - 1) or k <= 0:
                out.append([])
                continue
            num = min(k, self.head.block_size - 1)
            out.append(self.head.draft(ctx[-1], num, cache).tolist())
        return out

    def _catch_up(self, row: _Context, cache: list[Any], upto: int) -> bool:
        """Feed the pending taps of positions before `upto` (the input's); True when the
        context then ends right before it."""
        keep: list[tuple[int, mx.array]] = []
        for pos, hidden in sorted(row.pending, key=lambda p: p[0]):
            if keep:   # past the input: the next round's
                keep.append((pos, hidden))
                continue
            if row.end is not None and pos < row.end:   # (partly consumed)
                hidden, pos = hidden[:, row.end - pos:], row.end
            if hidden.shape[1] == 0:
                continue
            if row.end is not None and pos != row.end:   # a gap: start the context over
                for c in cache:
                    c.trim(c.offset)
                row.end = None
            n = min(hidden.shape[1], upto - pos)
            if n > 0:
                self.head.extend(hidden[:, :n], cache)
                row.end = pos + n
            if n < hidden.shape[1]:
                keep.append((pos + max(n, 0), hidden[:, max(n, 0):]))
        row.pending = keep
        return row.end == upto

    def settle(self, reqs: list[Any]) -> None:
        """Nothing to cut back: the context holds only kept positions."""

    def release(self, req: Any) -> None:
        self.rows.pop(req.request_id, None)
        self.kv.release(req.request_id)
