"""Proposers for speculative decoding (the `draft` config group): each offers up to
`draft.num_draft_tokens` tokens per decode row; the verify stage checks them against the target.
Engine thread. A proposer keeps its per-row state on `Request.draft_state`."""
from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from pipeline.config import ServeConfig
from pipeline.draft.ngram import NgramIndex
from pipeline.errors import ConfigError
from pipeline.request import Request
from pipeline.stage import StageDeps

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

    def settle(self, req: Request) -> None:
        """After verify (the row's KV length final): drop draft state past what was kept."""

    def capture(self, req: Request, position: int, hidden: mx.array) -> None:
        """The target's hidden states of `req` from `position` on (draft=mtp only)."""

    def release(self, req: Request) -> None:
        """The row finished: drop its draft state now (the engine may go idle)."""
        req.draft_state = None


class NgramProposer(NoDraft):
    """draft=ngram: prompt lookup over the row's own prompt and output (no model)."""

    name = "ngram"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        self.n_min, self.n_max = cfg.draft.ngram_min, cfg.draft.ngram_max

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out = []
        for req, ctx, k in zip(reqs, contexts, limits):
            index = req.draft_state
            if not isinstance(index, NgramIndex):
                index = req.draft_state = NgramIndex(self.n_min, self.n_max)
            if len(ctx) < len(index):   # cannot happen (rows only grow); rebuild if it does
                index = req.draft_state = NgramIndex(self.n_min, self.n_max)
            index.extend(ctx[len(index):])
            out.append(index.propose(k))
        return out


class _DraftRow:
    """A draft model's KV for one row, how many of the row's tokens it holds, and (for draft
    models with recurrent layers) their state before this round's drafts."""

    __slots__ = ("cache", "fed", "base", "saved")

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.fed = 0
        self.base = 0
        self.saved: list[tuple[int, list[Any]]] = []


class _DraftBatch:
    """An attention-only draft model's KV for every drafting row, as one batched cache per
    layer (rows in `rows` order), so each draft position is one forward for all rows.
    `fed[i]` counts the tokens of row i's context (and drafts) the cache holds."""

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.caches: list[Any] | None = None
        self.fed: list[int] = []

    def keep(self, wanted: set[int]) -> None:
        """Keep the rows whose id() is in `wanted`, in their order; drop the rest's KV."""
        keep = [i for i, r in enumerate(self.rows) if id(r) in wanted]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.fed = [self.fed[i] for i in keep]
        if not keep:
            self.caches = None
            return
        for c in self.caches:
            c.filter(mx.array(keep, dtype=mx.int32))


class ModelProposer(NoDraft):
    """draft=model: a smaller model with the same tokenizer drafts greedily. An attention-only
    draft keeps every drafting row in one batched cache and drafts all rows together, one
    forward per draft position; a draft with recurrent layers drafts row by row (its state is
    snapshotted per round). Either way the draft KV is cut back to what the target accepted."""

    name = "model"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        from dataclasses import replace

        from mlx_lm.models.cache import make_prompt_cache

        from pipeline.loader import load
        draft_cfg = replace(cfg.model, path=cfg.draft.path, name="draft", chat_template=None)
        self.draft = load(draft_cfg)
        target_vocab = ctx.loaded.tokenizer.get_vocab()
        draft_vocab = self.draft.tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            diff = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
            raise ConfigError(
                f"draft.path={cfg.draft.path}: the draft model's tokenizer differs from the "
                f"target's ({len(draft_vocab)} vs {len(target_vocab)} tokens, {diff} entries "
                "differ); speculative decoding needs the same tokenizer")
        from mlx_lm.models.cache import ArraysCache, RotatingKVCache
        probe = make_prompt_cache(self.draft.model)
        if any(isinstance(c, RotatingKVCache) or not (c.is_trimmable() or
                                                      isinstance(c, ArraysCache))
               for c in probe):
            raise ConfigError(
                f"draft.path={cfg.draft.path}: the draft model has sliding-window layers "
                "whose state cannot be rolled back; use a draft model without them")
        self._make = lambda: make_prompt_cache(self.draft.model)
        self.chunk = cfg.scheduler.prefill_chunk
        self.batch = _DraftBatch() if all(c.is_trimmable() for c in probe) else None
        log.info("draft model %s loaded (%.1f MB)", self.draft.path,
                 self.draft.weight_bytes / 1e6)

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        if self.batch is not None:
            return self._propose_batched(reqs, contexts, limits)
        out = []
        model = self.draft.model
        for req, ctx, k in zip(reqs, contexts, limits):
            row = req.draft_state
            if not isinstance(row, _DraftRow):
                row = req.draft_state = _DraftRow(self._make())
            missing = ctx[row.fed:]
            logits = None
            for start in range(0, len(missing), self.chunk):   # catch up, chunk by chunk
                part = mx.array(missing[start:start + self.chunk], dtype=mx.uint32)[None]
                logits = model(part, cache=row.cache)
                if start + self.chunk < len(missing):
                    mx.eval([c.state for c in row.cache])
            row.fed = row.base = len(ctx)
            # recurrent layers cannot be trimmed: keep their state at the confirmed context
            row.saved = [(i, list(c.cache)) for i, c in enumerate(row.cache)
                         if not c.is_trimmable()]
            drafts: list[int] = []
            if k <= 0 or logits is None:
                out.append(drafts)
                continue
            token = mx.argmax(logits[:, -1, :], axis=-1)
            for i in range(k):
                drafts.append(token)
                if i + 1 < k:
                    logits = model(token[:, None].astype(mx.uint32), cache=row.cache)
                    token = mx.argmax(logits[:, -1, :], axis=-1)
            ids = mx.concatenate(drafts).tolist()
            row.fed += k - 1
            out.append(ids)
        return out

    def release(self, req: Request) -> None:
        b = self.batch
        if b is not None and req.draft_state is b:
            b.keep({id(r) for r in b.rows if r is not req})
        req.draft_state = None

    def _propose_batched(self, reqs: list[Request], contexts: list[list[int]],
                         limits: list[int]) -> list[list[int]]:
        from pipeline.kv.rows import drop_shared_padding, merge_layer, trim_rows
        b, model = self.batch, self.draft.model
        ctxs = {id(r): c for r, c in zip(reqs, contexts)}
        b.keep(set(ctxs))   # rows that stopped drafting leave; the rest keep their order
        # cut each row back to the context the target confirmed (drafts it rejected)
        if b.rows:
            valid = [min(f, len(ctxs[id(r)]) - 1) for r, f in zip(b.rows, b.fed)]
            drop = [f - v for f, v in zip(b.fed, valid)]
            if any(drop):
                trim_rows(b.caches, drop)
                drop_shared_padding(b.caches, len(drop))
            b.fed = valid
        # newcomers: prefill their context but its last token alone, then join the batch
        present = {id(r) for r in b.rows}
        joiners = [r for r in reqs if id(r) not in present]
        if joiners:
            own = []
            for r in joiners:
                cache = self._make()
                ctx = ctxs[id(r)]
                for start in range(0, len(ctx) - 1, self.chunk):
                    part = mx.array(ctx[start:min(start + self.chunk, len(ctx) - 1)],
                                    dtype=mx.uint32)[None]
                    model(part, cache=cache)
                    mx.eval([c.state for c in cache])
                own.append(cache)
                r.draft_state = b   # marks the row as drafted (usage.speculation)
            merged = [merge_layer(list(layer)) for layer in zip(*own)]
            if b.caches is None:
                b.caches = merged
            else:
                for mine, theirs in zip(b.caches, merged):
                    mine.extend(theirs)
            b.rows += joiners
            b.fed += [len(ctxs[id(r)]) - 1 for r in joiners]
        # feed every row what it is missing (right-padded), then draft all rows together
        missing = [ctxs[id(r)][f:] for r, f in zip(b.rows, b.fed)]
        width = max(len(m) for m in missing)
        tokens = mx.array([m + [0] * (width - len(m)) for m in missing], dtype=mx.uint32)
        padding = [width - len(m) for m in missing]
        if max(padding):
            for c in b.caches:
                c.prepare(right_padding=padding)
        logits = model(tokens, cache=b.caches)
        last = mx.array([len(m) - 1 for m in missing], dtype=mx.int32)
        logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        if max(padding):
            for c in b.caches:
                c.finalize()
        b.fed = [len(ctxs[id(r)]) for r in b.rows]
        limit = {id(r): k for r, k in zip(reqs, limits)}
        k_max = max(limits)
        token = mx.argmax(logits, axis=-1)
        drafts = [token]
        for _ in range(k_max - 1):
            token = mx.argmax(model(token[:, None].astype(mx.uint32), cache=b.caches)[:, -1],
                              axis=-1)
            drafts.append(token)
        b.fed = [f + k_max - 1 for f in b.fed]
        rows = mx.stack(drafts, axis=1).tolist()
        by_row = {id(r): d[:limit[id(r)]] for r, d in zip(b.rows, rows)}
        return [by_row[id(r)] for r in reqs]

    def settle(self, req: Request) -> None:
        """After verify: keep the draft KV only for the context the target confirmed."""
        row = req.draft_state
        if not isinstance(row, _DraftRow):
            return
        valid = req.num_computed_tokens   # the target's KV length after verify
        if row.fed <= valid:
            return
        if row.saved:   # back to the round's start; the next catch-up feeds what was accepted
            for i, state in row.saved:
                row.cache[i].cache = state
            for c in row.cache:
                if c.is_trimmable():
                    c.trim(row.fed - row.base)
            row.fed = row.base
        else:
            for c in row.cache:
                c.trim(row.fed - valid)
            row.fed = valid


class _MtpRow:
    """The MTP head's KV for one row: `end` is the next target position it has not consumed;
    `pending` holds the target's hidden states (position, (1, n, H)) not yet consumed."""

    __slots__ = ("cache", "end", "pending", "extra")

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.end: int | None = None
        self.pending: list[tuple[int, mx.array]] = []
        self.extra = 0   # speculative entries appended while drafting (trimmed at settle)


class MtpProposer(NoDraft):
    """draft=mtp: the checkpoint's multi-token-prediction head (mtp.* weights) drafts from the
    target's own hidden states, sharing its embeddings and output head. Positions whose hidden
    states were never computed here (a prompt-cache hit) are skipped: the head's KV starts at
    the first position this server computed (RoPE is relative, so the shift is harmless)."""

    name = "mtp"

    def __init__(self, cfg: ServeConfig, ctx: StageDeps) -> None:
        from pipeline.draft.mtp import load_mtp
        try:
            self.head = load_mtp(ctx.loaded.path, ctx.model)
        except ValueError as e:
            raise ConfigError(f"draft=mtp: {e}") from e
        if self.head is None:
            raise ConfigError(
                f"draft=mtp: model {ctx.loaded.path} has no multi-token-prediction head "
                "(no mtp.* weights); use draft=ngram or draft=model")
        log.info("draft=mtp: %d MTP layer(s) loaded", self.head.num_layers)

    def _row(self, req: Request) -> _MtpRow:
        if not isinstance(req.draft_state, _MtpRow):
            req.draft_state = _MtpRow(self.head.make_cache())
        return req.draft_state

    def capture(self, req: Request, position: int, hidden: mx.array) -> None:
        self._row(req).pending.append((position, hidden))

    def propose(self, reqs: list[Request], contexts: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        out = []
        for req, ctx, k in zip(reqs, contexts, limits):
            row = self._row(req)
            logits, g = self._catch_up(row, ctx)
            if logits is None or k <= 0:
                out.append([])
                continue
            token = mx.argmax(logits[:, -1, :], axis=-1)
            drafts = [token]
            for step in range(1, k):
                logits, g = self.head(g[:, -1:, :], token[:, None], row.cache, step)
                row.extra += 1
                token = mx.argmax(logits[:, -1, :], axis=-1)
                drafts.append(token)
            out.append(mx.concatenate(drafts).tolist())
        return out

    def _catch_up(self, row: _MtpRow, ctx: list[int]) -> tuple[Any, Any]:
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
            logits, g = self.head(hidden[:, :n], nxt, row.cache, 0)
            row.end = pos + n
            if n < hidden.shape[1]:
                row.pending.append((pos + n, hidden[:, n:]))
        if logits is not None and row.end != len(ctx) - 1:
            return None, None   # the head is behind the input token: no draft this round
        return logits, g

    def settle(self, req: Request) -> None:
        row = req.draft_state
        if isinstance(row, _MtpRow) and row.extra:
            for c in row.cache:
                c.trim(row.extra)
            row.extra = 0
