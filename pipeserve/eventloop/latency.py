"""LatencyEstimator: what a new request will wait for, from measured rates — prefill tokens
a second and decode tokens a second per row (moving averages over finished requests) and the
requests admitted ahead of it. Admission reads it for Retry-After and `deadline_ms`; the
HTTP scope feeds it each finished request. Event loop only."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeserve.errors import InvalidRequest

ALPHA = 0.3   # weight of the newest measurement in each moving average
MIN_RATE_TOKENS = 32   # a prompt shorter than this measures the first-token overhead, not a rate


@dataclass(frozen=True, slots=True)
class Estimate:
    queue_s: float     # until a row is free for it
    prefill_s: float   # its prompt
    decode_s: float    # max_tokens at the measured per-row rate

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    def describe(self) -> str:
        return (f"{self.total_s * 1000:.0f} ms (queue {self.queue_s * 1000:.0f} ms, prefill "
                f"{self.prefill_s * 1000:.0f} ms, decode {self.decode_s * 1000:.0f} ms)")


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LatencyEstimator:
    def __init__(self) -> None:
        self.prefill_tps: float | None = None   # prompt tokens a second (one request)
        self.first_token_s = 0.0                # a short prompt's wait for its first token
        self.decode_tps: float | None = None    # output tokens a second of one row
        self.request_s: float | None = None     # how long a request holds its row
        self.ahead: dict[str, float | None] = {}   # admitted, unfinished → its estimate (s)
        self.work: dict[str, float] = {}   # admitted, unfinished → its prefill + decode (s)

    @property
    def measured(self) -> bool:
        return self.prefill_tps is not None and self.decode_tps is not None

    def estimate(self, prompt_tokens: int, max_tokens: int, slots: int) -> Estimate | None:
        """None until a request has been measured (nothing to estimate from)."""
        if self.prefill_tps is None or self.decode_tps is None or self.request_s is None:
            return None
        prefill_s = self.first_token_s + prompt_tokens / self.prefill_tps
        return Estimate(self.queue_s(slots), prefill_s, max_tokens / self.decode_tps)

    def queue_s(self, slots: int) -> float:
        """Until a row is free: nothing while one is; else the work of the requests admitted
        ahead (each its own estimate, a typical request's when it had none) over the rows."""
        if len(self.ahead) < slots:
            return 0.0
        typical = self.request_s or 0.0
        return sum(self.work.get(rid, typical) for rid in self.ahead) / max(slots, 1)

    def retry_after_s(self, slots: int) -> int:
        """Seconds until a queued request would take a row (the estimated wait): 1 unmeasured."""
        if self.request_s is None:
            return 1
        return min(600, max(1, math.ceil(self.queue_s(slots) or self.request_s / max(slots, 1))))

    def admit(self, request_id: str, estimate: Estimate | None) -> None:
        self.ahead[request_id] = estimate.total_s if estimate is not None else None
        if estimate is not None:
            self.work[request_id] = estimate.prefill_s + estimate.decode_s

    def finish(self, request_id: str, computed_prompt: int, num_output: int,
               prefill_s: float | None, decode_s: float | None, queue_s: float,
               e2e_s: float) -> float | None:
        """A request ended: fold its rates in; measured / estimated end-to-end time when it
        had an estimate. `prefill_s`: from taking a row to its first token; `decode_s`: first
        token to last; `queue_s`: arrival to a row; `e2e_s`: arrival to the end."""
        estimate = self.ahead.pop(request_id, None)
        self.work.pop(request_id, None)
        if prefill_s is not None and prefill_s > 0:
            if computed_prompt >= MIN_RATE_TOKENS:
                rest = max(prefill_s - self.first_token_s, prefill_s / 2)
                self.prefill_tps = _ewma(self.prefill_tps, computed_prompt / rest)
            else:
                self.first_token_s = _ewma(self.first_token_s or None, prefill_s)
                if self.prefill_tps is None:   # a first guess until a long prompt is measured
                    self.prefill_tps = max(computed_prompt, 1) / prefill_s
        if decode_s is not None and decode_s > 0 and num_output > 1:
            self.decode_tps = _ewma(self.decode_tps, (num_output - 1) / decode_s)
        if e2e_s - queue_s > 0:
            self.request_s = _ewma(self.request_s, e2e_s - queue_s)
        return None if estimate is None or estimate <= 0 else e2e_s / estimate

    def forget(self, request_id: str) -> None:
        self.ahead.pop(request_id, None)
        self.work.pop(request_id, None)


def priority_of(value: object, classes: dict[str, int], default: str) -> tuple[int, str]:
    """A request's `priority` (0..9, or a class of admission.priority_classes) → (priority,
    its metric label: the class name, or the digit)."""
    if value is None:
        return classes[default], default
    if isinstance(value, str) and value in classes:
        return classes[value], value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9:
        named = [name for name, p in classes.items() if p == value]
        return value, named[0] if named else str(value)
    raise InvalidRequest(f"priority is {value!r:.40}; allowed: an integer 0 (most urgent) .. 9 "
                         f"or one of {', '.join(sorted(classes))}", param="priority")
