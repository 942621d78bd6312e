"""Prefill: the model forward over a step's planned tokens — the prompt chunks of many rows
(those that finish their prompt share one right-padded forward per length bucket), then every
decoding row in one batched forward, with its drafts when it verifies. Returns the logits of
the rows that sample. Engine thread; prompt chunks' KV is evaluated before the step ends, so a
long prompt never builds one giant deferred graph."""
from __future__ import annotations

from typing import ClassVar

from pipeline.config import ServeConfig
from pipeline.forward import Forward
from pipeline.kv.rows import RowStore
from pipeline.plan import Logits, StepPlan
from pipeline.stage import StageDeps


class Prefill:
    name: ClassVar[str] = "prefill"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.forward = Forward(deps.model, keep_hidden=deps.keep_hidden,
                               grouped=deps.layout.grouped_prefill and not deps.keep_hidden)
        self.metrics = deps.metrics

    def __call__(self, plan: StepPlan, kv: RowStore) -> Logits:
        grouped = self.forward.prefill(plan.prefill, kv)
        if grouped:
            self.metrics.grouped_prefills.inc(grouped)
        return self.forward.decode(plan.decode, kv)
