"""Proposers for speculative decoding (the `draft` config group): each offers up to
`draft.num_draft_tokens` tokens per decode row; the verify stage checks them against the target.
Engine thread. Each proposer keeps its per-row state by request id and drops it in `release`;
a proposer with KV of its own (draft=model, draft=mtp) keeps it in its own RowStore."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from pipeserve.config import ServeConfig
from pipeserve.draft.ngram import NgramIndex
from pipeserve.errors import ConfigError
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import PlannedRow
from pipeserve.request import Request
from pipeserve.core.stage import StageDeps
from pipeserve.core.forward import Forward
from pipeserve.draft.mtp import load_mtp
from pipeserve.model.loader import load
from pipeserve.draft.eagle3 import load_eagle3
from pipeserve.draft.taps import load_head
from pipeserve.model.tiny.eagle3 import ensure_eagle3

log = logging.getLogger("pipeserve")


class NoDraft:
    """draft=none: no drafting stage runs at all (kept so the group has a `_target_`)."""

    name = "none"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        pass

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        """Up to limits[i] tokens to follow contexts[i] (row i's tokens up to and including
        the one it feeds next)."""
        return [[] for _ in reqs]

    def settle(self, reqs: list[Request]) -> None:
        """After the step is applied (each row's `num_computed_tokens` final): drop draft
        state past what the target kept."""

    def capture(self, req: Request, position: int, hidden: mx.array) -> None:
        """The target's hidden states of `req` from `position` on (draft=mtp only)."""

    def release(self, req: Request) -> None:
        """The row finished: drop its draft state now (the engine may go idle)."""


class NgramProposer(NoDraft):
    """draft=ngram: prompt lookup over the row's own prompt and output (no model)."""

    name = "ngram"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        self.n_min, self.n_max = cfg.draft.ngram_min, cfg.draft.ngram_max
        self.index: dict[str, NgramIndex] = {}

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out = []
        for req, ctx, k in zip(reqs, contexts, limits):
            index = self.index.get(req.request_id)
            if index is None or len(ctx) < len(index):   # (rows only grow; rebuild if not)
                index = self.index[req.request_id] = NgramIndex(self.n_min, self.n_max)
            index.extend(ctx[len(index):])
            out.append(index.propose(k))
        return out

    def release(self, req: Request) -> None:
        self.index.pop(req.request_id, None)


@dataclass(slots=True)
class _Round:
    """The draft store after one propose: the rows it drafted, in the decode batch's order,
    how many positions each holds (`held`) and held before the drafts were fed (`base`); with
    recurrent layers, their state at `base` (the rollback)."""

    held: dict[str, int]
    base: dict[str, int]
    snapshot: Any = None


class ModelProposer(NoDraft):
    """draft=model: a smaller model with the same tokenizer drafts greedily. It is a second
    runner — its own RowStore (made from the draft model's caches) and Forward — so the draft
    batches, pads and trims exactly as the target does. Per round, rows catch up on what the
    target accepted (prompt chunks for rows far behind; the last few tokens fed in the decode
    batch), then every drafting row decodes together, one forward per draft position. After
    verify, the draft KV is cut back to what the target kept: trimmed (attention layers), or
    restored to the round's snapshot (recurrent layers; the next round replays the accepted
    tokens)."""

    name = "model"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        from dataclasses import replace

        from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

        draft_cfg = replace(cfg.model, path=cfg.draft.path, name="draft", chat_template=None,
                            adapter=None, adapters=[])   # the draft runs without the adapter (verify uses it)
        self.draft = load(draft_cfg)
        target_vocab = ctx.loaded.tokenizer.get_vocab()
        draft_vocab = self.draft.tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            diff = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
            raise ConfigError(
                f"draft.path={cfg.draft.path}: the draft model's tokenizer differs from the "
                f"target's ({len(draft_vocab)} vs {len(target_vocab)} tokens, {diff} entries "
                "differ); speculative decoding needs the same tokenizer")
        probe = make_prompt_cache(self.draft.model)
        if any(isinstance(c, RotatingKVCache) or not (c.is_trimmable() or
                                                      isinstance(c, ArraysCache))
               for c in probe):
            raise ConfigError(
                f"draft.path={cfg.draft.path}: the draft model has sliding-window layers "
                "whose state cannot be rolled back; use a draft model without them")
        self.recurrent = not all(c.is_trimmable() for c in probe)
        self.kv = RowStore(lambda: make_prompt_cache(self.draft.model))
        self.forward = Forward(self.draft.model)
        self.chunk = cfg.scheduler.prefill_chunk
        self.k = cfg.draft.num_draft_tokens
        self.held: dict[str, int] = {}   # positions of each row's context the store holds
        self._round: _Round | None = None
        log.info("draft model %s loaded (%.1f MB)", self.draft.path,
                 self.draft.weight_bytes / 1e6)

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        try:
            return self._propose(reqs, contexts, limits)
        except Exception:   # these rows' draft KV is in an unknown state: start them over
            for req in reqs:
                self.release(req)
            raise

    def _propose(self, reqs: list[Request], contexts: list[list[int]],
                 limits: list[int]) -> list[list[int]]:
        kv, held = self.kv, self.held
        self._round = None
        for req, ctx in zip(reqs, contexts):
            rid = req.request_id
            if held.get(rid, 0) >= len(ctx) or rid not in kv:
                self.release(req)   # ahead of what the target kept (a round not settled)
            held[rid] = held.get(rid, 0)
        # rows further behind than one round leaves them catch up by prompt chunks, outside
        # the decode batch, to their context but its last token (the input)
        far = [(req, len(ctx) - 1) for req, ctx in zip(reqs, contexts)
               if len(ctx) - held[req.request_id] > 1 + self.k]
        kv.park([req.request_id for req, _ in far])
        while far:
            chunks = [self._chunk(req, held[req.request_id], end) for req, end in far]
            self.forward.prefill(chunks, kv)
            for row in chunks:
                held[row.request_id] += row.num_tokens
            far = [(req, end) for req, end in far if held[req.request_id] < end]
        # every row feeds the rest of its context, its input last: logits for the first draft
        rows = [PlannedRow(req, held[req.request_id], len(ctx) - held[req.request_id])
                for req, ctx in zip(reqs, contexts)]
        logits = self.forward.feed(rows, kv)
        order = logits.order
        base = {req.request_id: len(ctx) for req, ctx in zip(reqs, contexts)}
        snapshot = kv.snapshot() if self.recurrent else None
        token = mx.argmax(logits.logits, axis=-1)
        drafts = [token]
        by_id = {r.request_id: r.request for r in rows}
        for step in range(max(limits) - 1):   # each draft is the next step's input
            kv.set_next(order, token)
            step_rows = [PlannedRow(by_id[rid], base[rid] + step, 1) for rid in order]
            token = mx.argmax(self.forward.decode(step_rows, kv).logits, axis=-1)
            drafts.append(token)
        for rid in order:
            held[rid] = base[rid] + len(drafts) - 1
        self._round = _Round({rid: held[rid] for rid in order}, base, snapshot)
        proposed = dict(zip(order, mx.stack(drafts, axis=1).tolist()))
        return [proposed[req.request_id][:k] for req, k in zip(reqs, limits)]

    def _chunk(self, req: Request, start: int, end: int) -> PlannedRow:
        """The next prompt chunk of a catch-up to `end`. Only the last may end where the
        prompt does (the forward batches rows finishing their prompt into the decode batch)."""
        n = min(self.chunk, end - start)
        if start + n == req.num_prompt_tokens - 1 < end:
            n = n - 1 if n > 1 else n + 1
        return PlannedRow(req, start, n)

    def settle(self, reqs: list[Request]) -> None:
        """Cut each drafted row back to the positions the target kept."""
        done, self._round = self._round, None
        if done is None:
            return
        kept = {r.request_id: r.num_computed_tokens for r in reqs}
        kept = {rid: kept.get(rid, base) for rid, base in done.base.items()}
        batch = self.kv.decode_rows
        ahead = [rid for rid in done.held if self.held.get(rid, -1) > kept[rid]]
        if not ahead:
            return
        lost = [rid for rid in ahead if rid not in batch]   # (left the batch since: restart)
        if self.recurrent:   # back to the round's start; the next round replays the kept
            if done.snapshot is not None and done.snapshot.ids == tuple(batch):
                self.kv.restore(done.snapshot, drop=done.held[batch[0]] - done.base[batch[0]])
                self.held.update(done.base)
            else:
                lost = ahead
        else:
            drop = [max(0, self.held.get(rid, 0) - kept.get(rid, 0)) if rid in done.held
                    else 0 for rid in batch]
            self.kv.trim_decode(drop)
            for rid, d in zip(batch, drop):
                self.held[rid] -= d
        for rid in lost:
            self._forget(rid)

    def release(self, req: Request) -> None:
        self._forget(req.request_id)

    def _forget(self, rid: str) -> None:
        self.kv.release(rid)
        self.held.pop(rid, None)


class _MtpRow:
    """Where the MTP head is in one row (its KV is the proposer's row store's): `end` is the
    next target position it has not consumed; `pending` holds the target's hidden states
    (position, (1, n, H)) not yet consumed."""

    __slots__ = ("end", "pending", "extra")

    def __init__(self) -> None:
        self.end: int | None = None
        self.pending: list[tuple[int, mx.array]] = []
        self.extra = 0   # speculative entries appended while drafting (trimmed at settle)


class MtpProposer(NoDraft):
    """draft=mtp: the checkpoint's multi-token-prediction head (mtp.* weights) drafts from the
    target's own hidden states, sharing its embeddings and output head. Positions whose hidden
    states were never computed here (a prompt-cache hit) are skipped: the head's KV starts at
    the first position this server computed (RoPE is relative, so the shift is harmless).
    The head's per-row KV lives in the proposer's own RowStore (each row's own caches: the
    head drafts row by row)."""

    name = "mtp"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        try:
            self.head = load_mtp(ctx.loaded.path, ctx.model)
        except ValueError as e:
            raise ConfigError(f"draft=mtp: {e}") from e
        if self.head is None:
            raise ConfigError(
                f"draft=mtp: model {ctx.loaded.path} has no multi-token-prediction head "
                "(no mtp.* weights); use draft=ngram or draft=model")
        self.rows: dict[str, _MtpRow] = {}
        self.kv = RowStore(self.head.make_cache)
        log.info("draft=mtp: %d MTP layer(s) loaded", self.head.num_layers)

    def _row(self, req: Request) -> _MtpRow:
        row = self.rows.get(req.request_id)
        if row is None:
            row = self.rows[req.request_id] = _MtpRow()
        return row

    def release(self, req: Request) -> None:
        self.rows.pop(req.request_id, None)
        self.kv.release(req.request_id)

    def capture(self, req: Request, position: int, hidden: mx.array) -> None:
        self._row(req).pending.append((position, hidden))

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out = []
        for req, ctx, k in zip(reqs, contexts, limits):
            row, cache = self._row(req), self.kv.own(req.request_id)
            logits, g = self._catch_up(row, cache, ctx)
            if logits is None or k <= 0:
                out.append([])
                continue
            token = self.head.pick(logits[:, -1, :])
            drafts = [token]
            for step in range(1, k):
                logits, g = self.head(g[:, -1:, :], token[:, None], cache, step)
                row.extra += 1
                token = self.head.pick(logits[:, -1, :])
                drafts.append(token)
            out.append(mx.concatenate(drafts).tolist())
        return out

    def _catch_up(self, row: _MtpRow, cache: list[Any], ctx: list[int]) -> tuple[Any, Any]:
        """Feed the head every pending hidden state whose next token is known; returns the
        logits and hidden output at the last fed position (predicting the next input's
        successor: the first draft)."""
        pending = sorted(row.pending, key=lambda p: p[0])
        row.pending = []
        logits = g = None
        for pos, hidden in pending:
            if row.end is not None and pos + hidden.shape[1] <= row.end:
                continue   # already consumed
            if row.end is not None and pos < row.end:
                hidden = hidden[:, row.end - pos:]
                pos = row.end
            n = min(hidden.shape[1], len(ctx) - 1 - pos)   # token[t+1] must be known
            if n <= 0:
                row.pending.append((pos, hidden))
                continue
            nxt = mx.array(ctx[pos + 1:pos + 1 + n], dtype=mx.uint32)[None]
            logits, g = self.head(hidden[:, :n], nxt, cache, 0)
            row.end = pos + n
            if n < hidden.shape[1]:
                row.pending.append((pos + n, hidden[:, n:]))
        if logits is not None and row.end != len(ctx) - 1:
            return None, None   # the head is behind the input token: no draft this round
        return logits, g

    def settle(self, reqs: list[Request]) -> None:
        for req in reqs:
            row = self.rows.get(req.request_id)
            if row is not None and row.extra:
                self.kv.trim_own(req.request_id, row.extra)
                row.extra = 0


class Eagle3Proposer(MtpProposer):
    """draft=eagle3: an EAGLE-3 head (pipeserve/draft/eagle3.py) drafts from the target's
    hidden states at three layers, which the target's forwards return in place of its final
    hidden state. Its bookkeeping is draft=mtp's: one head entry per target position, fed the
    kept positions' hidden states and chained over its own output while drafting."""

    name = "eagle3"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        path, self.head = load_head(cfg, ctx, "EAGLE-3", ensure_eagle3, load_eagle3)
        self.rows: dict[str, _MtpRow] = {}
        self.kv = RowStore(self.head.make_cache)
        log.info("draft=eagle3: head %s loaded", path)
