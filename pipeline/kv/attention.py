"""Attention dispatch for KV layouts whose attention is not the stock one.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)`, imported by name into each model module. `install()` rebinds that name in
every loaded mlx-lm model module to `dispatch`, which hands the call to the cache when it has an
`attend` method (TurboQuant, mixed-bit, delayed conversion) and to mlx-lm otherwise, so dense,
q4/q8 and recurrent layers keep mlx-lm's exact arithmetic. Engine thread, at load."""
from __future__ import annotations

import sys
from typing import Any

from mlx_lm.models import base

_stock = base.scaled_dot_product_attention


def dispatch(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
             sinks: Any = None) -> Any:
    attend = getattr(cache, "attend", None)
    if attend is not None:
        if sinks is not None:
            raise ValueError(f"{type(cache).__name__} does not support attention sinks")
        return attend(queries, keys, values, scale=scale, mask=mask)
    return _stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model: Any = None) -> int:
    """Route attention through `dispatch` in every imported mlx-lm model module (and the
    module of `model`, if given). Returns how many modules were patched; idempotent."""
    names = [n for n in list(sys.modules) if n.startswith("mlx_lm.models.")]
    if model is not None:
        names.append(type(model).__module__)
    patched = 0
    for name in names:
        module = sys.modules.get(name)
        if module is None or module is base:
            continue
        if getattr(module, "scaled_dot_product_attention", None) is _stock:
            module.scaled_dot_product_attention = dispatch
            patched += 1
    return patched
