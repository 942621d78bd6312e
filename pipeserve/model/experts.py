"""Expert offload (model.expert_offload): a mixture-of-experts model whose experts need not fit
in device memory. Every stacked expert layer (mlx-lm's SwitchGLU / SwitchMLP) gives up its
expert tensors; they stay memory-mapped in the checkpoint's safetensors files, and a bounded
hot-expert cache (model.expert_cache_mb, shared by all layers, least recently routed evicted)
holds the ones in use on the device. Each forward routes first, brings the routed experts in,
then runs mlx-lm's own layer on just those, so the output is the fully loaded model's.
Runs on the engine thread (the loader wraps the model; the forward pass calls it)."""
from __future__ import annotations

import json
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pipeserve.errors import ConfigError

log = logging.getLogger(__name__)
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32,
          "U8": np.uint8, "I32": np.int32}


@dataclass
class Tensor:
    """One tensor of a safetensors file: mapped, never read whole."""
    data: np.ndarray   # a memmap view in the stored dtype (BF16 as uint16)
    dtype: str


def mapped_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint's *.safetensors files, memory-mapped from disk."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        raw = np.memmap(f, dtype=np.uint8, mode="r")
        for name, t in header.items():
            if name == "__metadata__" or t["dtype"] not in DTYPES:
                continue
            start, stop = t["data_offsets"]
            view = raw[8 + n + start:8 + n + stop].view(DTYPES[t["dtype"]])
            out[name] = Tensor(view.reshape(t["shape"]), t["dtype"])
    return out


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class HotExperts:
    """The device-resident experts of every layer, bounded by `capacity` bytes; the least
    recently routed is evicted first (never one the current layer needs)."""
    capacity: int
    total: int = 0   # every expert's bytes, fully loaded
    held: OrderedDict[tuple[int, int], dict[str, Any]] = field(default_factory=OrderedDict)
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    used: int = 0
    stats: Stats = field(default_factory=Stats)
    on_fetch: Callable[[int, int, int], None] | None = None   # (hits, misses, bytes moved)

    def fetch(self, layer: OffloadedExperts, experts: list[int]) -> list[dict[str, Any]]:
        """The arrays of `experts` of `layer` (name -> array), reading the missing ones."""
        out, fresh, fresh_keys = [], [], []
        for e in experts:
            key = (layer.index, e)
            if key in self.held:
                self.held.move_to_end(key)
                self.stats.hits += 1
            else:
                arrays = layer.read(e)
                fresh.extend(arrays.values())
                fresh_keys.append(key)
                self.held[key] = arrays
                self.sizes[key] = sum(a.nbytes for a in arrays.values())
                self.used += self.sizes[key]
                self.stats.misses += 1
                self.stats.bytes_moved += self.sizes[key]
            out.append(self.held[key])
        mx.eval(fresh)   # copied from the mapped file now, not when the graph runs
        if self.on_fetch is not None:
            self.on_fetch(len(experts) - len(fresh_keys), len(fresh_keys),
                          sum(self.sizes[k] for k in fresh_keys))
        self._evict(keep={(layer.index, e) for e in experts})
        return out

    def _evict(self, keep: set[tuple[int, int]]) -> None:
        for key in list(self.held):
            if self.used <= self.capacity:
                return
            if key not in keep:
                del self.held[key]
                self.used -= self.sizes.pop(key)
                self.stats.evictions += 1


@dataclass
class Projection:
    """One expert projection of a layer: its tensors in the mapped file and how it is served."""
    tensors: dict[str, Tensor]             # weight (+ scales, biases, bias): (experts, ...)
    dtype: Any                             # the served floating dtype
    dequantize: dict[str, Any] | None      # served as floats from a quantized file: its args


class OffloadedExperts(nn.Module):
    """A SwitchGLU / SwitchMLP whose expert tensors live in the mapped checkpoint: called as the
    layer it replaces, (x, indices) -> mixed outputs."""

    def __init__(self, index: int, inner: Any, projections: dict[str, Projection],
                 cache: HotExperts) -> None:
        super().__init__()
        self.inner = inner   # mlx-lm's layer, its expert tensors swapped in for each call
        object.__setattr__(self, "plan", (index, projections, cache))

    @property
    def index(self) -> int:
        return self.plan[0]

    def read(self, e: int) -> dict[str, Any]:
        """Expert `e`'s parameters, from the mapped file, in the form the layer serves them."""
        out = {}
        for proj, p in self.plan[1].items():
            got = {name: _expert_slice(t, e) for name, t in p.tensors.items()}
            if p.dequantize is not None:   # served as floats (model.compute_dtype=auto, CPU)
                got["weight"] = mx.dequantize(got.pop("weight"), got.pop("scales"),
                                              got.pop("biases", None), **p.dequantize)
            out.update({f"{proj}.{k}": v.astype(p.dtype) if mx.issubdtype(v.dtype, mx.floating)
                        else v for k, v in got.items()})
        return out

    def __call__(self, x: Any, indices: Any) -> Any:
        _, projections, cache = self.plan
        routed = np.array(indices)   # the routing decides what to bring in: evaluated here
        experts = np.unique(routed).tolist()
        arrays = cache.fetch(self, experts)
        table = np.zeros(max(experts) + 1, np.uint32)
        table[experts] = np.arange(len(experts), dtype=np.uint32)
        for proj in projections:
            module = getattr(self.inner, proj)
            for key in arrays[0]:
                if key.startswith(proj + "."):
                    setattr(module, key.partition(".")[2], mx.stack([a[key] for a in arrays]))
        try:
            return self.inner(x, mx.array(table[routed], dtype=indices.dtype))
        finally:
            for proj in projections:
                _empty(getattr(self.inner, proj))


def offload(model: Any, path: Path, config: dict[str, Any], cache_mb: float) -> HotExperts:
    """Replace every stacked expert layer of `model` by an OffloadedExperts reading the
    checkpoint at `path`; their tensors are never loaded whole. Before the weights are read."""
    from mlx.utils import tree_unflatten

    tensors = mapped_tensors(path)
    cache = HotExperts(int(cache_mb * 1e6))
    swaps = []
    for name, module in expert_layers(model):
        projections = {proj: _projection(f"{name}.{proj}", getattr(module, proj), tensors, config)
                       for proj, _ in _switch_linears(module)}
        for proj in projections:
            _empty(getattr(module, proj))
        swaps.append((name, OffloadedExperts(len(swaps), module, projections, cache)))
    if not swaps:
        raise ConfigError(f"model.expert_offload=true: {config.get('model_type')!r} has no stacked "
                          "expert layers (mlx-lm's SwitchGLU / SwitchMLP); it applies to "
                          "mixture-of-experts models")
    model.update_modules(tree_unflatten(swaps))
    log.info("expert offload: %d expert layers mapped from %s; hot-expert cache %.1f MB",
             len(swaps), path, cache_mb)
    return cache


def expert_layers(model: Any) -> list[tuple[str, Any]]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


def expert_bytes(model: Any) -> int:
    """What the stacked experts of `model` take when fully loaded (lazily built: none read)."""
    from mlx.utils import tree_flatten
    return sum(v.nbytes for _, layer in expert_layers(model)
               for _, proj in _switch_linears(layer) for _, v in tree_flatten(proj.parameters()))


def _switch_linears(layer: Any) -> list[tuple[str, Any]]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    return [(k, v) for k, v in layer.items()
            if isinstance(v, (SwitchLinear, QuantizedSwitchLinear))]


def _projection(prefix: str, module: Any, tensors: dict[str, Tensor],
                config: dict[str, Any]) -> Projection:
    """How one projection's experts are read: its file tensors and its served form."""
    found = {k.rpartition(".")[2]: t for k, t in tensors.items() if k.rpartition(".")[0] == prefix}
    if "weight" not in found:
        raise ConfigError(f"model.expert_offload=true: the checkpoint has no {prefix}.weight (its "
                          "experts are not stored stacked, as mlx-lm's converted checkpoints "
                          "store them); convert it with mlx_lm.convert first")
    dtypes = [v.dtype for v in module.values() if mx.issubdtype(v.dtype, mx.floating)]
    dq = None
    if "scales" in found and "scales" not in module:   # the loader dequantized the layer
        quant = config.get("quantization", {})
        own = quant.get(prefix, quant)
        dq = {"group_size": own["group_size"], "bits": own["bits"],
              "mode": own.get("mode", "affine")}
    return Projection(found, dtypes[0] if dtypes else mx.float32, dq)


def _expert_slice(t: Tensor, e: int) -> Any:
    a = mx.array(np.ascontiguousarray(t.data[e]))
    return a.view(mx.bfloat16) if t.dtype == "BF16" else a


def _empty(module: Any) -> None:
    """Hold no expert tensor between calls (their bytes are the cache's)."""
    for name, v in list(module.items()):
        if isinstance(v, mx.array):
            setattr(module, name, mx.zeros((0,), v.dtype))
