"""Every Prometheus metric of pipeserve, on a registry passed in (so two apps can live in one
process). Updated from the engine thread and the event loop; the client is thread-safe."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

PREFIX = "pipeserve"

# 1 ms .. ~10 min: LLM-shaped latency buckets.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0, 30.0)


class Metrics:
    """Names follow `pipeserve_<what>_<unit>`; counters end in `_total`; labels stay low-cardinality."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished HTTP generation requests by endpoint and outcome",
            ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "Requests admitted and waiting for the engine", registry=r)
        self.active_rows = Gauge(
            f"{PREFIX}_active_rows", "Requests the engine is running now (prefill or decode)",
            registry=r)
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size", "Rows in each engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Arrival to the last token of a request",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the prompt cache",
            registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.step_tokens = Counter(
            f"{PREFIX}_step_tokens", "Tokens computed by engine steps, by phase",
            ["phase"], registry=r)
        self.grouped_prefills = Counter(
            f"{PREFIX}_prefill_grouped_prompts",
            "Prompts prefilled together with others in one padded forward", registry=r)
        self.stage_seconds = Histogram(
            f"{PREFIX}_stage_seconds", "Time spent in each step stage per engine step",
            ["stage"], buckets=STEP_BUCKETS_S, registry=r)
        self.admission = Counter(
            f"{PREFIX}_admission_decisions", "Admission decisions by decision and reason",
            ["decision", "reason"], registry=r)
        self.max_safe_context = Gauge(
            f"{PREFIX}_admission_max_safe_context_tokens",
            "Estimated longest context one request can hold (weights + KV + prefill temporaries)",
            registry=r)
        self.context_cap = Gauge(
            f"{PREFIX}_admission_context_cap_tokens",
            "Context cap admission enforces (admission=budget with memory_budget_gb); NaN if none",
            registry=r)
        self.kv_bytes_per_token = Gauge(
            f"{PREFIX}_kv_bytes_per_token", "KV bytes one token adds to one row, all layers",
            registry=r)
        self.kv_budget = Gauge(
            f"{PREFIX}_kv_budget_bytes", "Aggregate KV budget across rows; NaN if none",
            registry=r)
        self.kv_reserved = Gauge(
            f"{PREFIX}_kv_reserved_bytes",
            "KV reserved by admitted rows (prompt + max_tokens each) under the KV budget",
            registry=r)
        self.weight_bytes = Gauge(
            f"{PREFIX}_model_weight_bytes", "Bytes of the served model's weights", registry=r)
        self.mlx_memory = Gauge(
            f"{PREFIX}_mlx_memory_bytes", "MLX allocator memory by kind (active, cache, peak)",
            ["kind"], registry=r)
        self.engine_up = Gauge(
            f"{PREFIX}_engine_up", "1 while the engine thread is ready to serve, else 0",
            registry=r)
        self.build = Info(f"{PREFIX}_build", "Version, MLX version, device, model, config hash",
                          registry=r)
