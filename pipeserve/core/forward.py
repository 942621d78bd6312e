"""Forward: one model's forward over planned rows and a RowStore — the prompt chunks of many
rows (those that finish their prompt share one padded forward per length bucket), then
every decoding row in one batched forward, with its drafts when it verifies them. The target's
(the prefill stage) and a draft model's (draft=model) are two instances. Engine thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from pipeserve.adapters.lora import AdapterSet
from pipeserve.draft.mtp import target_forward
from pipeserve.core.rows import (Made, RowStore, drop_shared_padding, merge_layer, pad_left,
                                  pad_right)
from pipeserve.core.plan import Logits, PlannedRow
from pipeserve.kv.padded import finalize, note_right_padding
from pipeserve.model.fast_decode import fast_decode

BUCKET_SPREAD = 2.0   # prompts within 2x of each other's length share one padded forward


class Forward:
    """Prompt chunks' KV is evaluated before the call returns, so a long prompt never builds
    one giant deferred graph; the decode forward stays lazy (the caller evaluates it)."""

    def __init__(self, model: Any, keep_hidden: bool = False, grouped: bool = True,
                 fast: bool = False) -> None:
        self.model = model
        self.keep_hidden = keep_hidden
        self.grouped = grouped
        self.hidden: dict[str, tuple[int, Any]] = {}   # prefill chunks' hidden (draft=mtp)
        self.failed: dict[str, BaseException] = {}     # media rows whose own chunk raised
        self.adapters = AdapterSet.of(model)   # per-row adapters (empty: none mounted yet)
        # model.fast_decode: a decode step in compiled calls, where it is the same
        self.fast = fast_decode(model) if fast and not keep_hidden else None

    def _select(self, rows: list[PlannedRow]) -> None:
        """The next model call's rows, in its batch order, run each with its request's adapter
        (nothing to do, per step, while no adapter is mounted)."""
        a = self.adapters
        if a.slots or a.retired:
            a.select([a.slots_of(r.request.adapter) for r in rows])

    def _done(self) -> None:
        """After the call: back to every row on the launch default, for any other caller."""
        if self.adapters.slots or self.adapters.retired:
            self.adapters.reset()

    # -- prompt chunks ----------------------------------------------------------------
    def prefill(self, rows: Sequence[PlannedRow], kv: RowStore) -> int:
        """Run every prefill chunk; returns how many rows shared a grouped forward. A row with
        media whose chunk raises (its tower on its own input) lands in `self.failed`, alone."""
        self.hidden = {}
        self.failed = {}
        whole = [r for r in rows if self.grouped and r.start + r.num_tokens
                 == r.request.num_prompt_tokens - 1 and kv.mergeable(r.request_id)
                 and r.request.media is None]
        shared = 0
        for members in _buckets(whole):
            if len(members) > 1:
                self._prefill_group(members, kv)
                shared += len(members)
            else:
                self._prefill_one(members[0], kv)
        taken = {id(r) for r in whole}
        for row in rows:
            if id(row) in taken:
                continue
            if row.request.media is None:
                self._prefill_one(row, kv)
                continue
            try:   # the tower runs on this row's own pixels / audio: its failure is its own
                self._prefill_one(row, kv)
            except Exception as e:
                self.failed[row.request_id] = e
        return shared

    def _prefill_one(self, row: PlannedRow, kv: RowStore) -> None:
        cache = kv.own(row.request_id, until=row.start + row.num_tokens)
        tokens = mx.array(row.token_ids(), dtype=mx.uint32)[None]
        self._select([row])
        if self.keep_hidden:   # draft=mtp: the head learns from the trunk's hidden states
            _, hidden = target_forward(self.model, tokens, cache)
            self._done()
            self.hidden[row.request_id] = (row.start, hidden)
            mx.eval([c.state for c in cache] + [hidden])
            return
        media = row.request.media
        if media is None:
            self.model(tokens, cache=cache)
        else:   # images: the chunk's input embeddings, the vision tower's features merged in
            with media.chunk(row.request.prompt_ids, row.start, row.num_tokens) as inputs:
                self.model(tokens, cache=cache, **inputs)
        self._done()
        mx.eval([c.state for c in cache])

    def _prefill_group(self, members: list[PlannedRow], kv: RowStore) -> None:
        """Every member's chunk (the rest of its prompt) in one forward over their merged
        caches. Rows that hold no KV yet are left-padded, as mlx-lm's BatchGenerator does, so
        the padding is already where decoding wants it. Otherwise (a prompt-cache hit keeps its
        prefix; the merge left-pads the rows to the longest and leaves room for the chunk,
        which is written in place) the forward is right-padded and the caches then roll the
        padding to the left, as mlx-lm's batched prompt processing does: a roll of every
        layer's KV (`finalize`: one gather of whole vectors a tensor, not mlx-lm's element
        gather, which took most of a burst of prompt-cache hits' prefill)."""
        ids = [r.request_id for r in members]
        chunks = [r.token_ids() for r in members]
        width = max(len(c) for c in chunks)
        own = kv.take_own(ids)
        cold = all(c.empty() for layers in own for c in layers)
        made: Made = {}   # the layers' per-row padding arrays, made once
        caches = [merge_layer(list(layer), room=width, made=made) for layer in zip(*own)]
        padding = [width - len(c) for c in chunks]
        left = cold and all(_left_paddable(c) for c in caches)
        if left:
            pad_left(caches, padding, made)
        else:
            # the merged buffers first, on their own: their slice updates land in place before
            # the forward's graph can order any of them next to its own work
            mx.async_eval([a for c in caches if getattr(c, "keys", None) is not None
                           for a in (c.keys, c.values)])
            if max(padding):
                pad_right(caches, [len(c) for c in chunks], padding, made)
        tokens = mx.array([[0] * p + c if left else c + [0] * p
                           for c, p in zip(chunks, padding)], dtype=mx.uint32)
        self._select(members)
        self.model(tokens, cache=caches)
        self._done()
        if max(padding) and not left:
            for c in caches:
                finalize(c)
        # queued, not waited for: the device runs this group while the host builds the next
        # one's merge and forward (with a wait, the device idled through each build)
        mx.async_eval([c.state for c in caches])
        kv.group(ids, caches)

    # -- decoding rows ----------------------------------------------------------------
    def decode(self, rows: Sequence[PlannedRow], kv: RowStore) -> Logits:
        """One forward for every decoding row (their order is the batch's): each feeds its
        input token, then its drafts when it verifies them (logits at every position)."""
        hidden = {rid: h for rid, h in self.hidden.items()}
        if not rows:
            return Logits([], hidden=hidden)
        by_id = {r.request_id: r for r in rows}
        caches, order, inputs = kv.decode_batch(list(by_id), {r.request_id: r.known_input()
                                                            for r in rows})
        width = _width(rows)
        if width > 1:
            kv.before_verify(width)   # what a rollback of the rejected drafts needs
            pad = [(list(by_id[r].drafts) + [0] * width)[:width - 1] for r in order]
            tokens = mx.concatenate([inputs[:, None].astype(mx.uint32),
                                     mx.array(pad, dtype=mx.uint32)], axis=1)
            logits = self._run(tokens, caches, order, by_id, hidden)
            return Logits(order, logits, width, hidden)
        logits = self._run(inputs[:, None], caches, order, by_id, hidden)[:, -1, :]
        return Logits(order, logits, 1, hidden)

    def feed(self, rows: list[PlannedRow], kv: RowStore) -> Logits:
        """Decoding rows feed `num_tokens` host tokens each from `start`, then their drafts (a
        draft model catching up on what the target accepted; the row store replaying a verify's
        kept tokens): one forward over the decode batch, right-padded and masked like a prompt
        group; logits at each row's last token."""
        by_id = {r.request_id: r for r in rows}
        caches, order, _ = kv.decode_batch(list(by_id), {r.request_id: r.known_input()
                                                         for r in rows})
        chunks = [by_id[rid].token_ids() + list(by_id[rid].drafts) for rid in order]
        assert all(len(t) == by_id[rid].width for t, rid in zip(chunks, order)), \
            "feed: a row's tokens are not all on the host"
        lengths = [len(t) for t in chunks]
        padding = [max(lengths) - n for n in lengths]
        if max(padding):
            for c in caches:
                c.prepare(lengths=lengths, right_padding=padding)
                note_right_padding(c, padding)
        tokens = mx.array([t + [0] * p for t, p in zip(chunks, padding)], dtype=mx.uint32)
        self._select([by_id[rid] for rid in order])
        logits = self.model(tokens, cache=caches)
        self._done()
        if max(padding):
            for c in caches:
                finalize(c)
            drop_shared_padding(caches, len(order))
        last = mx.array([n - 1 for n in lengths], dtype=mx.int32)
        return Logits(order, mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0])

    def _run(self, tokens: mx.array, caches: list[Any], order: list[str],
             rows: dict[str, PlannedRow], hidden: dict[str, Any]) -> mx.array:
        fast, a = self.fast, self.adapters
        if (fast is not None and not (a.adapters or a.slots or a.retired)
                and fast.fits(tokens, caches)):   # no adapter mounted: the traced modules'
            return fast(tokens, caches)           # base weights are the whole model
        self._select([rows[rid] for rid in order])
        try:
            if not self.keep_hidden:
                return self.model(tokens, cache=caches)
            logits, h = target_forward(self.model, tokens, caches)
        finally:
            self._done()
        for i, rid in enumerate(order):
            hidden[rid] = (rows[rid].start, h[i:i + 1])   # from the row's input position
        return logits


def _left_paddable(cache: Any) -> bool:
    """An empty batched attention cache takes left padding before a forward; a recurrent
    layer's (ArraysCache) does not: its state would run over the padding."""
    return type(cache) in (BatchKVCache, BatchRotatingKVCache)


def _width(rows: Sequence[PlannedRow]) -> int:
    """1 + the longest draft, rounded up to a power of two (at most 1 + the largest room),
    so verify forwards come in a few shapes; 1 without drafts."""
    need = 1 + max(len(r.drafts) for r in rows)
    if need == 1:
        return 1
    cap = 1 + max(r.max_drafts for r in rows)
    return min(1 << (need - 1).bit_length(), max(cap, need))


def _buckets(rows: Sequence[PlannedRow]) -> list[list[PlannedRow]]:
    """Rows that share one padded forward: chunks within BUCKET_SPREAD x of each other's
    length, and a group at most an eighth wider than its longest row. A group writes every
    chunk after its longest prefix (a cache hit's, an earlier chunk's): the excess is padding
    that every row of the decode batch it joins attends over until they leave."""
    groups: list[tuple[list[PlannedRow], list[int]]] = []   # (rows, [longest prefix, end])
    # in ascending chunk order: a row's chunk is the longest of the group it joins
    for row in sorted(rows, key=lambda r: r.num_tokens):
        end = row.start + row.num_tokens
        for members, widest in groups:
            start, longest = max(widest[0], row.start), max(widest[1], end)
            if (row.num_tokens <= BUCKET_SPREAD * members[0].num_tokens
                    and start + row.num_tokens <= longest + longest // 8):
                members.append(row)
                widest[:] = start, longest
                break
        else:
            groups.append(([row], [row.start, end]))
    return [members for members, _ in groups]
