"""roll_rows / finalize (pipeserve/kv/padded.py): the padding of a right-padded forward rolled
to each row's left edge with one gather of whole vectors, the same values as mlx-lm's
element-by-element dynamic_roll and BatchKVCache.finalize. Pure MLX, no model."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, dynamic_roll

from pipeserve.kv.padded import finalize, roll_rows


def test_roll_rows_matches_dynamic_roll() -> None:
    shifts = mx.array([0, 3, 7, 1, 5], dtype=mx.int32)
    keys = mx.random.normal((5, 2, 11, 8))
    packed = mx.random.randint(0, 2**31, (5, 2, 11, 3)).astype(mx.uint32)   # a quantized part
    got = roll_rows([keys, packed], shifts)
    for x, y in zip([keys, packed], got):
        want = dynamic_roll(x, shifts[:, None], axis=2)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert mx.array_equal(y, want)
    # row 1 moved right by 3: its first position now holds what was its last-but-two
    assert mx.array_equal(got[0][1, :, 3], keys[1, :, 0])


def _finalized_both(batch: Callable[[], Any]) -> tuple[Any, Any]:
    """Two like batches, one finalized here and one by mlx-lm: the same state, every row's
    padding (2, 0, 4) now on its left."""
    ours, stock = batch(), batch()
    finalize(ours)
    stock.finalize()
    for name in ("keys", "values", "offset", "left_padding"):
        assert mx.array_equal(getattr(ours, name), getattr(stock, name)), name
    assert ours.left_padding.tolist() == [2, 0, 4]
    return ours, stock


def test_finalize_of_a_right_padded_batch_matches_mlx_lm() -> None:
    def batch() -> BatchKVCache:
        c = BatchKVCache([0, 0, 0])
        mx.random.seed(3)
        c.prepare(lengths=[4, 6, 2], right_padding=[2, 0, 4])
        c.update_and_fetch(mx.random.normal((3, 2, 6, 8)), mx.random.normal((3, 2, 6, 4)))
        return c
    ours, stock = _finalized_both(batch)
    assert ours._right_padding is None
    finalize(ours)   # nothing pending: unchanged
    assert mx.array_equal(ours.keys, stock.keys)


@pytest.mark.parametrize("width", [6, 20])   # within the window, and past it
def test_finalize_of_a_right_padded_sliding_window_batch_matches_mlx_lm(width: int) -> None:
    def batch() -> BatchRotatingKVCache:
        c = BatchRotatingKVCache(max_size=16, left_padding=[0, 0, 0])
        mx.random.seed(4)
        lengths = [width - 2, width, width - 4]
        c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
        c.update_and_fetch(mx.random.normal((3, 2, width, 8)), mx.random.normal((3, 2, width, 8)))
        return c
    ours, stock = _finalized_both(batch)
    assert ours._lengths is None
    # the next token lands and masks alike
    for c in (ours, stock):
        c.update_and_fetch(mx.ones((3, 2, 1, 8)), mx.ones((3, 2, 1, 8)))
    assert mx.array_equal(ours.keys, stock.keys)
    assert mx.array_equal(ours.make_mask(1), stock.make_mask(1))


def test_roll_probe_script_compares_both_rolls() -> None:
    """scripts/roll_probe.py (the measurement behind roll_rows) runs and finds the same arrays."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "roll_probe.py"), "--rows", "3",
                          "--heads", "2", "--positions", "24", "--dim", "8", "--layers", "2",
                          "--reps", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["method"] for r in lines if "method" in r} == {"mlx-lm dynamic_roll",
                                                             "pipeserve roll_rows"}
    assert all(r["total_ms"] > 0 and r["tensors"] == 4 for r in lines if "method" in r)
    assert lines[-1] == {"same": True}
