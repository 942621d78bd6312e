"""Hidden-state taps on a loaded mlx-lm model: the residual stream entering (draft=eagle3) or
leaving (draft=dflash) chosen decoder layers, recorded only while the taps are active. A tapped layer
keeps its parameters and names (only its class is swapped for a subclass that records its
input), so adapters, the prompt cache's fingerprint and weight accounting see the same model.
Engine thread."""
from __future__ import annotations

from typing import Any

import mlx.core as mx

from pipeserve.errors import ConfigError
from pipeserve.model.config import ModelSource

ATTR = "_pipeserve_taps"


class Taps:
    """What the tapped layers saw during one `capture` (in layer order)."""

    def __init__(self, layer_ids: list[int], outputs: bool) -> None:
        self.layer_ids = layer_ids
        self.outputs = outputs   # record what the layers return (else what they are given)
        self.active = False
        self.seen: dict[int, mx.array] = {}

    def fused(self) -> mx.array:
        """(B, L, len(layer_ids)·H): the taps side by side, in `layer_ids` order."""
        return mx.concatenate([self.seen[i] for i in self.layer_ids], axis=-1)


def _tapped(cls: type, taps: Taps, index: int) -> type:
    def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, x, *args, **kwargs)
        if taps.active:   # (Gemma 4's layers return (hidden, shared K/V, offset))
            taps.seen[index] = (out[0] if isinstance(out, tuple) else out) if taps.outputs else x
        return out
    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})


def install_taps(model: Any, layer_ids: list[int], outputs: bool = False) -> Taps:
    """Tap the inputs (or `outputs`) of `layer_ids` of the model's decoder (`model.model.layers`,
    or its `language_model`'s); the model then carries the taps (`taps_of`)."""
    layers = getattr(model, "language_model", model).model.layers
    taps = Taps(list(layer_ids), outputs)
    for i in sorted(set(layer_ids)):
        layer = layers[i]
        layer.__class__ = _tapped(type(layer), taps, i)
    object.__setattr__(model, ATTR, taps)   # (not a child module: no parameters)
    return taps


def taps_of(model: Any) -> Taps | None:
    return getattr(model, ATTR, None)


def load_head(cfg: Any, ctx: Any, what: str, ensure: Any, load: Any) -> Any:
    """A hidden-state drafter (draft=eagle3, draft=dflash) from draft.path, or, for a
    generated target with none, the checkpoint `ensure(target_dir)` writes beside it; bound
    to the target model by `load(path, model)`. Launch errors name the option and the path."""
    name, path = cfg.draft.name, cfg.draft.path
    if path is None:
        if cfg.model.path is not None or cfg.model.source is not ModelSource.generated:
            raise ConfigError(f"draft={name} needs draft.path: the {what} checkpoint "
                              f"directory trained for the served model ({ctx.loaded.path})")
        path = str(ensure(ctx.loaded.path))
    try:
        return path, load(path, ctx.model)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"draft={name} draft.path={path}: {e}") from e
