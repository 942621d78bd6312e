"""Memory model for admission: weights + KV bytes per token of the served layout + prefill
temporaries, measured once on the engine thread at load (`probe`), then used as plain numbers
by admission (event loop) and the scheduler (engine thread)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEVICE_FRACTION = 0.75   # share of device memory the advisory estimate assumes is usable
CUDA_BUFFER_CACHE_FRACTION = 0.10   # default cap on MLX's cache of freed buffers on CUDA


@dataclass(frozen=True)
class MemoryModel:
    weight_bytes: int
    kv_bytes_per_token: int          # all layers that grow with context, one row
    window_tokens: int | None        # sliding layers stop growing here (None = no sliding layers)
    windowed_bytes_per_token: int    # the part of kv_bytes_per_token that is windowed
    state_bytes_per_row: int         # recurrent state, independent of length
    prefill_temp_bytes: int          # activations + logits of one prefill chunk
    device_bytes: int                # what the estimate may use (budget, or device share)
    max_context: int                 # the model's (or configured) context limit
    enforced: bool                   # admission=budget with memory_budget_gb
    kv_granularity: int = 1          # tokens a row's KV is allocated in (kv=paged: a block)

    def kv_bytes(self, tokens: int) -> int:
        """KV of one row holding `tokens` tokens (sliding layers capped at their window), in
        whole allocation units (a paged row holds whole blocks)."""
        g = self.kv_granularity
        tokens = -(-tokens // g) * g
        full = self.kv_bytes_per_token - self.windowed_bytes_per_token
        windowed = min(tokens, self.window_tokens or tokens) * self.windowed_bytes_per_token
        return tokens * full + windowed + self.state_bytes_per_row

    @property
    def max_safe_context(self) -> int:
        """Longest context one request can hold next to the weights and a prefill chunk."""
        room = self.device_bytes - self.weight_bytes - self.prefill_temp_bytes
        if room <= self.state_bytes_per_row:
            return 0
        if self.kv_bytes_per_token == 0:
            return self.max_context
        lo, hi = 0, self.max_context
        while lo < hi:                       # kv_bytes is monotone in tokens
            mid = (lo + hi + 1) // 2
            if self.kv_bytes(mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo


def device_memory_bytes() -> int:
    """The device's memory: Metal reports `memory_size`, CUDA `total_memory`; the CPU backend
    reports neither, so it is the host's RAM."""
    import mlx.core as mx
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = int(info.get("memory_size", 0) or info.get("total_memory", 0) or 0)
    if size:
        return size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe(loaded: Any, prefill_chunk: int, budget_gb: float | None,
          layout: Any = None) -> MemoryModel:
    """The memory model of a loaded model (see `estimate`)."""
    return estimate(loaded.model, loaded.config, loaded.weight_bytes, loaded.max_context,
                    prefill_chunk, budget_gb, layout)


def estimate(model: Any, config: dict[str, Any], weight_bytes: int, max_context: int,
             prefill_chunk: int, budget_gb: float | None, layout: Any = None) -> MemoryModel:
    """Build one token's forward through a fresh dense cache and read each layer's bytes per
    token from the cache's shapes; the full-attention layers are then billed at the served
    layout's true bytes per token. Nothing is evaluated, so a lazily built model (weights not
    yet read: `pipeserve fit`) gives the same figures as the loaded one."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    per_token = windowed = state = 0
    window: int | None = None
    for i, c in enumerate(cache):
        if isinstance(c, (KVCache, RotatingKVCache)) and c.keys is not None:
            b = c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2]
            if layout is not None and i in layout.layers:
                b = int(round(layout.bytes_per_token(layout.layers[i])))
            per_token += b
            if isinstance(c, RotatingKVCache) and c.max_size:
                windowed += b
                window = c.max_size if window is None else max(window, c.max_size)
        else:
            state += c.nbytes
    cfg = config.get("text_config", config)
    hidden = int(cfg.get("hidden_size", 0) or 0)
    inter = int(cfg.get("intermediate_size", 0) or 4 * hidden)
    vocab = int(cfg.get("vocab_size", 0) or 0)
    act = 4  # bytes; activations may be float32 on the CPU path
    temp = prefill_chunk * (vocab * 4 + (6 * hidden + 3 * inter) * act)
    device = int(budget_gb * 1e9) if budget_gb else int(device_memory_bytes() * DEVICE_FRACTION)
    return MemoryModel(weight_bytes=weight_bytes, kv_bytes_per_token=per_token,
                       window_tokens=window, windowed_bytes_per_token=windowed,
                       state_bytes_per_row=state, prefill_temp_bytes=temp,
                       device_bytes=device, max_context=max_context,
                       enforced=budget_gb is not None,
                       kv_granularity=getattr(getattr(layout, "cfg", None), "block_size", 1))


def buffer_cache_limit(configured_gb: float | None) -> int | None:
    """Bytes MLX may keep of freed buffers (None: leave MLX's default). MLX 0.32 on CUDA lets
    that cache grow to its whole memory limit (80% of the device); a batch whose rows join and
    leave one by one frees a differently sized KV buffer at every change, so at many streams
    the cache fills the device until allocation fails, and steps slow down on the way."""
    if configured_gb is not None:
        return int(configured_gb * 1e9)
    from pipeserve.kv.attention import on_cuda
    return int(device_memory_bytes() * CUDA_BUFFER_CACHE_FRACTION) if on_cuda() else None


def setup_memory(cfg: Any, loaded: Any, layout: Any, metrics: Any, prefill_chunk: int
                 ) -> tuple[MemoryModel, int | None, int | None]:
    """Apply admission's memory budget, probe the model's KV cost and publish it: returns the
    memory model, the KV budget rows may reserve (kv=paged: at most its pool) and the pool."""
    import mlx.core as mx
    adm = cfg.admission
    if adm.memory_budget_gb is not None:
        mx.set_memory_limit(int(adm.memory_budget_gb * 1e9))
    cache_limit = buffer_cache_limit(adm.buffer_cache_gb)
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)
        log.info("memory: MLX buffer cache capped at %.1f GB", cache_limit / 1e9)
    memory = probe(loaded, prefill_chunk, adm.memory_budget_gb, layout)
    kv_budget = int(adm.kv_budget_gb * 1e9) if adm.kv_budget_gb is not None else None
    pool = layout.pool_bytes
    if pool is not None:   # kv=paged: rows wait in the queue rather than exhaust the pool
        kv_budget = pool if kv_budget is None else min(kv_budget, pool)
    m = metrics
    m.weight_bytes.set(memory.weight_bytes)
    m.kv_bytes_per_token.set(memory.kv_bytes_per_token)
    m.max_safe_context.set(memory.max_safe_context)
    m.context_cap.set(memory.max_safe_context if memory.enforced else float("nan"))
    m.kv_budget.set(kv_budget if kv_budget is not None else float("nan"))
    m.kv_reserved.set(0)
    log.info("memory: weights %.1f MB, KV %d B/token, max safe context %d tokens (%s)",
             memory.weight_bytes / 1e6, memory.kv_bytes_per_token, memory.max_safe_context,
             "enforced" if memory.enforced else "advisory")
    return memory, kv_budget, pool
