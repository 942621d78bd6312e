"""Where the engine thread's time went, from a `py-spy record --native --idle --threads -f raw`
profile of a server: waiting to take the GIL back (PyEval_RestoreThread / take_gil under it),
inside MLX's calls with the GIL released (async_eval, eval, reads), or running Python. The
engine thread's samples are those with the engine loop (pipeserve/core/engine.py) in their
stack. A thread core beside a busy event loop shows its lost time in the first row.

    py-spy record --native --idle --threads -r 200 -d 15 -f raw -o engine.raw -p <server pid>
    python scripts/gil_waits.py engine.raw
"""
from __future__ import annotations

import argparse
from collections import Counter

IDLE = ("take_commands", "SimpleQueue.get", "Queue.get", "Condition.wait")
MLX = (("MLX async_eval", ("async_eval",)),
       ("MLX eval / read back", ("mlx::core::eval", "eval_impl", "tolist", "array::item",
                                 "synchronize")))


def waits_for_gil(frames: list[str]) -> bool:
    """Taking the GIL back: take_gil's timed wait on its condition, right under a C
    extension's call (nanobind's GIL release ending) or CPython's own restore; MLX's own waits
    are untimed and sit under mlx:: frames."""
    if any("take_gil" in f or "PyEval_RestoreThread" in f for f in frames):
        return True
    known = [f for f in frames if not f.startswith("0x") or ".cpython-" in f]
    for i, f in enumerate(known):
        if f.startswith("pthread_cond_timedwait") and i and ".cpython-" in known[i - 1]:
            return True
    return False


def kind(frames: list[str]) -> str:
    text = ";".join(frames)
    if any(m in text for m in IDLE):
        return "waiting for a command (idle engine)"
    if waits_for_gil(frames):
        return "waiting for the GIL"
    for name, marks in MLX:
        if any(m in text for m in marks):
            return name
    return "Python (holding the GIL)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy's raw (collapsed stacks) output")
    args = ap.parse_args()
    counts: Counter[str] = Counter()
    for line in open(args.raw, encoding="utf-8", errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if not any("pipeserve/core/engine.py" in f for f in frames):
            continue
        counts[kind(frames)] += int(n)
    total = sum(counts.values())
    print(f"engine thread: {total} samples")
    for name, n in counts.most_common():
        print(f"| {name} | {n} | {100 * n / max(total, 1):.1f}% |")


if __name__ == "__main__":
    main()
