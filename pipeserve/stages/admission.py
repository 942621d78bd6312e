"""Admission: resolve each request's sampling settings (request > server config >
generation_config > OpenAI defaults), check every value against its limit, and cap the
queue; the request's priority, and its deadline_ms against the latency estimate (refused
when it cannot be met). Event loop, once per request; never touches MLX."""
from __future__ import annotations

import math
from typing import Any, Callable

from pipeserve.config import ServeConfig
from pipeserve.errors import AdmissionRejected, InvalidRequest, MemoryAdmissionError
from pipeserve.grammar.constraint import GrammarBounds, GrammarCompiler, Matcher
from pipeserve.eventloop.latency import LatencyEstimator, priority_of
from pipeserve.metrics import Metrics
from pipeserve.request import Request, SamplingParams
from pipeserve.core.client import EngineLoad
from pipeserve.core.limits import EngineLimits

# field → (lowest, highest) inclusive; None = unbounded on that side. top_k is checked
# against the vocabulary (see _top_k).
RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0), "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0), "xtc_probability": (0.0, 1.0),
    "xtc_threshold": (0.0, 0.5), "penalty_context_size": (1, 1 << 16), "max_tokens": (1, None),
    "top_logprobs": (0, None), "seed": (0, (1 << 64) - 1),   # seed: an unsigned 64-bit value
    "deadline_ms": (1, None),
}
EXCLUSIVE_LOW = {"repetition_penalty"}   # 0 would divide the logits by zero
TOP_K_OFF = (-1, 0)   # top_k values that mean "no top-k" (-1: vLLM's, 0: mlx-lm's)
# A temperature this low samples the argmax anyway, and 1/T overflows float32 below ~3e-39:
# treated as greedy, as vLLM does (its _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
PROTOCOL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def prompt_field(request: Request) -> str:
    """The request's own field that holds its prompt (an error names it)."""
    if request.inputs.messages is None:
        return "prompt"
    return "input" if request.endpoint == "responses" else "messages"


class Admission:
    """Built once the engine has published its `limits`; `load` is the engine's (queue
    checks read it per request), `metrics` the HTTP side's."""

    def __init__(self, cfg: ServeConfig, limits: EngineLimits, load: Callable[[], EngineLoad],
                 metrics: Metrics) -> None:
        self.cfg = cfg.admission
        self.strict = cfg.server.strict_fields   # a max_tokens past the context: 400, not clamped
        self.server_defaults = {k: v for k, v in vars(cfg.sampling).items() if v is not None}
        loaded = limits.model
        self.model_defaults = loaded.generation_defaults
        self.limits = limits
        self.max_context = self.limits.max_context
        self.vocab_size = self.limits.vocab_size
        self.load = load
        self.metrics = metrics
        self.latency = LatencyEstimator()   # Retry-After, deadline_ms (fed by the HTTP scope)
        self.grammars = GrammarCompiler(loaded.tokenizer, self.vocab_size,
                                        loaded.tokenizer.eos_token_ids)
        self.grammar_bounds = GrammarBounds(self.cfg.max_grammar_bytes,
                                            self.cfg.max_guided_choices,
                                            self.cfg.max_schema_depth,
                                            self.cfg.grammar_timeout_s)

    async def __call__(self, request: Request) -> Request:
        try:
            request.priority, request.priority_class = priority_of(
                request.requested.priority, self.cfg.priority_classes,
                self.cfg.default_priority)
            request.sampling = self.resolve(request)
            self._fit_pool(request)
            if request.constraint is not None:
                request.grammar = await self.compile(request)
        except MemoryAdmissionError:
            raise   # counted with its own reason
        except InvalidRequest as e:
            self.metrics.admission.labels("rejected", "invalid").inc()
            raise e
        slots = self.limits.max_rows
        queued = self.load().num_queued
        if queued >= self.cfg.max_queue:
            self.metrics.admission.labels("rejected", "queue_full").inc()
            raise AdmissionRejected(
                f"the queue is full ({queued} waiting for a batch slot, "
                f"admission.max_queue is "
                f"{self.cfg.max_queue}); retry shortly",
                retry_after_s=self.latency.retry_after_s(slots), code="queue_full")
        estimate = self.latency.estimate(len(request.prompt_ids), request.sampling.max_tokens,
                                         slots)
        deadline = request.requested.deadline_ms
        if deadline is not None and estimate is not None and estimate.total_s * 1000 > deadline:
            self.metrics.admission.labels("rejected", "deadline").inc()
            raise AdmissionRejected(
                f"deadline_ms is {deadline}; the estimate is {estimate.describe()} at the "
                "measured rates — raise deadline_ms, lower max_tokens or retry later",
                retry_after_s=max(1, math.ceil(estimate.queue_s)), code="deadline_unmeetable")
        self.latency.admit(request.request_id, estimate)
        self.metrics.admission.labels("admitted", "ok").inc()
        return request

    def _fit_pool(self, request: Request) -> None:
        """kv=paged: a request that cannot fit in the whole block pool is refused now (one
        that fits waits in the queue for blocks; it is never cut short)."""
        pool, memory = self.limits.kv_pool_bytes, self.limits.memory
        if pool is None or memory is None:
            return
        prompt, sp = len(request.prompt_ids), request.sampling
        if memory.kv_bytes(prompt + sp.max_tokens) <= pool:
            return
        fits = 0
        while memory.kv_bytes(fits + 1024) <= pool:
            fits += 1024
        while memory.kv_bytes(fits + 1) <= pool:
            fits += 1
        if request.requested.max_tokens is None and prompt < fits:
            sp.max_tokens = min(sp.max_tokens, fits - prompt)   # the default: what fits
            return
        self.metrics.admission.labels("rejected", "kv_over_budget").inc()
        raise MemoryAdmissionError(
            f"prompt ({prompt} tokens) + max_tokens ({sp.max_tokens}) needs more KV than the "
            f"whole paged pool holds ({fits} tokens); lower max_tokens, shorten the prompt or "
            "raise kv.pool_blocks / kv.pool_gb", param="max_tokens", code="kv_over_budget")

    def resolve(self, request: Request) -> SamplingParams:
        given = request.requested.given()
        merged: dict[str, Any] = {**PROTOCOL_DEFAULTS, **self.model_defaults,
                                  **self.server_defaults}
        merged.update(given)
        for name, value in merged.items():
            self._check_range(name, value, given.get(name) is not None)
        if "top_k" in merged:
            merged["top_k"] = self._top_k(merged["top_k"], given.get("top_k") is not None)
        if 0 < merged["temperature"] < MIN_TEMPERATURE:
            merged["temperature"] = 0.0
        room = self.max_context - len(request.prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"prompt has {len(request.prompt_ids)} tokens; the context limit is "
                f"{self.max_context} — shorten the prompt", param=prompt_field(request),
                code="context_length_exceeded")
        max_tokens = merged.get("max_tokens") or self.cfg.max_tokens_default or room
        if given.get("max_tokens") is not None and max_tokens > room:
            said = (f"max_tokens is {max_tokens} but the prompt ({len(request.prompt_ids)} "
                    f"tokens) leaves {room} of the {self.max_context}-token context")
            if self.strict:
                raise InvalidRequest(f"{said}; lower max_tokens", param="max_tokens",
                                     code="context_length_exceeded")
            # as llama-server and Ollama do: agents ask for more than a local context holds
            request.warnings.append(f"{said}: clamped to {room}")
        merged["max_tokens"] = min(max_tokens, room)
        stop = merged.get("stop") or []
        if len(stop) > self.cfg.max_stop:
            raise InvalidRequest(f"stop has {len(stop)} strings; the limit is {self.cfg.max_stop}",
                                 param="stop")
        top_limit = min(self.cfg.max_top_logprobs, self.vocab_size)
        if merged.get("top_logprobs", 0) > top_limit:
            raise InvalidRequest(
                f"top_logprobs is {merged['top_logprobs']}; the limit is {top_limit}",
                param="top_logprobs")
        for token_id in (merged.get("logit_bias") or {}):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token {token_id}, outside the vocabulary "
                    f"[0, {self.vocab_size})", param="logit_bias")
        known = SamplingParams.__dataclass_fields__
        return SamplingParams(**{k: v for k, v in merged.items() if k in known})

    async def compile(self, request: Request) -> Matcher:
        """The request's structured-output constraint compiled for the served tokenizer, on the
        grammar threads (a large schema, or the first compile, can take a while); a 400 naming
        the field when it cannot be honoured, is past admission's grammar bounds, or does not
        compile within admission.grammar_timeout_s."""
        c = request.constraint
        assert c is not None
        if request.output_prefix and not c.whole_turn:   # a turn grammar covers the span
            raise InvalidRequest(
                f"{c.param} cannot be honoured: the prompt opens the answer with "
                f"{request.output_prefix.strip()!r} (a think span or a forced tool call), and the "
                "constraint would apply inside it; turn thinking off (reasoning_effort 'none') or "
                "drop tool_choice", param=c.param)
        self.grammar_bounds.check(c)
        return await self.grammars.matcher_async(c, self.grammar_bounds.timeout_s)

    def _top_k(self, value: Any, from_request: bool) -> int:
        """top_k → what the sample stage uses: 0 = no top-k. -1 and 0 mean off; a k at or
        above the vocabulary size keeps every token, so it is off too (as in vLLM and
        llama.cpp)."""
        where = "" if from_request else " (server/model default)"
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest(f"top_k must be an integer, got {value!r:.40}{where}",
                                 param="top_k")
        if value < TOP_K_OFF[0]:
            raise InvalidRequest(
                f"top_k is {value}{where}; allowed: -1 or 0 (off) or a positive integer (from "
                f"{self.vocab_size}, the vocabulary size, up, every token is kept)", param="top_k")
        return 0 if value in TOP_K_OFF or value >= self.vocab_size else value

    @staticmethod
    def _check_range(name: str, value: Any, from_request: bool) -> None:
        bounds = RANGES.get(name)
        if bounds is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        low, high = bounds
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value}", param=name)
        exclusive = name in EXCLUSIVE_LOW
        if ((low is not None and (value < low or exclusive and value == low))
                or (high is not None and value > high)):
            opening = "(" if exclusive else "["
            span = (f"{opening}{low if low is not None else '-inf'}, "
                    f"{high if high is not None else 'inf'}]")
            where = "" if from_request else " (server/model default)"
            raise InvalidRequest(f"{name} is {value}{where}; allowed range is {span}", param=name)


class BudgetAdmission(Admission):
    """admission=budget: the memory estimate is enforced. With memory_budget_gb a prompt that
    leaves no room to generate is rejected and a larger max_tokens is reduced to what fits;
    with kv_budget_gb a request whose projected KV cannot fit even alone is rejected (one that
    fits alone but not beside the running rows waits in the scheduler)."""

    def resolve(self, request: Request) -> SamplingParams:
        sp = super().resolve(request)
        memory = self.limits.memory
        assert memory is not None
        prompt = len(request.prompt_ids)
        if memory.enforced:
            cap = memory.max_safe_context
            if prompt >= cap:
                self.metrics.admission.labels("rejected", "context_over_budget").inc()
                raise MemoryAdmissionError(
                    f"prompt has {prompt} tokens but admission.memory_budget_gb="
                    f"{self.cfg.memory_budget_gb} leaves room for {cap} tokens of context "
                    "(weights + KV + prefill temporaries); shorten the prompt or raise the budget",
                    param=prompt_field(request), code="context_over_budget")
            if prompt + sp.max_tokens > cap:
                sp.max_tokens = cap - prompt
                self.metrics.admission.labels("clamped", "context_over_budget").inc()
        if self.cfg.kv_budget_gb is not None:
            need = memory.kv_bytes(prompt + sp.max_tokens)
            budget = int(self.cfg.kv_budget_gb * 1e9)
            if need > budget:
                self.metrics.admission.labels("rejected", "kv_over_budget").inc()
                raise MemoryAdmissionError(
                    f"prompt ({prompt} tokens) + max_tokens ({sp.max_tokens}) needs "
                    f"{need / 1e9:.3f} GB of KV; admission.kv_budget_gb is "
                    f"{self.cfg.kv_budget_gb} — lower max_tokens or shorten the prompt",
                    param="max_tokens", code="kv_over_budget")
        return sp
