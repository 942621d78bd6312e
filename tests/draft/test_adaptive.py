"""Adaptive draft length (pipeserve/draft/adaptive.py): a row's length follows its acceptance,
stays within draft.num_draft_tokens, pauses after drafts keep failing and probes again."""
from __future__ import annotations

from pipeserve.draft.adaptive import MISSES_TO_PAUSE, PAUSE_MAX_STEPS, PAUSE_MIN_STEPS, DraftLengths


def test_a_row_that_accepts_everything_drafts_the_full_length() -> None:
    lengths = DraftLengths(5)
    for _ in range(10):
        n = lengths.length("a")
        assert n == 5
        lengths.record("a", n, n)


def test_length_shrinks_with_acceptance_and_stays_bounded() -> None:
    lengths = DraftLengths(8)
    seen = []
    for _ in range(6):   # half the drafts kept each verify
        n = lengths.length("a")
        seen.append(n)
        lengths.record("a", n, n // 2)
    assert seen[0] == 8 and seen[-1] < 8
    assert all(1 <= n <= 8 for n in seen)


def test_failing_rows_pause_then_probe_with_doubling_pauses() -> None:
    lengths = DraftLengths(4)
    for _ in range(MISSES_TO_PAUSE):
        lengths.record("a", lengths.length("a"), 0)
    pause = [lengths.length("a") for _ in range(PAUSE_MIN_STEPS)]
    assert pause == [0] * PAUSE_MIN_STEPS
    assert lengths.drafts_next("a")
    probe = lengths.length("a")
    assert probe == 1   # a single-token probe after the pause
    lengths.record("a", probe, 0)   # it fails too: a longer pause
    assert [lengths.length("a") for _ in range(2 * PAUSE_MIN_STEPS)] == [0] * (2 * PAUSE_MIN_STEPS)
    assert lengths.length("a") == 1
    for _ in range(20):   # pauses stop doubling at the cap
        lengths.record("a", 1, 0)
        assert lengths.rows["a"].paused <= PAUSE_MAX_STEPS
        while lengths.length("a") == 0:
            pass
    lengths.record("a", 1, 1)   # a kept draft ends the pause regime
    assert lengths.rows["a"].misses == 0 and lengths.length("a") >= 1


def test_rows_are_independent_and_released() -> None:
    lengths = DraftLengths(3)
    for _ in range(MISSES_TO_PAUSE):
        lengths.record("bad", lengths.length("bad"), 0)
        lengths.record("good", lengths.length("good"), 3)
    assert lengths.length("bad") == 0 and lengths.length("good") == 3
    lengths.release("bad")
    assert "bad" not in lengths.rows and lengths.length("bad") == 3


def test_fixed_length_when_not_adaptive() -> None:
    lengths = DraftLengths(6, adaptive=False)
    for _ in range(10):
        lengths.record("a", 6, 0)
        assert lengths.length("a") == 6
