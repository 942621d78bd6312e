"""Will it fit: the memory model admission uses (weights as served, KV bytes per token of the
chosen KV layout, prefill temporaries, the device's usable memory), worked out from a checkpoint's
config.json and tensor headers (or a GGUF file's header) before any weight is read. Runs on
whichever thread calls it (`pipeserve fit`, or the loader just before it reads the weights)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeserve.memory import MemoryModel, estimate as memory_estimate
from pipeserve.model.experts import cache_bytes, expert_bytes
from pipeserve.model.loader import _cast_weights, resolve_path
from pipeserve.model.gguf.plan import lazy_gguf_model
from pipeserve.core.scheduler import Limits
from pipeserve.kv.layouts import build_layout

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.model.config import ModelConfig

CONTEXTS = (2048, 8192, 32768, 131072)   # context lengths the rows table shows (up to the model's)


@dataclass(frozen=True)
class Fit:
    memory: MemoryModel
    model_type: str
    compute_dtype: str     # the served form, as the loader names it ("float32", "bfloat16+q4")
    source: str            # what the figures were read from
    experts: tuple[int, int] | None = None   # model.expert_offload: (cache, all experts) bytes

    def rows_at(self, tokens: int) -> int:
        """Rows of `tokens` tokens each that fit beside the weights and one prefill chunk."""
        m = self.memory
        room = m.device_bytes - m.weight_bytes - m.prefill_temp_bytes
        return max(0, room // m.kv_bytes(tokens)) if m.kv_bytes(tokens) else 0

    def contexts(self) -> list[int]:
        """The context lengths the rows table shows: CONTEXTS below the model's, and its own."""
        m = self.memory
        return sorted({c for c in CONTEXTS if c < m.max_context} | {m.max_context})

    def body(self) -> dict[str, Any]:
        """The estimate as JSON (GET /v1/models/{id}/fit): the figures `lines` prints."""
        m = self.memory
        return {"model_type": self.model_type, "served_as": self.compute_dtype,
                "source": self.source, "weight_bytes": m.weight_bytes,
                "kv_bytes_per_token": m.kv_bytes_per_token, "window_tokens": m.window_tokens,
                "windowed_bytes_per_token": m.windowed_bytes_per_token,
                "state_bytes_per_row": m.state_bytes_per_row,
                "prefill_temp_bytes": m.prefill_temp_bytes, "device_bytes": m.device_bytes,
                "budget": "admission.memory_budget_gb" if m.enforced else "75% of the device",
                "max_context": m.max_context, "max_safe_context": m.max_safe_context,
                "rows": [{"tokens": n, "rows": self.rows_at(n)} for n in self.contexts()],
                "fits": m.weight_bytes + m.prefill_temp_bytes <= m.device_bytes,
                **({"expert_cache_bytes": self.experts[0], "expert_bytes": self.experts[1]}
                   if self.experts else {})}

    def lines(self) -> list[str]:
        m = self.memory
        out = [f"model: {self.model_type} from {self.source}, served as {self.compute_dtype}",
               f"weights: {_size(m.weight_bytes)}"
               + (f" (the experts mapped from disk: a {_size(self.experts[0])} hot-expert cache "
                  f"in place of their {_size(self.experts[1])})" if self.experts else ""),
               f"KV: {m.kv_bytes_per_token} bytes per token"
               + (f" ({m.windowed_bytes_per_token} of them in layers windowed at "
                  f"{m.window_tokens} tokens)" if m.window_tokens else "")
               + (f", {m.state_bytes_per_row} bytes of recurrent state per row"
                  if m.state_bytes_per_row else ""),
               f"prefill temporaries: {_size(m.prefill_temp_bytes)}",
               f"device memory usable: {_size(m.device_bytes)} ("
               + ("admission.memory_budget_gb)" if m.enforced else "75% of the device)"),
               f"largest context one request can hold: {m.max_safe_context} tokens "
               f"(model limit {m.max_context})"]
        for n in self.contexts():
            out.append(f"rows of {n} tokens that fit at once: {self.rows_at(n)}")
        if m.weight_bytes + m.prefill_temp_bytes > m.device_bytes:
            out.append("does not fit: the weights and one prefill chunk alone exceed the "
                       "usable memory")
        return out


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def lazy_model(cfg: ModelConfig) -> tuple[Any, dict[str, Any], str, str]:
    """The model built from its config with its weights not read (MLX loads lazily), cast as
    the loader would cast it: (model, config, served form, what it was built from)."""
    from mlx_lm.utils import load_model


    local = Path(cfg.path).expanduser() if cfg.path is not None else None
    if local is not None and local.is_file():
        model, config, source = lazy_gguf_model(local, cfg.cache_dir)
    else:
        model, config = load_model(resolve_path(cfg), lazy=True,
                                   trust_remote_code=cfg.trust_remote_code)
        source = "config.json and the safetensors headers"
    return model, config, _cast_weights(model, cfg), source


def weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def max_context(cfg: ModelConfig, config: dict[str, Any]) -> int:
    """model.max_context, else the checkpoint's max_position_embeddings (the loader's rule)."""
    text = config.get("text_config", config)
    native = int(text.get("max_position_embeddings") or config.get("max_position_embeddings")
                 or 4096)
    return cfg.max_context or native


def estimate(cfg: ServeConfig, on_gpu: bool | None = None) -> Fit:
    """The admission memory model of `cfg`'s model, KV layout, scheduler and budget, with no
    weight read."""
    import mlx.core as mx


    model, config, compute, source = lazy_model(cfg.model)
    layout = build_layout(cfg.kv, model)
    gpu = mx.default_device().type == mx.DeviceType.gpu if on_gpu is None else on_gpu
    chunk = Limits.fit(cfg, on_gpu=gpu).prefill_chunk
    weights, experts = weight_bytes(model), None
    if cfg.model.expert_offload:   # the experts take the hot-expert cache instead
        experts = (cache_bytes(model, cfg.model.expert_cache_mb), expert_bytes(model))
        weights += experts[0] - experts[1]
    memory = memory_estimate(model, config, weights, max_context(cfg.model, config),
                             chunk, cfg.admission.memory_budget_gb, layout)
    return Fit(memory, str(config.get("model_type", "model")), compute, source, experts)

