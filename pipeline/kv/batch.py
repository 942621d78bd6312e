"""RowBatch: the decode rows' KV caches merged into one batched cache per layer (mlx-lm's
BatchKVCache / BatchRotatingKVCache / ArraysCache), kept in row order across steps.
Engine thread only."""
from __future__ import annotations

from typing import Any

import mlx.core as mx

from pipeline.request import Request, RequestStatus


class RowBatch:
    """Rows join after their prefill (their own caches are merged in) and leave when they
    finish (filtered out; padding every surviving row shares is dropped, keeping each row's
    absolute positions). `tokens` holds each row's next input token, aligned with `rows`."""

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.caches: list[Any] | None = None   # one batched cache per layer
        self.tokens: mx.array | None = None    # (len(rows),) next input ids

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
            self.caches, self.tokens = None, None
            return
        idx = mx.array(keep, dtype=mx.int32)
        for layer in self.caches:
            layer.filter(idx)
        self.tokens = self.tokens[idx]

    def _extend(self, joiners: list[Request], first_inputs: dict[str, mx.array]) -> None:
        per_layer = list(zip(*(r.cache for r in joiners)))
        merged = [type(layer[0]).merge(list(layer)) if hasattr(layer[0], "merge")
                  else _unsupported(layer[0]) for layer in per_layer]
        new_tokens = mx.concatenate([first_inputs[r.request_id] for r in joiners])
        for r in joiners:
            r.cache = None   # the batch owns the state now
        if self.caches is None:
            self.caches, self.tokens = merged, new_tokens
        else:
            for mine, theirs in zip(self.caches, merged):
                mine.extend(theirs)
            self.tokens = mx.concatenate([self.tokens, new_tokens])
        self.rows.extend(joiners)

    def drop_finished(self) -> None:
        """Free finished rows' KV now rather than at the next step (the engine may go idle)."""
        keep = [i for i, r in enumerate(self.rows) if r.status is RequestStatus.RUNNING]
        if len(keep) != len(self.rows):
            self._filter(keep)

    def reset(self) -> None:
        self.rows, self.caches, self.tokens = [], None, None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0


def _unsupported(layer: Any) -> Any:
    raise TypeError(f"{type(layer).__name__} cannot join a shared decode batch")
