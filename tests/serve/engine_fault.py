"""A fault injection for tests/serve/test_engine_death.py, loaded by a real serve.py through
the scheduler's `_target_` slot: the real scheduler, except that once a request with seed
DIE_SEED has been added, its next schedule() raises. That is outside every step's failure
boundary, so the engine loop itself dies (Engine._run → _die), as it does when the device is
lost mid-step. Engine thread."""
from __future__ import annotations

from pipeserve.core.plan import StepPlan
from pipeserve.core.scheduler import Scheduler
from pipeserve.request import Request

DIE_SEED = 707070   # a request with this seed makes the engine loop die


class DyingScheduler(Scheduler):
    dying = False

    def add(self, request: Request, first: bool = False) -> None:
        super().add(request, first)
        if request.sampling.seed == DIE_SEED:
            self.dying = True

    def schedule(self) -> StepPlan | None:
        if self.dying:
            raise RuntimeError("injected fault (tests/serve/engine_fault.py): the engine loop "
                               "dies")
        return super().schedule()
