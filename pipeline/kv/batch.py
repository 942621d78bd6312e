"""RowBatch: the decode rows' KV caches merged into one batched cache per layer (mlx-lm's
BatchKVCache / BatchRotatingKVCache / ArraysCache), kept in row order across steps.
Engine thread only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from pipeline.request import Request, RequestStatus


@dataclass(eq=False)
class PrefillGroup:
    """Prompts prefilled together in one padded forward: one batched cache per layer whose
    rows are `members`, in order. The members join the decode batch together."""

    members: list[Request]
    caches: list[Any]


class RowBatch:
    """Rows join after their prefill (their own caches are merged in) and leave when they
    finish (filtered out; padding every surviving row shares is dropped, keeping each row's
    absolute positions). `tokens` holds each row's next input token, aligned with `rows`.
    A lone row keeps its plain per-row caches (`solo`): no padding mask, the exact arithmetic
    of scheduler=serial and mlx-lm; the batch converts when a second row joins, and back when
    it drains to one row."""

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.caches: list[Any] | None = None   # one (batched, unless solo) cache per layer
        self.tokens: mx.array | None = None    # (len(rows),) next input ids
        self.solo = False

    def __len__(self) -> int:
        return len(self.rows)

    def sync(self, decode_rows: list[Request], first_inputs: dict[str, mx.array]) -> None:
        """Make `rows` hold exactly `decode_rows`: continuing rows keep their relative order,
        the rest are dropped, newcomers (whose own caches hold their prompt) go at the end."""
        wanted = {id(r) for r in decode_rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) in wanted]
        present = {id(r) for r in self.rows}
        joiners = [r for r in decode_rows if id(r) not in present]
        if len(keep) != len(self.rows):
            self._filter(keep)
        if joiners:
            self._extend(joiners, first_inputs)

    def _filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.reset()
            return
        idx = mx.array(keep, dtype=mx.int32)
        self.tokens = self.tokens[idx]
        if self.solo:
            return
        for layer in self.caches:
            layer.filter(idx)
        if len(keep) == 1:
            self.caches = [layer.extract(0) for layer in self.caches]
            self.solo = True

    def _extend(self, joiners: list[Request], first_inputs: dict[str, mx.array]) -> None:
        if self.caches is None and len(joiners) == 1 and joiners[0].prefill_group is None:
            self.caches, self.solo = list(joiners[0].cache), True
            parts = [(joiners, None)]
        else:
            if self.solo:
                self.caches = [merge_layer([layer]) for layer in self.caches]
                self.solo = False
            parts = _batched_parts(joiners)
        for rows, caches in parts:
            if caches is None:
                pass
            elif self.caches is None:
                self.caches = caches
            else:
                for mine, theirs in zip(self.caches, caches):
                    mine.extend(theirs)
            for r in rows:
                r.cache, r.prefill_group = None, None   # the batch owns the state now
            self.rows.extend(rows)
        new = [first_inputs[r.request_id] for rows, _ in parts for r in rows]
        new_tokens = mx.concatenate(new)
        self.tokens = new_tokens if self.tokens is None else mx.concatenate([self.tokens, new_tokens])

    def drop_finished(self) -> None:
        """Free finished rows' KV now rather than at the next step (the engine may go idle)."""
        keep = [i for i, r in enumerate(self.rows) if r.status is RequestStatus.RUNNING]
        if len(keep) != len(self.rows):
            self._filter(keep)

    def reset(self) -> None:
        self.rows, self.caches, self.tokens, self.solo = [], None, None, False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0


def _batched_parts(joiners: list[Request]) -> list[tuple[list[Request], list[Any]]]:
    """Joiners as (rows, batched caches): rows with their own caches merged into one part,
    each prefill group's members as another (filtered if some members left meanwhile)."""
    plain = [r for r in joiners if r.prefill_group is None]
    parts: list[tuple[list[Request], list[Any]]] = []
    if plain:
        merged = [merge_layer(list(layer)) for layer in zip(*(r.cache for r in plain))]
        parts.append((plain, merged))
    groups: dict[int, PrefillGroup] = {}
    for r in joiners:
        if r.prefill_group is not None:
            groups.setdefault(id(r.prefill_group), r.prefill_group)
    joining = {id(r) for r in joiners}
    for group in groups.values():
        keep = [i for i, r in enumerate(group.members) if id(r) in joining]
        if len(keep) != len(group.members):
            idx = mx.array(keep, dtype=mx.int32)
            for layer in group.caches:
                layer.filter(idx)
        parts.append(([group.members[i] for i in keep], group.caches))
    return parts


def prefill_group(model: Any, members: list[Request], make_cache: Any) -> PrefillGroup:
    """Prefill every member's prompt (all but its last token) in one right-padded forward;
    the caches then roll the padding to the left, as mlx-lm's batched prompt processing does."""
    prompts = [r.prompt_ids[:-1] for r in members]
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    caches = [merge_layer(list(layer)) for layer in zip(*(make_cache() for _ in members))]
    padding = [width - n for n in lengths]
    if max(padding):
        for c in caches:
            c.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array([p + [0] * (width - len(p)) for p in prompts], dtype=mx.uint32)
    model(tokens, cache=caches)
    if max(padding):
        for c in caches:
            c.finalize()
    mx.eval([c.state for c in caches])
    group = PrefillGroup(members, caches)
    for r in members:
        r.prefill_group = group
    return group


def merge_layer(layers: list[Any]) -> Any:
    """Per-row caches of one layer → one batched cache (mlx-lm's merge classmethods)."""
    merge = getattr(type(layers[0]), "merge", None)
    if merge is None:
        raise TypeError(f"{type(layers[0]).__name__} cannot join a shared decode batch")
    return merge(layers)


SHARED_PADDING_MAX = 16   # tokens of padding every row has before it is cut away


def drop_shared_padding(caches: list[Any], rows: int) -> None:
    """Rows that accept different numbers of drafts gain different left padding; once every
    row has some, the batch is wider than any row needs: cut the common part (the same as a
    filter that keeps every row)."""
    keep = None
    for c in caches:
        pad = getattr(c, "left_padding", None)
        if pad is None or isinstance(pad, list) and not pad:
            continue
        shared = min(pad.tolist()) if isinstance(pad, mx.array) else min(pad)
        if shared >= SHARED_PADDING_MAX:
            keep = mx.arange(rows) if keep is None else keep
            c.filter(keep)


def trim_rows(caches: list[Any], drop: list[int]) -> None:
    """Batched attention caches: trim what every row drops, then roll each row's remaining
    surplus to its left edge, where it becomes masked padding (mlx-lm's right-padding
    finalize)."""
    common = min(drop)
    rest = [d - common for d in drop]
    for c in caches:
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()
