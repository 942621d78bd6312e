"""A rank > 0 of a distributed launch: it loads and shards the model like rank 0, then runs the
engine loop on the plans rank 0 broadcasts until rank 0 stops the group. It never builds the
HTTP app nor opens a listening socket. Main thread (the engine thread does the work)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry

from pipeserve.core.engine import Engine, EngineState
from pipeserve.distributed.lifeline import FollowerExit
from pipeserve.distributed.shard import world
from pipeserve.metrics import Metrics

log = logging.getLogger(__name__)


class _RankFilter(logging.Filter):
    """Every line of this rank's log names it (mlx.launch interleaves the ranks' output)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def follow(cfg: Any) -> int | None:
    """None on rank 0 (it goes on to serve HTTP); on any other rank, follow rank 0 and return
    the process's exit code: 0 once rank 0 stopped the group, 1 when this rank failed."""
    rank = world().rank()
    if rank == 0:
        return None

    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankFilter(rank))
    # SIGTERM (mlx.launch forwards it to every rank) or a lost launcher: rank 0 drains and
    # stops the group, and this rank leaves with it; after the drain's bound it leaves alone
    FollowerExit(cfg.server.shutdown_timeout_s + cfg.distributed.timeout_s, _exit_now).install()
    engine = Engine(cfg, Metrics(CollectorRegistry()))   # rank 0 exports every rank's times
    engine.start()
    if not engine.wait_ready():
        log.error("model load failed: %r", engine.startup_error)
        return 1
    log.info("ready: following rank 0 (%d ranks, distributed=%s); no HTTP on this rank",
             world().size(), cfg.distributed.name)
    while engine.state is EngineState.READY:
        time.sleep(0.2)
    if engine.state is EngineState.DEAD:
        log.error("leaving the group after a failure (above)")
        return 1
    log.info("stopped with rank 0")
    return 0


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)
