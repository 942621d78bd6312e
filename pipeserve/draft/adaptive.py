"""Adaptive draft length: each row drafts about `num_draft_tokens` × its recent acceptance + 1
tokens, and a row whose drafts keep failing stops drafting for a while (then probes with one
draft, pausing twice as long each time the probe fails too). The draft stage asks for a row's
length once per step and reports every verify back. Engine thread; no mlx import."""
from __future__ import annotations

from dataclasses import dataclass

MISSES_TO_PAUSE = 3   # verifies in a row that kept no draft before the row stops drafting
PAUSE_MIN_STEPS = 4   # steps the first pause lasts
PAUSE_MAX_STEPS = 64  # the longest pause (doubling stops there)
RATE_KEEP = 0.7       # weight of the old acceptance rate in the moving average


@dataclass(slots=True)
class RowLength:
    """One row's drafting record: its recent acceptance and where it is in a pause."""

    rate: float = 1.0            # moving average of accepted / proposed per verify
    misses: int = 0              # verifies in a row that kept none of their drafts
    paused: int = 0              # steps left without drafting
    pause: int = PAUSE_MIN_STEPS   # the next pause's length


class DraftLengths:
    """How many tokens each row drafts this step (bounded by `max_len`). With `adaptive`
    off every row drafts `max_len`. Rows are keyed by request id; `release` drops one."""

    def __init__(self, max_len: int, adaptive: bool = True) -> None:
        self.max_len = max_len
        self.adaptive = adaptive
        self.rows: dict[str, RowLength] = {}

    def length(self, rid: str) -> int:
        """The row's draft length this step (0 while paused); call once per step per row,
        since a pause counts down in calls."""
        if not self.adaptive:
            return self.max_len
        row = self.rows.get(rid)
        if row is None:
            row = self.rows[rid] = RowLength()
        if row.paused:
            row.paused -= 1
            return 0
        if row.misses >= MISSES_TO_PAUSE:
            return 1   # the probe after a pause: one token
        return max(1, min(self.max_len, round(self.max_len * row.rate) + 1))

    def drafts_next(self, rid: str) -> bool:
        """Whether the row may draft at the next step (the step before must then sync)."""
        row = self.rows.get(rid)
        return row is None or row.paused == 0 or not self.adaptive

    def record(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """One verify of the row: `num_accepted` of its `num_drafts` drafts were kept."""
        if not num_drafts or not self.adaptive:
            return
        row = self.rows.get(rid)
        if row is None:
            row = self.rows[rid] = RowLength()
        row.rate = RATE_KEEP * row.rate + (1 - RATE_KEEP) * num_accepted / num_drafts
        if num_accepted:
            row.misses, row.pause = 0, PAUSE_MIN_STEPS
            return
        row.misses += 1
        if row.misses >= MISSES_TO_PAUSE:
            row.paused = row.pause
            row.pause = min(PAUSE_MAX_STEPS, 2 * row.pause)

    def release(self, rid: str) -> None:
        self.rows.pop(rid, None)
