"""Gemma 4 assistant drafters (draft=assistant): a small model that owns no KV of its own and
attends to the target's, loaded in the layout mlx-vlm's gemma4_assistant reads (Hugging
Face's Gemma4AssistantForCausalLM releases, `google/gemma-4-*-it-assistant`) with mlx-vlm's
own model code. Engine thread.

Layout (a directory: config.json + *.safetensors):
    config.json   model_type "gemma4_assistant", backbone_hidden_size (the target's width),
                  block_size, use_ordered_embeddings, a gemma4 text_config whose layers all
                  read shared KV (num_kv_shared_layers = num_hidden_layers)
    model.embed_tokens, model.layers.{i}.* (q_proj, q_norm, o_proj, mlp, norms: no k/v),
    model.norm, pre_projection (H, 2·H_target), post_projection (H_target, H),
    masked_embedding.* (centroid-routed output head, when use_ordered_embeddings)
One round for a row whose target KV holds positions [0, n) and whose next input is token x:
    h = the target's final hidden at n - 1;  repeat k times (query at position n - 1):
        h, logits = assistant([target_embed(x) · embed_scale | h], the target's K/V of its last
                              layer of each attention type)
        x = argmax(logits)   (a draft)
Rows draft together: their K/V are right-padded to the longest and masked by length."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

from pipeserve.core.rows import RowStore
from pipeserve.draft.taps import load_head
from pipeserve.errors import ConfigError
from pipeserve.kv.rotating import window_of
from pipeserve.model.tiny.assistant import ensure_assistant

log = logging.getLogger("pipeserve")


def load_assistant(path: str | Path, model: Any) -> tuple[Any, dict[str, int]]:
    """The assistant at `path`, bound to the target `model` (its input embedding), and the
    target layer whose KV each of its attention types reads (the target's last layer of that
    type that keeps KV, as Gemma 4's own KV sharing picks). ValueError names what does not
    fit."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"no config.json in {path}")
    target = getattr(model, "language_model", model)
    kind = getattr(getattr(target, "args", None), "model_type", None)
    if kind != "gemma4_text":
        raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 model, not a {kind}")
    config = json.loads((Path(path) / "config.json").read_text())
    if config.get("model_type") != "gemma4_assistant":
        raise ValueError(f"model_type is {config.get('model_type')!r}, not 'gemma4_assistant'")
    width = config.get("backbone_hidden_size")
    if width != target.args.hidden_size:
        raise ValueError(f"backbone_hidden_size={width} is not the target's hidden_size "
                         f"({target.args.hidden_size}): the assistant of another model")
    head, _ = load_drafter(str(path), kind="mtp")
    validate_drafter_compatibility(target, head, "mtp")
    head.bind(model)
    args = target.args
    owners: dict[str, int] = {}
    for i in range(args.num_hidden_layers - args.num_kv_shared_layers):
        owners[args.layer_types[i]] = i
    wanted = set(head.config.text_config.layer_types)
    missing = sorted(wanted - set(owners))
    if missing:
        raise ValueError(f"its layers read KV of type {missing}; the target's layers are "
                         f"{sorted(set(args.layer_types))}")
    return head, {t: owners[t] for t in wanted}


class _Row:
    __slots__ = ("hidden", "position")

    def __init__(self, position: int, hidden: mx.array) -> None:
        self.position = position   # the target position `hidden` (1, 1, H) is the output at
        self.hidden = hidden


class AssistantProposer:
    """draft=assistant: the target's forwards return its final hidden states (Logits.hidden);
    a row keeps only the last one the target kept. Each round reads the row's KV from the
    target's row store (`target_store`, set by the draft stage before it proposes), so the
    drafter has nothing to roll back after verify."""

    name = "assistant"

    def __init__(self, cfg: Any, ctx: Any) -> None:
        path, (self.head, self.layers) = load_head(cfg, ctx, "Gemma 4 assistant",
                                                   ensure_assistant, load_assistant)
        probe = ctx.layout.make_cache(ctx.model)
        plain = [i for i in self.layers.values()
                 if type(probe[i]) not in (KVCache, RotatingKVCache)]
        if plain:
            raise ConfigError(f"draft=assistant reads the target's KV as plain keys and "
                              f"values; kv={cfg.kv.name} stores target layers {plain} as "
                              f"{type(probe[plain[0]]).__name__} (use kv=dense)")
        self.dtype = self.head.pre_projection.weight.dtype
        self.rows: dict[str, _Row] = {}
        self.target_store: RowStore | None = None
        log.info("draft=assistant: %s loaded (reads the KV of target layers %s)", path,
                 sorted(self.layers.values()))

    def capture(self, req: Any, position: int, hidden: mx.array) -> None:
        self.rows[req.request_id] = _Row(position + hidden.shape[1] - 1, hidden[:, -1:])

    def propose(self, reqs: list[Any], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        ready = []   # (index, n, {type: (keys, values)}, hidden)
        for i, (req, ctx, k) in enumerate(zip(reqs, contexts, limits)):
            n = len(ctx) - 1   # target positions held; ctx[-1] is the row's next input
            row = self.rows.get(req.request_id)
            if k <= 0 or row is None or row.position != n - 1:
                continue   # (its hidden state is not the one before the input: no draft)
            shared = self._target_kv(req.request_id, n)
            if shared is not None:
                ready.append((i, n, shared, row.hidden))
        if not ready:
            return out
        width = max(limits[i] for i, *_ in ready)
        tokens = self._draft([contexts[i][-1] for i, *_ in ready], ready, width)
        for (i, *_), got in zip(ready, tokens.tolist()):
            out[i] = got[:limits[i]]
        return out

    def _target_kv(self, rid: str, n: int) -> dict[str, tuple[mx.array, mx.array]] | None:
        """The row's K/V of the layers the assistant reads, (1, heads, n, dim) each (a
        sliding-window layer's: its last min(n, window) positions, as mlx-vlm reads a rotating
        cache); None when the target store does not hold exactly n positions for it."""
        shared = {}
        for kind, layer in self.layers.items():
            cache = self.target_store.layer_of(rid, layer) if self.target_store else None
            if cache is None or cache.offset != n:
                return None
            shared[kind] = (window_of(cache, n) if isinstance(cache, RotatingKVCache)
                            else (cache.keys[..., :n, :], cache.values[..., :n, :]))
        return shared

    def _draft(self, inputs: list[int], ready: list[Any], width: int) -> mx.array:
        """(rows, width) greedy drafts of the rows in `ready`, in one chain of forwards."""
        lengths = [n for _, n, _, _ in ready]
        shared = {}
        for kind in self.layers:
            longest = max(s[kind][0].shape[2] for _, _, s, _ in ready)
            keys = [_pad(s[kind][0], longest) for _, _, s, _ in ready]
            values = [_pad(s[kind][1], longest) for _, _, s, _ in ready]
            shared[kind] = (mx.concatenate(keys).astype(self.dtype),
                            mx.concatenate(values).astype(self.dtype))
        hidden = mx.concatenate([h for *_, h in ready]).astype(self.dtype)
        if len(ready) == 1:
            n = lengths[0]
            self.head.set_shared_kv(shared, n, position=n - 1, kv_valid_len=n)
            bonus: Any = inputs[0]
        else:
            valid = mx.array(lengths, dtype=mx.int32)
            self.head.set_shared_kv(shared, valid, position=valid - 1, kv_valid_len=valid)
            bonus = mx.array(inputs, dtype=mx.int32)
        try:
            return self.head.draft_block(bonus, hidden, None, width + 1, _greedy, greedy=True)
        finally:
            self.head.set_shared_kv({}, 0)   # the target's KV is not held past the round

    def settle(self, reqs: list[Any]) -> None:
        """Nothing to cut back: the drafter keeps no KV."""

    def release(self, req: Any) -> None:
        self.rows.pop(req.request_id, None)


def _pad(x: mx.array, length: int) -> mx.array:
    """(1, heads, n, dim) right-padded with zeros to `length` positions (masked out)."""
    extra = length - x.shape[2]
    return x if not extra else mx.pad(x, [(0, 0), (0, 0), (0, extra), (0, 0)])


def _greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
