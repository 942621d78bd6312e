"""The `pipeline` group (which class fills each stage slot) and the `admission` group's options
(the admission stage's limits). Imports no mlx: checked at launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from pipeserve import registry
from pipeserve.errors import ConfigError, check_positive as _positive
from pipeserve.registry import register


@dataclass
class AdmissionConfig:
    _target_: str = MISSING
    max_queue: int = 64                     # waiting requests; beyond it 429 with Retry-After
    max_context: Optional[int] = None       # tokens (prompt + output); default: the model's
    max_tokens_default: Optional[int] = None  # output cap when a request omits max_tokens
    max_stop: int = 16                      # stop strings per request
    max_top_logprobs: int = 20              # OpenAI's limit
    # structured output: what one request may ask the grammar compiler to build (400 beyond)
    max_grammar_bytes: int = 262144         # bytes of a constraint (schema JSON, regex, grammar, choices)
    max_guided_choices: int = 4096          # strings in guided_choice
    max_schema_depth: int = 32              # nesting of a JSON schema document's objects/arrays
    grammar_timeout_s: float = 10.0         # wall-clock seconds a compile may take (waiting included)
    memory_budget_gb: Optional[float] = None  # decimal GB; opt-in enforced budget
    kv_budget_gb: Optional[float] = None      # decimal GB of KV across rows
    # request `priority` names → 0 (most urgent) .. 9; a request may also send the number
    priority_classes: dict[str, int] = field(
        default_factory=lambda: {"interactive": 0, "default": 5, "batch": 9})
    default_priority: str = "default"         # the class of a request that sends none
    # classes whose running rows a request of a more urgent class may take when every row is
    # taken (preempted: cached, and continued later from where they stopped); [] never
    preemptible: list[str] = field(default_factory=lambda: ["batch"])
    buffer_cache_gb: Optional[float] = None   # MLX's cache of freed buffers, at most (decimal
    #                                         GB); default: 10% of device memory on CUDA,
    #                                         MLX's own limit elsewhere
    # a waiting request joins the batch only while MLX's active memory plus the KV its prompt
    # will take (twice: the row's and its copy into the batch) stays under this share of MLX's
    # memory limit: past it MLX stops queueing work ahead of the device (each evaluation
    # waits for what is in flight), steps slow down many times over, so a burst waits in the
    # queue instead (the prompt cache gives up its oldest entries first). 0: off
    memory_high_water: float = 0.9

    @property
    def name(self) -> str:
        """The option (`admission=<name>`)."""
        return registry.name_of(self)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ConfigError(f"admission.max_queue must be >= 0, got {self.max_queue}")
        _positive("admission.max_context", self.max_context)
        for name in ("max_grammar_bytes", "max_guided_choices", "max_schema_depth",
                     "grammar_timeout_s"):
            _positive(f"admission.{name}", getattr(self, name))
        _positive("admission.max_tokens_default", self.max_tokens_default)
        _positive("admission.memory_budget_gb", self.memory_budget_gb)
        _positive("admission.kv_budget_gb", self.kv_budget_gb)
        if not 0 <= self.memory_high_water <= 1:
            raise ConfigError(f"admission.memory_high_water is {self.memory_high_water}; it is "
                              "a share of MLX's memory limit, 0 (off) .. 1")
        for name, value in self.priority_classes.items():
            if not 0 <= value <= 9:
                raise ConfigError(f"admission.priority_classes.{name} is {value}; priorities "
                                  "are 0 (most urgent) .. 9")
        if self.default_priority not in self.priority_classes:
            raise ConfigError(f"admission.default_priority {self.default_priority!r} is not in "
                              f"admission.priority_classes ({', '.join(self.priority_classes)})")
        for name in self.preemptible:
            if name not in self.priority_classes:
                raise ConfigError(f"admission.preemptible names {name!r}, not a class of "
                                  "admission.priority_classes "
                                  f"({', '.join(self.priority_classes)})")
        if self.buffer_cache_gb is not None and self.buffer_cache_gb < 0:
            raise ConfigError(f"admission.buffer_cache_gb must be >= 0, got {self.buffer_cache_gb}")


@register("admission", "advisory")
@dataclass
class AdvisoryAdmissionConfig(AdmissionConfig):
    _target_: str = "pipeserve.stages.admission.Admission"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_budget_gb is not None or self.kv_budget_gb is not None:
            raise ConfigError(
                "admission=advisory never enforces a budget, got "
                f"admission.memory_budget_gb={self.memory_budget_gb}, "
                f"admission.kv_budget_gb={self.kv_budget_gb}; use admission=budget "
                "to set admission.memory_budget_gb or admission.kv_budget_gb")


@register("admission", "budget")
@dataclass
class BudgetAdmissionConfig(AdmissionConfig):
    _target_: str = "pipeserve.stages.admission.BudgetAdmission"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_budget_gb is None and self.kv_budget_gb is None:
            raise ConfigError(
                "admission=budget needs admission.memory_budget_gb (decimal GB: sets MLX's "
                "memory limit and enforces the fit estimate) and/or admission.kv_budget_gb "
                "(aggregate KV across rows); got neither")


@dataclass
class StageConfig:
    """One slot of the pipeline: which class fills it. Tunables live in their groups."""

    _target_: str = MISSING


def _slot(target: str) -> Any:
    return field(default_factory=lambda: StageConfig(_target_=target))


@dataclass
class PipelineConfig:
    """The fixed slots, in order: request stages (event loop), then step stages (engine).
    These defaults are the only place a slot's built-in class is named
    (pipeserve/conf/pipeline/default.yaml extends this schema; `load_config` checks every field)."""

    tokenize: StageConfig = _slot("pipeserve.stages.tokenize.Tokenize")
    cache_lookup: StageConfig = _slot("pipeserve.stages.cache_lookup.CacheLookup")
    draft: StageConfig = _slot("pipeserve.stages.draft.Draft")
    prefill: StageConfig = _slot("pipeserve.stages.prefill.Prefill")
    sample: StageConfig = _slot("pipeserve.stages.sample.Sample")
    verify: StageConfig = _slot("pipeserve.stages.verify.Verify")
    persist: StageConfig = _slot("pipeserve.stages.persist.Persist")
    detokenize: StageConfig = _slot("pipeserve.stages.detokenize.Detokenize")
