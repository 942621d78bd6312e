"""Every Prometheus metric of pipeserve, on a registry passed in (so two apps can live in one
process). Updated from the engine thread and the event loop; the client is thread-safe."""
from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from pipeserve import registry
from pipeserve.launch.logs import count_drops

PREFIX = "pipeserve"

# Known label values. Each labelled family is initialised with them, so its series exist (at 0)
# from the first scrape and dashboards and alerts see them before the first event.
ENDPOINTS = ("chat", "completions", "responses", "messages")
OUTCOMES = ("ok", "invalid", "rejected", "cancelled", "error")
PHASES = ("prefill", "decode")
ADMISSION_DECISIONS = (("admitted", "ok"), ("rejected", "invalid"), ("rejected", "queue_full"),
                       ("rejected", "context_over_budget"), ("clamped", "context_over_budget"),
                       ("rejected", "kv_over_budget"), ("rejected", "deadline"))
MEMORY_KINDS = ("active", "cache", "peak")
CACHE_TIERS = ("ram", "ssd")
# Why a prompt-cache lookup reused nothing: no entry shares a prefix; the model has recurrent
# state and no snapshot sits at the shared boundary; the entry was made under another model
# fingerprint / KV scheme / MLX version; the SSD entry failed its header or tensor hash.
CACHE_MISS_REASONS = ("no_prefix", "no_snapshot", "evicted", "incompatible", "corrupt")
# Why a lookup left prompt tokens to recompute (usage's cache_miss_reason; explained in
# pipeserve/prompt_cache/explain.py): partial hits count here too.
CACHE_MISS_EXPLAINED = ("cold", "evicted", "diverged_at", "no_snapshot", "adapter", "kv_scheme",
                        "incompatible", "too_short")
SPILL_REASONS = ("eviction", "idle")   # RAM → SSD: on RAM eviction, after cache.demote_idle_s
# The speculation families' `proposer` values are the draft options but none: registry.labels.

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
        self.ignored_fields = Counter(
            f"{PREFIX}_ignored_fields", "Request fields the endpoint does not implement, accepted "
            "and ignored (server.strict_fields=false), by endpoint and field (unlisted names: "
            "other)", ["endpoint", "field"], registry=r)
        self.volatile_spans = Counter(
            f"{PREFIX}_volatile_spans", "Requests whose prompt had a volatile span removed "
            "before tokenize (server.volatile_spans), by span name", ["span"], registry=r)
        self.incomplete_calls = Counter(
            f"{PREFIX}_incomplete_tool_calls", "Tool calls cut by max_tokens and dropped from "
            "the output (the response says incomplete_tool_call)", registry=r)
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "Requests admitted and waiting for the engine", registry=r)
        self.active_rows = Gauge(
            f"{PREFIX}_active_rows", "Requests the engine is running now (prefill or decode)",
            registry=r)
        self.memory_waits = Counter(
            f"{PREFIX}_memory_waits", "Requests that waited for a row because MLX's active "
            "memory and their prompts' KV would pass admission.memory_high_water of its "
            "memory limit", registry=r)
        self.preemptions = Counter(
            f"{PREFIX}_preemptions", "Running rows the scheduler gave to a more urgent request "
            "(admission.preemptible); each goes on later from where it stopped", registry=r)
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
        # LoRA: `adapter` is the id (a stack's ids joined by '+'; "none": the base model) of
        # finished requests on a server with adapters mounted
        self.adapter_requests = Counter(
            f"{PREFIX}_adapter_requests", "Finished generation requests by adapter",
            ["adapter"], registry=r)
        self.adapter_tokens = Counter(
            f"{PREFIX}_adapter_generation_tokens", "Tokens generated by adapter", ["adapter"],
            registry=r)
        # admission that knows its latency (pipeserve/eventloop/latency.py); `priority`: the class name
        # (admission.priority_classes) or the digit a request sent
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds", "Arrival until the scheduler gave the request a row",
            ["priority"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.estimate_error = Histogram(
            f"{PREFIX}_latency_estimate_ratio",
            "Measured end-to-end time / the admission estimate (1 = exact)",
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=r)
        self.warmups = Counter(
            f"{PREFIX}_warmups", "Idle warm-ups of a session's next turn by outcome (done, "
            "cancelled by real work, failed)", ["outcome"], registry=r)
        self.warmup_tokens = Counter(
            f"{PREFIX}_warmup_tokens", "New prompt tokens idle warm-ups put in the cache",
            registry=r)
        # resumable SSE streams (pipeserve/http/api/resume.py): the logs held, their bytes, resumes
        self.stream_logs = Gauge(
            f"{PREFIX}_stream_resume_logs", "SSE streams held for resume (live and ended)",
            registry=r)
        self.stream_bytes = Gauge(
            f"{PREFIX}_stream_resume_bytes", "Bytes of SSE frames held for resume", registry=r)
        self.stream_resumes = Counter(
            f"{PREFIX}_stream_resumes", "GET /v1/streams/{id} by outcome (ok, not_found, evicted)",
            ["outcome"], registry=r)
        self.stream_evictions = Counter(
            f"{PREFIX}_stream_resume_evictions",
            "Ended streams dropped before their window to stay under server.stream_resume_mb",
            registry=r)
        self.step_tokens = Counter(
            f"{PREFIX}_step_tokens", "Tokens computed by engine steps, by phase",
            ["phase"], registry=r)
        self.images = Counter(
            f"{PREFIX}_images", "Images of requests, encoded by the vision tower", registry=r)
        self.image_tokens = Counter(
            f"{PREFIX}_image_tokens", "Prompt tokens that carry image features", registry=r)
        self.videos = Counter(
            f"{PREFIX}_videos", "Videos of requests, sampled to frames for the vision tower",
            registry=r)
        self.video_frames = Counter(
            f"{PREFIX}_video_frames", "Frames sampled from requests' videos", registry=r)
        self.vision_seconds = Histogram(
            f"{PREFIX}_vision_encoder_seconds",
            "Vision- and audio-tower time per request (all its images and audio clips, at its "
            "first prompt chunk)", buckets=LATENCY_BUCKETS_S, registry=r)
        self.audio_clips = Counter(
            f"{PREFIX}_audio_clips", "Audio clips of requests (input_audio parts)", registry=r)
        self.audio_tokens = Counter(
            f"{PREFIX}_audio_tokens", "Prompt tokens that carry audio features", registry=r)
        self.audio_seconds = Counter(
            f"{PREFIX}_audio_input_seconds", "Seconds of audio requests sent", registry=r)
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
        self.build = Info(f"{PREFIX}_build",
                          "Version, MLX version, device, model, config hash, CPU BLAS", registry=r)
        self.memory_budget = Gauge(
            f"{PREFIX}_admission_memory_budget_bytes",
            "admission.memory_budget_gb in bytes (MLX's memory limit); NaN if none", registry=r)
        self.queue_capacity = Gauge(
            f"{PREFIX}_queue_capacity", "admission.max_queue: waiting requests before 429",
            registry=r)
        self._add_prompt_cache(r)
        self._add_speculation(r)
        self._add_kv(r)
        self._init_labels()

    def _add_prompt_cache(self, r: CollectorRegistry) -> None:
        """Prompt cache (RAM + SSD tiers); updated by cache_lookup, persist and the SSD writer."""
        tier = ["cache_tier"]
        self.cache_hits = Counter(
            f"{PREFIX}_prompt_cache_hits", "Prompt-cache lookups that reused a prefix, by tier",
            tier, registry=r)
        self.cache_hit_tokens = Counter(
            f"{PREFIX}_prompt_cache_hit_tokens", "Prompt tokens reused from the prompt cache, by tier",
            tier, registry=r)
        self.cache_misses = Counter(
            f"{PREFIX}_prompt_cache_misses", "Prompt-cache lookups that reused nothing, by reason",
            ["reason"], registry=r)
        self.cache_miss_reasons = Counter(
            f"{PREFIX}_prompt_cache_recomputes",
            "Lookups that left prompt tokens to recompute (misses and partial hits), by why",
            ["reason"], registry=r)
        self.cache_bytes = Gauge(
            f"{PREFIX}_prompt_cache_bytes", "Bytes held by the prompt cache, by tier", tier,
            registry=r)
        self.cache_entries = Gauge(
            f"{PREFIX}_prompt_cache_entries", "Entries in the prompt cache, by tier", tier,
            registry=r)
        self.cache_evictions = Counter(
            f"{PREFIX}_prompt_cache_evictions", "Entries evicted to stay under a tier's byte cap",
            tier, registry=r)
        self.cache_capacity = Gauge(
            f"{PREFIX}_prompt_cache_capacity_bytes",
            "A tier's byte cap (the RAM tier's cache.ram_gb, or the size fitted at load)", tier,
            registry=r)
        self.cache_too_large = Counter(
            f"{PREFIX}_prompt_cache_too_large",
            "Prefixes not kept because one takes more bytes than the tier holds", tier,
            registry=r)
        self.gc_pause = Histogram(
            f"{PREFIX}_gc_pause_seconds",
            "Pauses of Python's cyclic collector, by generation (each holds the GIL: the event "
            "loop waits, and in the thread core the engine thread too); with the engine in its "
            "own process (server.isolate, a pool) its pauses carry the model's label, the "
            "server's model=\"\"",
            ["generation"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r)
        self.log_dropped = Counter(
            f"{PREFIX}_log_records_dropped",
            "Log records dropped because a log's reader did not keep up (server.log_buffer_records "
            "were waiting for it); per process, as the collector's pauses", registry=r)
        self.cache_ssd_writes = Counter(
            f"{PREFIX}_prompt_cache_ssd_writes", "Entries written to the SSD tier", registry=r)
        self.cache_ssd_write_bytes = Counter(
            f"{PREFIX}_prompt_cache_ssd_write_bytes", "Bytes written to the SSD tier", registry=r)
        self.cache_spills = Counter(
            f"{PREFIX}_prompt_cache_spills", "RAM entries moved to the SSD tier, by reason",
            ["reason"], registry=r)
        self.cache_restores = Counter(
            f"{PREFIX}_prompt_cache_restores", "SSD entries loaded back into RAM", registry=r)
        self.cache_corrupt = Counter(
            f"{PREFIX}_prompt_cache_corrupt_entries",
            "SSD entries skipped because their header or tensor hash did not match", registry=r)
        self.cache_write_queue = Gauge(
            f"{PREFIX}_prompt_cache_write_queue_depth",
            "Encoded entries and checkpoints waiting for the SSD writer thread", registry=r)
        self.cache_flush_seconds = Histogram(
            f"{PREFIX}_prompt_cache_flush_seconds",
            "Time from a flush request (admin endpoint or shutdown) until every dirty entry is "
            "on disk", buckets=LATENCY_BUCKETS_S, registry=r)
        self.checkpoint_writes = Counter(
            f"{PREFIX}_generation_checkpoint_writes",
            "Generation checkpoints handed to the SSD writer (cache.checkpoint_every)", registry=r)
        self.checkpoint_resumes = Counter(
            f"{PREFIX}_generation_checkpoint_resumes",
            "Requests resumed from a generation checkpoint", registry=r)
        self.cache_dirty = Gauge(
            f"{PREFIX}_prompt_cache_dirty_entries",
            "Entries waiting for their SSD write (not yet durable)", registry=r)

    def _add_speculation(self, r: CollectorRegistry) -> None:
        """Speculative decoding (draft → verify), by proposer."""
        proposer = ["proposer"]
        self.spec_proposed = Counter(
            f"{PREFIX}_speculation_proposed_tokens", "Draft tokens offered to the target model",
            proposer, registry=r)
        self.spec_accepted = Counter(
            f"{PREFIX}_speculation_accepted_tokens", "Draft tokens the target model accepted",
            proposer, registry=r)
        self.spec_verifies = Counter(
            f"{PREFIX}_speculation_verifies",
            "Row verifications (one target forward over a row's draft; emits accepted + 1 tokens)",
            proposer, registry=r)
        self.spec_emitted = Histogram(
            f"{PREFIX}_speculation_tokens_per_verify",
            "Tokens one row emits per verify forward (accepted drafts + the target's own)",
            proposer, buckets=(1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 33, 65), registry=r)
        self.spec_draft_length = Histogram(
            f"{PREFIX}_speculation_draft_length_tokens",
            "Draft length chosen for one decoding row in one step (0: the row paused drafting "
            "after its drafts kept failing; draft.adaptive)",
            proposer, buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.spec_batch_off_steps = Counter(
            f"{PREFIX}_speculation_batch_off_steps",
            "Decode steps that did not draft because more rows decoded than "
            "draft.disable_by_batch_size", proposer, registry=r)
        self.spec_gate_open = Gauge(
            f"{PREFIX}_speculation_gate_open",
            "draft.gate, per proposer and bucket of decoding rows (rows: 1, 2-3, 4-7, ...): 1 "
            "while such steps draft, 0 while the gate keeps them plain (drafting's measured "
            "goodput lost there)", proposer + ["rows"], registry=r)
        self.spec_gate_switches = Counter(
            f"{PREFIX}_speculation_gate_switches",
            "draft.gate: times drafting turned off (to=off) or on again (to=on) for a bucket of "
            "decoding rows (rows: 1, 2-3, 4-7, ...)",
            proposer + ["rows", "to"], registry=r)
        self.spec_gate_goodput = Gauge(
            f"{PREFIX}_speculation_gate_goodput_tokens_per_second",
            "draft.gate: moving average of tokens emitted per second of steps that verified "
            "drafts (steps=draft) and of plain decode steps (steps=plain), per bucket of decoding "
            "rows (rows: 1, 2-3, 4-7, ...), as of its last probe or switch",
            proposer + ["rows", "steps"], registry=r)
        self.fast_forward_tokens = Counter(
            f"{PREFIX}_fast_forward_tokens",
            "Output tokens a grammar forced that rows appended without sampling one step each "
            "(draft.fast_forward)", registry=r)

    def _add_kv(self, r: CollectorRegistry) -> None:
        """KV layouts (SPEC §7)."""
        self.kv_bytes = Gauge(
            f"{PREFIX}_kv_bytes", "KV bytes held by running rows, by layout",
            ["layout"], registry=r)
        self.kv_conversions = Counter(
            f"{PREFIX}_kv_conversions",
            "Rows converted from dense to their quantized layout (kv.quantized_start)",
            registry=r)
        self.kv_pool_blocks = Gauge(
            f"{PREFIX}_kv_pool_blocks",
            "Paged KV pool blocks per state, summed over layers (kv=paged; shared = used by "
            "more than one row or cache entry)", ["state"], registry=r)
        self._add_distributed(r)
        self._add_experts(r)

    def _add_experts(self, r: CollectorRegistry) -> None:
        """Expert offload (model.expert_offload): the hot-expert cache."""
        self.expert_lookups = Counter(
            f"{PREFIX}_expert_cache_lookups", "Routed experts looked up in the hot-expert cache, "
            "by result (hit: resident; miss: read from the mapped checkpoint)", ["result"],
            registry=r)
        for result in ("hit", "miss"):
            self.expert_lookups.labels(result)
        self.expert_bytes_moved = Counter(
            f"{PREFIX}_expert_bytes_moved", "Expert bytes read from the mapped checkpoint into "
            "the hot-expert cache", registry=r)
        self.expert_cache_bytes = Gauge(
            f"{PREFIX}_expert_cache_bytes", "Bytes of experts held in the hot-expert cache",
            registry=r)

    def watch_experts(self, cache: Any) -> None:
        """Engine thread, at load: count `cache`'s (pipeserve.model.experts.HotExperts) lookups."""
        def fetched(hits: int, misses: int, moved: int) -> None:
            self.expert_lookups.labels("hit").inc(hits)
            self.expert_lookups.labels("miss").inc(misses)
            self.expert_bytes_moved.inc(moved)
        cache.on_fetch = fetched
        self.expert_cache_bytes.set_function(lambda: cache.used)

    def _add_distributed(self, r: CollectorRegistry) -> None:
        """A distributed launch (pipeserve/distributed/): rank 0 exports every rank's series."""
        self.distributed_ranks = Gauge(
            f"{PREFIX}_distributed_ranks", "Ranks serving the model (1: distributed=none)",
            registry=r)
        self.distributed_ranks.set(1)
        self.distributed_step_seconds = Histogram(
            f"{PREFIX}_distributed_step_seconds",
            "Per rank: one engine pass between two plan syncs (its forward and host work)",
            ["rank"], buckets=STEP_BUCKETS_S, registry=r)
        self.distributed_sync_seconds = Histogram(
            f"{PREFIX}_distributed_sync_seconds",
            "Per rank: time in the plan sync's collectives, waiting for the slowest rank included",
            ["rank"], buckets=STEP_BUCKETS_S, registry=r)
        for family in (self.distributed_step_seconds, self.distributed_sync_seconds):
            family.labels("0")   # rank 0 always exists; a group adds the others at load

    @contextmanager
    def muted(self) -> Iterator[None]:
        """While inside, every metric this object hands out is a throwaway one (the launch
        warm-up's requests are not traffic); holders of a child taken earlier rebind after."""
        real = dict(self.__dict__)
        self.__dict__.update({k: v for k, v in Metrics(CollectorRegistry()).__dict__.items()
                              if k != "registry"})
        try:
            yield
        finally:
            self.__dict__.update(real)

    def _init_labels(self) -> None:
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        for phase in PHASES:
            self.step_tokens.labels(phase)
        for decision, reason in ADMISSION_DECISIONS:
            self.admission.labels(decision, reason)
        for kind in MEMORY_KINDS:
            self.mlx_memory.labels(kind)
        for family in (self.cache_hits, self.cache_hit_tokens, self.cache_bytes,
                       self.cache_entries, self.cache_evictions, self.cache_capacity,
                       self.cache_too_large):
            for tier in CACHE_TIERS:
                family.labels(tier)
        for generation in ("0", "1", "2"):
            self.gc_pause.labels(generation)
        for reason in CACHE_MISS_REASONS:
            self.cache_misses.labels(reason)
        for reason in SPILL_REASONS:
            self.cache_spills.labels(reason)
        for reason in CACHE_MISS_EXPLAINED:
            self.cache_miss_reasons.labels(reason)
        for outcome in ("ok", "not_found", "evicted"):
            self.stream_resumes.labels(outcome)
        for outcome in ("done", "cancelled", "failed"):
            self.warmups.labels(outcome)
        for family in (self.spec_proposed, self.spec_accepted, self.spec_verifies,
                       self.spec_emitted, self.spec_draft_length, self.spec_batch_off_steps):
            for name in registry.labels("draft"):
                family.labels(name)
        for state in ("used", "free", "shared"):
            self.kv_pool_blocks.labels(state)


def family_names(registry: CollectorRegistry) -> dict[str, str]:
    """Every metric family the registry exports, as written in /metrics (`_total` on counters,
    `_info` on info) → its type. docs/operations.md's metrics table is generated from them."""
    suffix = {"counter": "_total", "info": "_info"}
    return {m.name + suffix.get(m.type, ""): m.type for m in registry.collect()}


_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
                    "histogram": ("_bucket", "_sum", "_count", "_created")}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a PromQL query can use (`_bucket`, `_sum`, `_count` of histograms
    too), whether or not a labelled family has a series yet."""
    return {m.name + suffix for m in registry.collect() for suffix in _SAMPLE_SUFFIXES[m.type]}


_gc_watch: dict[str, Any] = {"metrics": None, "began": 0.0}


def quiet_collector(metrics: Metrics) -> None:
    """A process's startup is done: what it made lives as long as the process, so it goes out
    of the collector's view (a full collection no longer walks it, a pause holding the GIL),
    and the pauses left are timed (pipeserve_gc_pause_seconds)."""
    gc.collect()
    gc.freeze()
    watch_gc(metrics)
    count_drops(metrics.log_dropped)


def watch_gc(metrics: Metrics) -> None:
    """Time the collector's pauses into `metrics.gc_pause` (one callback a process; a later
    call points it at other metrics)."""
    if _gc_watch["metrics"] is None:
        gc.callbacks.append(_gc_seen)
    _gc_watch["metrics"] = metrics


def _gc_seen(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_watch["began"] = time.perf_counter()
        return
    metrics = _gc_watch["metrics"]
    if metrics is not None:
        metrics.gc_pause.labels(str(info["generation"])).observe(
            time.perf_counter() - _gc_watch["began"])
