"""LoRA and DoRA adapters in mlx-lm's format (adapter_config.json + adapters.safetensors, as
`mlx_lm.lora` writes them), read only from model.adapter_dir and mounted into the model at
load through mlx-lm's own LoRA layers (ids.py: what an id may be). `mount` runs on the engine
thread."""
from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeserve.adapters.ids import NONE, STACK, check_id
from pipeserve.errors import ConfigError, InvalidRequest, NotFound

FILES = ("adapter_config.json", "adapters.safetensors")
LEAVES = ("lora_a", "lora_b", "m")          # the parameters a LoRA / DoRA layer adds
TYPES = ("lora", "dora")
_LAYER_PREFIX = re.compile(r"^(?:.*\.)?layers\.\d+\.")


@dataclass(frozen=True)
class Adapter:
    """A mounted adapter, as /v1/adapters, the prompt cache and the record name it."""

    id: str                           # its subdirectory name under model.adapter_dir
    path: Path
    digest: str                       # sha256 of both files' bytes (16 hex)
    fine_tune_type: str               # lora | dora
    rank: int
    scale: float
    num_layers: int                   # blocks adapted, counted from the last
    target_modules: tuple[str, ...]   # module keys within a block (self_attn.q_proj, ...)
    nbytes: int                       # bytes of its tensors

    @property
    def identity(self) -> str:
        return f"{self.id}@{self.digest}"

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "adapter", "fine_tune_type": self.fine_tune_type,
                "rank": self.rank, "scale": self.scale, "num_layers": self.num_layers,
                "target_modules": list(self.target_modules), "bytes": self.nbytes,
                "digest": self.digest}

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON data (an engine process publishes its adapters to the server's)."""
        return {**self.describe(), "path": str(self.path)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Adapter:
        return cls(id=d["id"], path=Path(d["path"]), digest=d["digest"],
                   fine_tune_type=d["fine_tune_type"], rank=d["rank"], scale=d["scale"],
                   num_layers=d["num_layers"], target_modules=tuple(d["target_modules"]),
                   nbytes=d["bytes"])


def resolve(adapter_dir: str, adapter_id: str) -> Path:
    """model.adapter_dir/<id>, refused when it resolves outside the directory (a symlink out),
    is not there, or lacks one of the two files."""
    check_id(adapter_id)
    root = Path(adapter_dir).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"model.adapter_dir '{adapter_dir}' is not a directory")
    path = (root / adapter_id).resolve()
    if path.parent != root:
        raise ConfigError(f"model.adapter '{adapter_id}' resolves to {path}, outside "
                          f"model.adapter_dir {root}; adapters are served only from there")
    if not path.is_dir():
        known = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ConfigError(f"model.adapter '{adapter_id}' is not in model.adapter_dir {root} "
                          f"(adapters there: {', '.join(known) or 'none'})")
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise ConfigError(f"model.adapter '{adapter_id}': {path} has no {' or '.join(missing)}; "
                          "an adapter directory is what `mlx_lm.lora --adapter-path` writes")
    return path


def _read_config(adapter_id: str, path: Path) -> dict[str, Any]:
    try:
        raw = json.loads((path / FILES[0]).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.adapter '{adapter_id}': {path / FILES[0]} is not JSON: {e}") from e
    kind = raw.get("fine_tune_type", "lora")
    if kind not in TYPES:
        raise ConfigError(f"model.adapter '{adapter_id}': fine_tune_type '{kind}' is not an "
                          f"adapter ({' or '.join(TYPES)}); a full fine-tune is a model: serve "
                          "it as model.path")
    params = raw.get("lora_parameters") or {}
    for key in ("rank", "scale"):
        if not isinstance(params.get(key), (int, float)):
            raise ConfigError(f"model.adapter '{adapter_id}': {FILES[0]} has no "
                              f"lora_parameters.{key}")
    if not isinstance(raw.get("num_layers"), int):
        raise ConfigError(f"model.adapter '{adapter_id}': {FILES[0]} has no num_layers")
    return raw


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in FILES:
        with (path / name).open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def mount(model: Any, adapter_dir: str, adapter_id: str) -> Adapter:
    """Convert the model's target layers with mlx-lm's `linear_to_lora_layers` and load the
    adapter's tensors into them (what `mlx_lm.load(..., adapter_path=)` does), after checking
    every tensor against the layer it lands in. Raises ConfigError naming the layer and shapes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    path = resolve(adapter_dir, adapter_id)
    raw = _read_config(adapter_id, path)
    params = {"dropout": 0.0, **raw["lora_parameters"]}
    try:
        weights = mx.load(str(path / FILES[1]))
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"model.adapter '{adapter_id}': cannot read {path / FILES[1]}: {e}") from e
    try:
        linear_to_lora_layers(model, raw["num_layers"], params,
                              use_dora=raw.get("fine_tune_type") == "dora")
    except (ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"model.adapter '{adapter_id}': mlx-lm cannot adapt this model's "
                          f"layers: {e}") from e
    slots = {k: v for k, v in tree_flatten(model.parameters())
             if k.rsplit(".", 1)[-1] in LEAVES}
    _check_tensors(adapter_id, weights, slots, int(params["rank"]))
    model.load_weights(list(weights.items()), strict=False)
    model.eval()   # the new layers' dropout off, as mlx_lm.load does
    targets = {_LAYER_PREFIX.sub("", k.rsplit(".", 1)[0]) for k in weights}
    return Adapter(id=adapter_id, path=path, digest=_digest(path),
                   fine_tune_type=raw.get("fine_tune_type", "lora"), rank=int(params["rank"]),
                   scale=float(params["scale"]), num_layers=raw["num_layers"],
                   target_modules=tuple(sorted(targets)),
                   nbytes=sum(v.nbytes for v in weights.values()))


def _check_tensors(adapter_id: str, weights: dict[str, Any], slots: dict[str, Any],
                   rank: int) -> None:
    """Every tensor has a layer of its shape, and every adapted layer gets its tensors (a
    missing B would leave mlx-lm's zero init: the adapter silently off)."""
    fix = "the adapter was trained for a different base model; train it on this one"
    for name, w in sorted(weights.items()):
        if name not in slots:
            raise ConfigError(f"model.adapter '{adapter_id}': layer {name} (shape "
                              f"{tuple(w.shape)}) is not in the base model; {fix}")
        want = tuple(slots[name].shape)
        if tuple(w.shape) == want:
            continue
        differ = [i for i, (a, b) in enumerate(zip(w.shape, want)) if a != b]
        if len(w.shape) == len(want) and all(want[i] == rank for i in differ):
            got = w.shape[differ[0]]
            raise ConfigError(
                f"model.adapter '{adapter_id}': rank mismatch at layer {name}: "
                f"adapter_config.json says rank {rank}, adapters.safetensors holds shape "
                f"{tuple(w.shape)} (rank {got}); the layer expects {want}")
        raise ConfigError(f"model.adapter '{adapter_id}': layer {name} has shape "
                          f"{tuple(w.shape)} in adapters.safetensors, the base model's layer "
                          f"expects {want}; {fix}")
    missing = sorted(set(slots) - set(weights))
    if missing:
        raise ConfigError(f"model.adapter '{adapter_id}': adapters.safetensors has no tensor "
                          f"for {len(missing)} adapted parameter(s), e.g. {missing[0]}; "
                          "adapter_config.json (num_layers, keys) does not match its tensors")


# -- several adapters in one batch (model.adapters) ----------------------------------------
MAX_STACK = 8   # adapters one request may stack


class AdapterSet:
    """The mounted adapters as slots (0: none, 1..n: model.adapters in launch order) and the
    slots of each row of the next model call (a row stacking adapters runs several: their
    deltas add up). The MultiLoRALinear layers share this one object;
    pipeserve/core/forward.py sets the rows (`rows`) right before each model call and the set goes
    back to every row on the launch default afterwards. `merged`: the single launch adapter
    lives in mlx-lm's own layers (DoRA), so no row can run without it."""

    def __init__(self, adapters: list[Adapter], default: str | None, merged: bool = False) -> None:
        self.adapters = {a.id: a for a in adapters}
        self.slots = {a.id: i + 1 for i, a in enumerate(adapters)}
        self.scales = [0.0] + [a.scale for a in adapters]
        self.ranks = [0] + [a.rank for a in adapters]
        self.default = default
        self.merged = merged
        self.default_slots = (self.slots[default],) if default is not None else ()
        self.uniform: tuple[int, ...] | None = self.default_slots   # every row's, or None
        self.indices: Any = None      # (B, m) int32 slots per row when mixed (0: padding)
        self.row_scales: Any = None   # (B, m) float32 their scales when mixed
        # unmounted over HTTP but still holding a slot (pipeserve/adapters/swap.py): id →
        # (adapter, monotonic time of its unmount); engine thread only
        self.retired: dict[str, tuple[Adapter, float]] = {}

    def renumber(self, order: list[Adapter]) -> None:
        """Engine thread (pipeserve/adapters/swap.py), between steps: slots 1..n are `order`
        now; `adapters` (what handlers read) is replaced whole, never changed in place."""
        self.slots = {a.id: i + 1 for i, a in enumerate(order)}
        self.scales = [0.0] + [a.scale for a in order]
        self.ranks = [0] + [a.rank for a in order]
        self.default_slots = (self.slots[self.default],) if self.default is not None else ()
        self.adapters = {a.id: a for a in order if a.id not in self.retired}
        self.reset()

    def snapshot(self) -> AdapterSet:
        """A copy for the HTTP side (EngineLimits.adapters): the mounted ids, the default and
        the retired as of now; the engine thread goes on changing this set, never the copy."""
        snap = copy.copy(self)
        snap.adapters, snap.slots, snap.retired = (dict(self.adapters), dict(self.slots),
                                                   dict(self.retired))
        snap.indices = snap.row_scales = None
        return snap

    def to_wire(self) -> dict[str, Any]:
        """A snapshot as plain JSON data, for the server process when the engine runs in its
        own (pipeserve/pool/codec.py): what the HTTP side reads of it (the mounted adapters,
        the default, `merged`, the retired that a running request may still name)."""
        return {"mounted": [a.to_wire() for a in self.adapters.values()],
                "default": self.default, "merged": self.merged,
                "retired": [a.to_wire() for a, _ in self.retired.values()]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> AdapterSet:
        """The server process's copy of an engine process's snapshot (no tensors, no slots
        it would use: requests are checked and recorded against it, never run)."""
        snap = cls([Adapter.from_wire(a) for a in d["mounted"]], d["default"], d["merged"])
        snap.retired = {a["id"]: (Adapter.from_wire(a), 0.0) for a in d["retired"]}
        return snap

    @property
    def ids(self) -> list[str]:
        return list(self.adapters)

    def name(self, choice: str | None) -> str | None:
        """The adapter (or stack, ids joined by '+') a request's rows run with (None: the base
        model); `choice` is Request.adapter (None: the launch default; "none": the base)."""
        if choice is None:
            return self.default
        return None if choice == NONE else choice

    def members(self, choice: str | None) -> tuple[str, ...]:
        """The ids a request's rows run with, in its order (empty: the base model)."""
        name = self.name(choice)
        return () if name is None else tuple(name.split(STACK))

    def slots_of(self, choice: str | None) -> tuple[int, ...]:
        return tuple(self.slots[m] for m in self.members(choice))

    def identity(self, choice: str | None) -> str | None:
        ids = self.members(choice)
        if not ids:
            return None
        adapters, retired = self.adapters, dict(self.retired)   # the engine may swap meanwhile

        def one(i: str) -> str:
            found = adapters.get(i) or (retired[i][0] if i in retired else None)
            return found.identity if found is not None else i   # unmounted and its slot gone
        return STACK.join(one(i) for i in ids)

    def canonical(self, choice: str | list[str] | None, param: str) -> str | None:
        """A request's choice as Request.adapter holds it: None when it is the launch default
        (so identical requests share prompt-cache entries), else the id, a stack's ids joined
        by '+', or "none". Raises NotFound naming the field, the value and the mounted ids."""
        if choice is None:
            return None
        if isinstance(choice, list):
            choice = self._stack(choice, param)
            if STACK in choice:
                return choice
        if choice != NONE and choice not in self.adapters:
            raise NotFound(f"{param} names adapter {choice!r}, which is not mounted; mounted: "
                           f"{', '.join(self.ids) or 'none'} (or 'none' for the base model)",
                           param=param, code="adapter_not_found")
        if self.merged and choice != self.default:
            raise NotFound(f"{param} is {choice!r}, but the launch adapter {self.default!r} is "
                           "a DoRA adapter merged into every row: no other adapter (nor "
                           "'none') can be served beside it", param=param,
                           code="adapter_not_found")
        return None if self.name(choice) == self.default else choice

    def _stack(self, ids: list[Any], param: str) -> str:
        """An `adapter` array: mounted LoRA ids, each once, at most MAX_STACK (one is that id)."""
        if not ids or len(ids) > MAX_STACK or not all(isinstance(i, str) for i in ids):
            raise InvalidRequest(f"{param} is an array of {len(ids)} item(s); a stack is 1 to "
                                 f"{MAX_STACK} mounted adapter ids (strings)", param=param)
        if NONE in ids or len(set(ids)) != len(ids):
            raise InvalidRequest(f"{param} {ids!r} repeats an id or holds 'none'; a stack names "
                                 "each mounted adapter at most once", param=param)
        if self.merged and len(ids) > 1:
            raise NotFound(f"{param} stacks {ids!r}, but the launch adapter {self.default!r} is "
                           "a DoRA adapter merged into every row: nothing can be stacked on "
                           "it", param=param, code="adapter_not_found")
        for i in ids:
            if i not in self.adapters or STACK in i:
                raise NotFound(f"{param} names adapter {i!r}, which is not mounted; mounted: "
                               f"{', '.join(self.ids) or 'none'}", param=param,
                               code="adapter_not_found")
        return STACK.join(ids)

    def select(self, rows: list[tuple[int, ...]]) -> None:
        """The slots of each row of the next model call, in batch order."""
        import mlx.core as mx

        if len(set(rows)) == 1:
            self.uniform, self.indices, self.row_scales = rows[0], None, None
            return
        self.uniform = None
        width = max(1, max(len(r) for r in rows))
        padded = [list(r) + [0] * (width - len(r)) for r in rows]   # slot 0: zeros, scale 0
        self.indices = mx.array(padded, dtype=mx.int32)
        self.row_scales = mx.array([[self.scales[s] for s in r] for r in padded],
                                   dtype=mx.float32)

    def reset(self) -> None:
        self.uniform, self.indices, self.row_scales = self.default_slots, None, None

    @staticmethod
    def of(model: Any) -> AdapterSet:
        """The set a model's MultiLoRALinear layers share; a model without any gets an empty
        one (no adapter, every row on slot 0), kept on the model so that adapters mounted
        over HTTP later (pipeserve/adapters/swap.py) join the set its Forward already holds."""
        for _, m in model.named_modules():
            if isinstance(m, MultiLoRALinear):
                return m.adapters
        empty = getattr(model, "_pipeserve_adapters", None)
        if empty is None:
            empty = AdapterSet([], None)
            object.__setattr__(model, "_pipeserve_adapters", empty)
        return empty


def _module_base() -> Any:
    import mlx.nn as nn
    return nn.Module


class MultiLoRALinear(_module_base()):   # type: ignore[misc]
    """A base Linear (quantized or not) with every mounted adapter's A (n+1, in, r_max) and
    B (n+1, r_max, out), zero-padded to the largest rank; slot 0 and adapters that do not
    adapt this layer are zeros. The base matmul is shared; each row adds
    scale[row] * (x @ A[slot[row]]) @ B[slot[row]] (S-LoRA/Punica-style gather). When every
    row has one slot, that slot's own rank-r matrices are used, as mlx-lm's LoRALinear does."""

    def __init__(self, linear: Any, lora_a: Any, lora_b: Any, covers: frozenset[int],
                 adapters: AdapterSet) -> None:
        super().__init__()
        self.linear = linear
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.covers = covers   # slots whose adapter adapts this layer (a frozenset: no param)
        self.adapters = adapters

    def __call__(self, x: Any) -> Any:
        y = self.linear(x)
        sel = self.adapters
        uniform = sel.uniform
        if uniform is not None:   # every row runs these slots: their own rank-r matrices
            for k in uniform:
                if k in self.covers:
                    r = sel.ranks[k]
                    z = (x @ self.lora_a[k][:, :r]) @ self.lora_b[k][:r]
                    y = y + (sel.scales[k] * z).astype(x.dtype)
            return y
        for j in range(sel.indices.shape[1]):   # a stack's j-th adapter of every row
            idx = sel.indices[:, j]
            a, b = self.lora_a[idx], self.lora_b[idx]   # (B, in, r_max), (B, r_max, out)
            s = sel.row_scales[:, j]
            if x.ndim == 2:
                z = ((x[:, None] @ a) @ b)[:, 0]
                s = s[:, None]
            else:
                z = (x @ a) @ b
                s = s[:, None, None]
            y = y + (s.astype(z.dtype) * z).astype(x.dtype)
        return y


def _read(adapter_dir: str, adapter_id: str) -> tuple[Path, dict[str, Any]]:
    path = resolve(adapter_dir, adapter_id)
    return path, _read_config(adapter_id, path)


def mount_all(model: Any, adapter_dir: str, ids: list[str],
              default: str | None) -> tuple[Adapter | None, AdapterSet]:
    """Mount every adapter in `ids` (model.adapters, with model.adapter). A single DoRA
    adapter goes through mlx-lm's own layers (`mount`: every row runs with it); otherwise
    every adapter must be LoRA on Linear layers and they are served side by side by
    MultiLoRALinear layers, one set of slots shared by all of them."""
    configs = {i: _read(adapter_dir, i) for i in ids}
    dora = [i for i, (_, raw) in configs.items() if raw.get("fine_tune_type") == "dora"]
    if dora and len(ids) > 1:
        raise ConfigError(
            f"model.adapters: {', '.join(dora)} is a DoRA adapter; DoRA can be mounted only "
            "alone (model.adapter=<id> without model.adapters): rows of a DoRA adapter cannot "
            "share a batch with other adapters' rows (its magnitude rescales the base output)")
    if dora:
        adapter = mount(model, adapter_dir, ids[0])
        return adapter, AdapterSet([adapter], adapter.id, merged=True)
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    mounted: list[Adapter] = []
    per_layer: dict[str, dict[int, tuple[Any, Any]]] = {}
    for slot, adapter_id in enumerate(ids, start=1):
        adapter, weights = _convert_and_revert(model, adapter_dir, adapter_id)
        mounted.append(adapter)
        for name, w in weights.items():
            layer, leaf = name.rsplit(".", 1)
            pair = per_layer.setdefault(layer, {}).get(slot, (None, None))
            per_layer[layer][slot] = (w, pair[1]) if leaf == "lora_a" else (pair[0], w)
    shared = AdapterSet(mounted, default)
    modules = dict(model.named_modules())
    new = []
    for layer, slots in per_layer.items():
        some_a, some_b = next(iter(slots.values()))
        n_in, n_out = some_a.shape[0], some_b.shape[1]
        r_max = max(a.shape[1] for a, _ in slots.values())
        dtype = some_a.dtype
        a_rows, b_rows = [mx.zeros((n_in, r_max), dtype)], [mx.zeros((r_max, n_out), dtype)]
        for s in range(1, len(ids) + 1):
            if s in slots:
                a, b = slots[s]
                r = a.shape[1]
                a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, r_max - r)]))
                b_rows.append(mx.pad(b.astype(dtype), [(0, r_max - r), (0, 0)]))
            else:
                a_rows.append(a_rows[0])
                b_rows.append(b_rows[0])
        new.append((layer, MultiLoRALinear(modules[layer], mx.stack(a_rows), mx.stack(b_rows),
                                           frozenset(slots), shared)))
    model.update_modules(tree_unflatten(new))
    model.eval()
    return (shared.adapters[default] if default is not None else None), shared


def _convert_and_revert(model: Any, adapter_dir: str,
                        adapter_id: str) -> tuple[Adapter, dict[str, Any]]:
    """Check one LoRA adapter against the model as `mount` does (mlx-lm converts the layers,
    every tensor must fit the layer it lands in), then put the base layers back; returns the
    adapter and its tensors."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    before = dict(model.named_modules())
    adapter = mount(model, adapter_dir, adapter_id)
    import mlx.core as mx
    weights = mx.load(str(adapter.path / FILES[1]))
    converted = [(k, m) for k, m in model.named_modules()
                 if k in before and m is not before[k] and not isinstance(before[k], type(m))]
    back = []
    for k, m in converted:
        if not isinstance(m, nn.Module) or not hasattr(m, "lora_a"):
            continue
        if type(m) is not LoRALinear:
            model.update_modules(tree_unflatten(
                [(k, getattr(m, "linear", getattr(m, "embedding", None)))]))
            raise ConfigError(
                f"model.adapters: adapter '{adapter_id}' adapts {k}, a {type(m).__name__}; "
                "only Linear layers can be served beside other adapters (mount it alone as "
                "model.adapter)")
        back.append((k, m.linear))
    model.update_modules(tree_unflatten(back))
    left = [k for k, _ in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in LEAVES]
    assert not left, left
    return adapter, dict(weights)
