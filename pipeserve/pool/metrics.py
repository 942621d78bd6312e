"""The pool's own metric families (loads, unloads, residency) and the /metrics exposition of a
pool: the server's families, each member's HTTP-side families and each engine process's
families, merged by name with a `model` label on every sample. Event loop."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeserve.metrics import PREFIX

LOAD_BUCKETS_S = (0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
# families the parent updates for a member (the HTTP side: Scope, the admission stage, the
# output path's adapter counts) (as written in /metrics: counters with `_total`)
MEMBER_FAMILIES = frozenset({f"{PREFIX}_requests_total", f"{PREFIX}_e2e_request_latency_seconds",
                             f"{PREFIX}_admission_decisions_total",
                             f"{PREFIX}_adapter_requests_total",
                             f"{PREFIX}_adapter_generation_tokens_total"})
# families every process has of its own (the server's under model="", each engine's beside)
PROCESS_FAMILIES = frozenset({f"{PREFIX}_gc_pause_seconds", f"{PREFIX}_log_records_dropped_total"})
# families the server itself owns (requests before routing: an unknown model, a bad body)
SERVER_FAMILIES = frozenset({f"{PREFIX}_requests_total", f"{PREFIX}_build_info",
                             f"{PREFIX}_admission_memory_budget_bytes",
                             f"{PREFIX}_queue_capacity", f"{PREFIX}_cache_flush_seconds",
                             f"{PREFIX}_ignored_fields_total"})


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.load_seconds = Histogram(
            f"{PREFIX}_model_load_seconds", "Time to start a model's engine process and load it, "
            "by model and outcome (ok, failed, timeout)", ["model", "outcome"],
            buckets=LOAD_BUCKETS_S, registry=r)
        self.loads = Counter(
            f"{PREFIX}_model_load", "Model loads by model and outcome (ok, failed, timeout)",
            ["model", "outcome"], registry=r)
        self.loading = Gauge(
            f"{PREFIX}_model_load_in_progress", "1 while the model is loading", ["model"],
            registry=r)
        self.unloads = Counter(
            f"{PREFIX}_model_unload", "Model unloads by model and reason (lru, memory, idle, "
            "exited, shutdown)", ["model", "reason"], registry=r)
        self.resident = Gauge(
            f"{PREFIX}_model_resident", "1 while the model's engine process is loaded and "
            "serving", ["model"], registry=r)
        mine = (self.load_seconds, self.loads, self.loading, self.unloads, self.resident)
        self.names = frozenset(f.name + ("_total" if f.type == "counter" else "")
                               for metric in mine for f in metric.collect())


def _families(text: str, keep: Iterable[str] | None, drop: Iterable[str] = (),
              ) -> Iterator[Metric]:
    keep_set, drop_set = (set(keep) if keep is not None else None), set(drop)
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        if family.type == "gauge" and family.name.endswith("_created"):
            continue
        if (keep_set is not None and name not in keep_set) or name in drop_set:
            continue
        yield family


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(sources: list[tuple[str, str, Iterable[str] | None, Iterable[str]]]) -> bytes:
    """One exposition from (model label, text, families kept or None for all, families
    dropped) sources; same-named families become one, told apart by `model`."""
    merged: dict[str, Metric] = {}
    for model, text, keep, drop in sources:
        for family in _families(text, keep, drop):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation,
                                                    family.type, family.unit)
            for s in family.samples:
                labels = {"model": model, **s.labels} if "model" not in s.labels else s.labels
                into.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry()
    registry.register(_Merged(list(merged.values())))   # type: ignore[arg-type]
    return generate_latest(registry)
