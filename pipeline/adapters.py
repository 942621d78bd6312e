"""LoRA and DoRA adapters in mlx-lm's format (adapter_config.json + adapters.safetensors, as
`mlx_lm.lora` writes them), read only from model.adapter_dir and mounted into the model at
load through mlx-lm's own LoRA layers. `check_id` runs anywhere; `mount` on the engine thread."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

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


def check_id(adapter_id: str) -> None:
    """An id names one subdirectory of model.adapter_dir, nothing else."""
    if (not adapter_id or adapter_id in (".", "..") or ".." in adapter_id
            or any(c in adapter_id for c in "/\\\0")):
        raise ConfigError(
            f"model.adapter '{adapter_id}' is not an adapter id: an id is the name of one "
            "subdirectory of model.adapter_dir, without '/', '\\' or '..'")


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
