"""A plain batched layer's left padding is kept on the host beside its array
(pipeserve/kv/padded.py): reading the array back waits for every step queued on the device.
The host copy must follow every change the engine makes to a layer's padding, and a read of it
must never be stale."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from pipeserve.core.rows import (batch_kv, extend_layer, filter_layers, host_padding,
                                 merge_layer, pad_left, pad_right, trim_rows)
from pipeserve.kv import padded
from pipeserve.kv.padded import finalize, noted_padding


def kv(rows: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((rows, 2, n, 8), key=mx.random.key(seed))
    return k, k + 1


def current(c: BatchKVCache) -> list[int]:
    known = noted_padding(c)
    assert known is not None, "the change left no note: the next read would wait for the device"
    assert known == c.left_padding.tolist()
    return known


def test_notes_hold_with_this_mlx_lm() -> None:
    # another mlx-lm's BatchKVCache may change a padding in place: then no notes are kept (every
    # read goes to the device) until this module is checked against its source
    assert padded.NOTES


def test_the_noted_padding_follows_every_change_the_engine_makes() -> None:
    # a prefill group right-padded (prompts of 5 and 3 tokens), rolled left after its forward
    group = batch_kv([0, 0], {})
    assert current(group) == [0, 0]
    pad_right([group], [5, 3], [0, 2], {})
    group.update_and_fetch(*kv(2, 5, 1))
    finalize(group)
    assert current(group) == [0, 2]
    # a left-padded group (a cold group of two lengths)
    other = batch_kv([0, 0], {})
    pad_left([other], [1, 0], {})
    assert current(other) == [1, 0]
    other.update_and_fetch(*kv(2, 7, 2))
    # joining: both right-justified at the longer write position
    extend_layer(group, other)
    assert current(group) == [2, 4, 1, 0]
    # rows leaving: the padding they all share is cut
    left = filter_layers([group], [0, 1], mx.array([0, 1], dtype=mx.int32))
    assert current(group) == [0, 2] == left[0]
    # a verify step's rollback: rows dropping different numbers of drafts
    group.update_and_fetch(*kv(2, 3, 3))
    trim_rows([group], [1, 3])
    assert current(group) == [0, 4]   # one drop for both; the second row's other two rolled
    assert host_padding([group]) == [[0, 4]]
    # a lone row's caches becoming a batch (mlx-lm's merge), and an empty row beside one
    one = KVCache()
    one.update_and_fetch(*kv(1, 4, 4))
    assert current(merge_layer([one])) == [0]
    assert current(merge_layer([one, KVCache()])) == [0, 4]


def test_a_noted_padding_is_read_without_the_device_and_checked_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = batch_kv([3, 0], {})
    monkeypatch.setattr(padded, "CHECK_PADDING", False)
    assert host_padding([c])[0] is noted_padding(c)   # the host copy itself: no read
    c.left_padding = c.left_padding + 1   # a new array: the note no longer applies
    assert noted_padding(c) is None and host_padding([c]) == [[4, 1]]
    assert noted_padding(c) == [4, 1]   # the read is noted
    c.left_padding += 1   # in place, as mlx-lm's prepare(left_padding) and finalize do
    monkeypatch.setattr(padded, "CHECK_PADDING", True)
    with pytest.raises(AssertionError, match="noted left padding"):
        host_padding([c])


def test_a_right_padding_set_without_its_note_leaves_the_roll_unnoted() -> None:
    c = batch_kv([0, 0], {})
    pad_right([c], [3, 1], [0, 2], {})   # noted, then replaced by mlx-lm's own (no note)
    c.prepare(right_padding=[1, 0])
    c.update_and_fetch(*kv(2, 3, 5))
    finalize(c)
    assert noted_padding(c) is None   # read from the device next time, never guessed
    assert host_padding([c]) == [[1, 0]]

