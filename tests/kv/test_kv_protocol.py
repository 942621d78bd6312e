"""The cache protocol the prompt cache relies on (mlx-lm's `state` / `from_state`): every KV
layout's caches, per row and batched, rebuild from their state with their settings, a lent copy
continues exactly as its donor would while the donor stays intact, per-row caches survive the
SSD codec, and the layout carries its conversion callback to the caches it makes and adopts."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipeserve  # noqa: F401  (loads OpenBLAS first)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from pipeserve.kv import attention
from pipeserve.kv.delayed import DelayedBatchKVCache, DelayedKVCache
from pipeserve.kv.layouts import build_layout
from pipeserve.kv.paged import BlockPool, PagedKVCache
from pipeserve.kv.quantized import AffineKVCache
from pipeserve.kv.turbo import TurboKVCache
from pipeserve.prompt_cache import codec
from pipeserve.prompt_cache.ram import lend
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import make_config

HEADS, DIM = 2, 64


def kv(rows: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((rows, HEADS, n, DIM), dtype=np.float32))
                 for _ in range(2))


def filled(cache: Any, n: int, seed: int = 0) -> Any:
    cache.update_and_fetch(*kv(1, n, seed))
    return cache


def delayed(start: int) -> DelayedKVCache:
    return DelayedKVCache(start, AffineKVCache, k_bits=8, v_bits=4, group_size=64)


def paged_rows(*lengths: int) -> list[PagedKVCache]:
    pool = BlockPool(16, 64)
    return [filled(PagedKVCache(pool), n, seed=n) for n in lengths]


# name -> (a maker of one cache holding some tokens, deterministically; rows it holds)
LAYOUTS: dict[str, tuple[Callable[[], Any], int]] = {
    "dense": (lambda: filled(KVCache(), 7), 1),
    "affine": (lambda: filled(AffineKVCache(8, 4, 64), 7), 1),
    "turbo": (lambda: filled(TurboKVCache(k_bits=4, v_bits=3), 7), 1),
    "delayed-dense": (lambda: filled(delayed(100), 7), 1),
    "delayed-converted": (lambda: filled(delayed(5), 7), 1),
    "paged": (lambda: paged_rows(21)[0], 1),
    "affine-batch": (lambda: AffineKVCache.merge(
        [filled(AffineKVCache(8, 4, 64), n, n) for n in (7, 3)]), 2),
    "turbo-batch": (lambda: TurboKVCache.merge(
        [filled(TurboKVCache(k_bits=4, v_bits=3), n, n) for n in (7, 3)]), 2),
    "delayed-batch": (lambda: DelayedKVCache.merge(
        [filled(delayed(5), n, n) for n in (7, 3)]), 2),
    "paged-batch": (lambda: PagedKVCache.merge(paged_rows(21, 9)), 2),
}


def leaves(tree: Any) -> list[Any]:
    """Arrays as numpy, block tables as their ids, the rest as it is, in order."""
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in leaves(t)]
    if isinstance(tree, mx.array):
        return [np.array(tree)]
    if hasattr(tree, "ids"):
        return [("blocks", list(tree.ids))]
    return [tree]


def same(a: Any, b: Any) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and np.array_equal(x, y)
        or not isinstance(x, np.ndarray) and x == y for x, y in zip(la, lb))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_lent_copy_round_trips_and_leaves_its_donor_intact(name: str) -> None:
    make, rows = LAYOUTS[name]
    donor, twin = make(), make()
    lent = lend(donor)
    assert type(lent) is type(donor)
    assert same(lent.state, donor.state)   # arrays, settings (bits, group, start), block tables
    assert same(type(donor).from_state(donor.state).state, donor.state)

    lent.update_and_fetch(*kv(rows, 2, seed=9))          # the borrower writes something else
    step = kv(rows, 1, seed=10)
    assert same(donor.update_and_fetch(*step), twin.update_and_fetch(*step))   # donor intact
    fresh = make()
    assert same(lend(fresh).update_and_fetch(*step), make().update_and_fetch(*step))


@pytest.mark.parametrize("name", [n for n, (_, rows) in LAYOUTS.items()
                                  if rows == 1 and n != "paged"])
def test_per_row_caches_survive_the_codec(name: str) -> None:
    make, _ = LAYOUTS[name]
    cache = make()
    _, (restored,) = codec.decode(codec.encode(list(range(cache.offset)), [cache]), verify=True)
    assert type(restored) is type(cache) and restored.offset == cache.offset
    step = kv(1, 3, seed=11)
    assert same(restored.update_and_fetch(*step), make().update_and_fetch(*step))


def test_delayed_state_keeps_the_conversion_settings() -> None:
    row = filled(delayed(5), 7)
    back = DelayedKVCache.from_state(lend(row).state)
    assert (back.quantized_start, back.target_params, back.converted_at) == (
        5, (("group_size", 64), ("k_bits", 8), ("v_bits", 4)), 7)
    assert type(back.inner) is AffineKVCache and back.inner.v_bits == 4
    batch = DelayedKVCache.merge([row, filled(delayed(5), 3)])
    again = DelayedBatchKVCache.from_state(batch.state)
    assert again.converted_at == [7, None] and again.lengths == [7, 3]
    assert again.dense is not None and again.target is not None


def test_the_layout_carries_on_convert_to_the_caches_it_makes_and_adopts(
        tmp_path: Path) -> None:
    model, _ = load(str(ensure_model("qwen3", "small", "float32", tmp_path)))
    attention.install(model)
    seen: list[float] = []
    layout = build_layout(make_config("model=tiny", "model.size=small", "kv=q8",
                                      "kv.quantized_start=8").kv, model, on_convert=seen.append)
    row = layout.make_cache(model)
    model(mx.array([list(range(3, 13))]), cache=row)      # 10 tokens >= 8: the row converts
    assert sum(seen) == pytest.approx(1)
    dense = layout.make_cache(model)
    model(mx.array([list(range(3, 8))]), cache=dense)     # 5 tokens: dense
    lent = [lend(c) for c in dense]                        # a prompt-cache hit's copies
    model(mx.array([list(range(8, 13))]), cache=layout.adopt(lent))
    assert sum(seen) == pytest.approx(2)
