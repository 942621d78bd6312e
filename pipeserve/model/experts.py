"""Expert offload (model.expert_offload): a mixture-of-experts model whose experts need not fit
in device memory. Every stacked expert layer (mlx-lm's SwitchGLU / SwitchMLP) gives up its
expert tensors; they stay memory-mapped in the checkpoint's safetensors files, and a bounded
hot-expert cache (model.expert_cache_mb, split evenly into per-layer slots; in each layer the
expert routed least often lately gives up its slot) holds the ones in use on the device. Each
forward routes first, brings the routed experts in, then runs mlx-lm's own layer on the slots,
so the output is the fully loaded model's. Runs on the engine thread (the loader wraps the
model; the forward pass calls it)."""
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
DECAY = 0.98   # per layer call: a routing counts half after 34 calls (least often routed evicted)
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
    """The device-resident experts, `capacity` bytes split evenly into per-layer slots; within a
    layer the expert routed least often lately gives up its slot first."""
    capacity: int
    total: int = 0   # every expert's bytes, fully loaded
    layers: list[OffloadedExperts] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    on_fetch: Callable[[int, int, int], None] | None = None   # (hits, misses, bytes moved)

    @property
    def used(self) -> int:
        return sum(layer.held_bytes for layer in self.layers)

    def count(self, hits: int, misses: int, moved: int) -> None:
        self.stats.hits += hits
        self.stats.misses += misses
        self.stats.bytes_moved += moved
        if self.on_fetch is not None:
            self.on_fetch(hits, misses, moved)


@dataclass
class Projection:
    """One expert projection of a layer: its tensors in the mapped file and how it is served."""
    tensors: dict[str, Tensor]             # weight (+ scales, biases, bias): (experts, ...)
    dtype: Any                             # the served floating dtype
    dequantize: dict[str, Any] | None      # served as floats from a quantized file: its args


class OffloadedExperts(nn.Module):
    """A SwitchGLU / SwitchMLP whose expert tensors live in the mapped checkpoint: called as the
    layer it replaces, (x, indices) -> mixed outputs. Its resident experts sit in `slots` slots
    of stacked arrays, which mlx-lm's layer indexes directly."""

    def __init__(self, inner: Any, projections: dict[str, Projection], cache: HotExperts,
                 experts: int, expert_size: int) -> None:
        super().__init__()
        self.inner = inner   # mlx-lm's layer, its expert tensors swapped in for each call
        object.__setattr__(self, "plan", _Slots(projections, cache, experts, expert_size))

    @property
    def held_bytes(self) -> int:
        return self.plan.held   # a plain int: /metrics reads it from the event loop

    def read(self, e: int) -> dict[str, Any]:
        """Expert `e`'s parameters, from the mapped file, in the form the layer serves them."""
        out = {}
        for proj, p in self.plan.projections.items():
            got = {name: _expert_slice(t, e) for name, t in p.tensors.items()}
            if p.dequantize is not None:   # served as floats (model.compute_dtype=auto, CPU)
                got["weight"] = mx.dequantize(got.pop("weight"), got.pop("scales"),
                                              got.pop("biases", None), **p.dequantize)
            out.update({f"{proj}.{k}": v.astype(p.dtype) if mx.issubdtype(v.dtype, mx.floating)
                        else v for k, v in got.items()})
        return out

    def __call__(self, x: Any, indices: Any) -> Any:
        plan = self.plan
        routed = np.array(indices)   # the routing decides what to bring in: evaluated here
        experts = np.unique(routed).tolist()
        if len(experts) <= plan.slots:
            arrays, where = plan.bring_in(self, experts)
        else:   # more experts than the layer's slots (a long prompt): stacked for this call
            arrays, where = plan.stacked(self, experts)
        table = np.zeros(max(experts) + 1, np.uint32)
        table[experts] = where
        for key, value in arrays.items():
            proj, _, name = key.partition(".")
            setattr(getattr(self.inner, proj), name, value)
        try:
            return self.inner(x, mx.array(table[routed], dtype=indices.dtype))
        finally:
            for proj in plan.projections:
                _empty(getattr(self.inner, proj))


@dataclass
class _Slots:
    projections: dict[str, Projection]
    cache: HotExperts
    experts: int         # how many the layer has
    expert_size: int     # one expert's bytes as served
    slots: int = 1       # set once every layer is known (the cache split evenly)
    arrays: dict[str, Any] = field(default_factory=dict)   # "proj.param" -> (slots, ...)
    held: int = 0        # their bytes
    slot_of: OrderedDict[int, int] = field(default_factory=OrderedDict)   # by last routing
    routings: dict[int, tuple[float, int]] = field(default_factory=dict)  # e -> (count, call)
    calls: int = 0

    def routed(self, experts: list[int]) -> None:
        """Count one call's routing: each expert's count decays by DECAY a call, plus one."""
        self.calls += 1
        for e in experts:
            self.routings[e] = (self.frequency(e) + 1, self.calls)

    def frequency(self, e: int) -> float:
        count, last = self.routings.get(e, (0.0, self.calls))
        return count * DECAY ** (self.calls - last)

    def bring_in(self, layer: OffloadedExperts, experts: list[int]) -> tuple[dict[str, Any],
                                                                            list[int]]:
        """The slot arrays with every expert of `experts` resident, and their slots."""
        self.routed(experts)
        missing = [e for e in experts if e not in self.slot_of]
        moved = 0
        for e in missing:
            slot = self._free_slot(keep=set(experts))
            for key, value in layer.read(e).items():
                if key not in self.arrays:
                    self.arrays[key] = mx.zeros((self.slots, *value.shape), value.dtype)
                    self.held += self.arrays[key].nbytes
                self.arrays[key][slot] = value
                moved += value.nbytes
            self.slot_of[e] = slot
        for e in experts:
            self.slot_of.move_to_end(e)
        if missing:
            mx.eval(list(self.arrays.values()))   # copied from the mapped file now
        self.cache.count(len(experts) - len(missing), len(missing), moved)
        return self.arrays, [self.slot_of[e] for e in experts]

    def _free_slot(self, keep: set[int]) -> int:
        taken = set(self.slot_of.values())
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            return free[0]
        # the least often routed lately; between equals, the least recently routed
        victim = min((e for e in self.slot_of if e not in keep), key=self.frequency)
        self.cache.stats.evictions += 1
        return self.slot_of.pop(victim)

    def stacked(self, layer: OffloadedExperts, experts: list[int]) -> tuple[dict[str, Any],
                                                                           list[int]]:
        """Every routed expert stacked for one call: the resident ones from their slots, the
        others read (and not kept)."""
        self.routed(experts)
        parts, moved, hits = [], 0, 0
        for e in experts:
            if e in self.slot_of:
                parts.append({k: v[self.slot_of[e]] for k, v in self.arrays.items()})
                hits += 1
            else:
                parts.append(layer.read(e))
                moved += sum(v.nbytes for v in parts[-1].values())
        self.cache.count(hits, len(experts) - hits, moved)
        return ({k: mx.stack([p[k] for p in parts]) for k in parts[0]},
                list(range(len(experts))))


def offload(model: Any, path: Path, config: dict[str, Any], cache_mb: float) -> HotExperts:
    """Replace every stacked expert layer of `model` by an OffloadedExperts reading the
    checkpoint at `path`; their tensors are never loaded whole. Before the weights are read."""
    from mlx.utils import tree_unflatten

    tensors = mapped_tensors(path)
    cache = HotExperts(int(cache_mb * 1e6))
    swaps = []
    for name, module in expert_layers(model):
        linears = _switch_linears(module)
        projections = {proj: _projection(f"{name}.{proj}", m, tensors, config)
                       for proj, m in linears}
        experts, size = _expert_shape(module)
        for _, m in linears:
            _empty(m)
        swaps.append((name, OffloadedExperts(module, projections, cache, experts, size)))
        cache.layers.append(swaps[-1][1])
    if not swaps:
        raise ConfigError(f"model.expert_offload=true: {config.get('model_type')!r} has no stacked "
                          "expert layers (mlx-lm's SwitchGLU / SwitchMLP); it applies to "
                          "mixture-of-experts models")
    for layer, slots in zip(cache.layers, _slots([(l.plan.experts, l.plan.expert_size)
                                                  for l in cache.layers], cache.capacity)):
        layer.plan.slots = slots
    cache.capacity = sum(layer.plan.slots * layer.plan.expert_size for layer in cache.layers)
    model.update_modules(tree_unflatten(swaps))
    log.info("expert offload: %d expert layers mapped from %s; hot-expert cache %.1f MB "
             "(%d experts per layer)", len(swaps), path, cache.capacity / 1e6,
             cache.layers[0].plan.slots)
    _warn_if_small(cache, int(config.get("text_config", config).get("num_experts_per_tok") or 0))
    return cache


def _warn_if_small(cache: HotExperts, routed: int) -> None:
    """A layer with fewer slots than one token routes to reads its experts on every step."""
    plan = cache.layers[0].plan
    if routed and plan.slots < routed:
        need = routed * sum(layer.plan.expert_size for layer in cache.layers)
        log.warning("expert offload: the cache holds %d experts per layer, fewer than the %d "
                    "each token routes to, so every step reads its experts from disk; "
                    "model.expert_cache_mb=%.1f or more keeps one token's experts resident",
                    plan.slots, routed, need / 1e6 + 0.1)


def expert_layers(model: Any) -> list[tuple[str, Any]]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


def expert_bytes(model: Any) -> int:
    """What the stacked experts of `model` take when fully loaded (lazily built: none read)."""
    return sum(n * size for n, size in map(_expert_shape, (m for _, m in expert_layers(model))))


def cache_bytes(model: Any, cache_mb: float) -> int:
    """The hot-expert cache model.expert_cache_mb gives `model`: whole experts per layer."""
    shapes = [_expert_shape(m) for _, m in expert_layers(model)]
    return sum(n * size for n, (_, size) in zip(_slots(shapes, int(cache_mb * 1e6)), shapes))


def _expert_shape(layer: Any) -> tuple[int, int]:
    """(experts, one expert's bytes as served) of a stacked expert layer."""
    from mlx.utils import tree_flatten
    linears = _switch_linears(layer)
    experts = linears[0][1].num_experts
    if not experts:   # offloaded already: it holds none
        return 0, 0
    return experts, sum(v.nbytes // experts for _, m in linears
                        for _, v in tree_flatten(m.parameters()))


def _slots(shapes: list[tuple[int, int]], capacity: int) -> list[int]:
    """Slots per layer: the capacity split evenly, whole experts, at least one, at most all."""
    per_layer = capacity // max(1, len(shapes))
    return [max(1, min(n, per_layer // size)) if size else 0 for n, size in shapes]


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
