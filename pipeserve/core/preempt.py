"""Preemption, vLLM's recompute kind: when a more urgent request waits and every row is taken,
the least urgent running row of a preemptible class (admission.preemptible) gives its row up.
What it computed goes into the prompt cache before its KV is freed (the engine's `evict`),
its output so far becomes the end of its prompt (`fold`), and it waits again at its class; its
readmission is then a prompt-cache hit (or a recompute where there is no cache), and it goes
on from the token it stopped at. Engine thread; pure bookkeeping on Requests, no mlx."""
from __future__ import annotations

from collections.abc import Collection, Sequence

from pipeserve.request import Request, RequestStatus


def preemptible_priorities(classes: dict[str, int], names: Sequence[str]) -> frozenset[int]:
    """The priority values of the classes named preemptible."""
    return frozenset(classes[name] for name in names)


def victim(running: Sequence[Request], urgent: int,
           preemptible: Collection[int]) -> Request | None:
    """The row to preempt for a waiting request of priority `urgent`: the least urgent running
    row of a preemptible priority strictly less urgent than it, the latest admitted among
    equals (it has done the least). Rows under a grammar (its matcher follows the output) or
    with media (positions keyed by image) are never preempted."""
    if urgent < 0:   # aged past scheduler.max_wait_s: it waits its turn, it takes no row
        return None
    best: Request | None = None
    for req in running:
        if (req.priority in preemptible and req.priority > urgent and foldable(req)
                and (best is None or req.priority >= best.priority)):
            best = req
    return best


def foldable(req: Request) -> bool:
    """Whether the row can give its row up and go on later from its folded output: not under a
    grammar (its matcher follows the output) nor with media (positions keyed by image)."""
    return req.grammar is None and req.constraint is None and req.media is None


def out_of_memory(cause: BaseException) -> bool:
    """Whether a step failed for want of device memory (CUDA's and Metal's allocators say so
    in their messages; MLX raises them as RuntimeError)."""
    return isinstance(cause, MemoryError) or (
        isinstance(cause, RuntimeError)
        and any(s in str(cause).lower() for s in ("out of memory", "insufficient memory")))


def fold(req: Request) -> None:
    """After its KV went to the prompt cache and was freed: the output so far joins the prompt
    (the tokens to compute again, or to find in the cache), max_tokens shrinks by as much, and
    the request waits with nothing computed. `num_folded` keeps the count, so its Finished
    event reports the prompt and output as the client sent and saw them."""
    n = len(req.output_ids)
    req.prompt_ids = req.prompt_ids + req.output_ids
    req.output_ids = []
    req.num_folded += n
    req.sampling.max_tokens -= n
    req.num_computed_tokens = 0
    req.checkpointed_tokens = 0
    req.status = RequestStatus.WAITING
    req.preemptions += 1
