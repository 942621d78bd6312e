"""Where the engine thread's time went, from a `py-spy record --native --idle --threads -f raw`
profile of a server: waiting to take the GIL back (PyEval_RestoreThread / take_gil under it),
inside MLX's calls with the GIL released (async_eval, eval, reads), or running Python. The
engine thread's samples are those with the engine loop (pipeserve/core/engine.py) in their
stack. A thread core beside a busy event loop shows its lost time in the first row.

    py-spy record --native --idle --threads -r 200 -d 15 -f raw -o engine.raw -p <server pid>
    python scripts/gil_waits.py engine.raw

--holders, for a profile recorded with `--gil` (each sample is the thread that held the GIL):
each thread's share of the holding, and where it held it (the innermost Python frame, and the
innermost native call below it when there is one: a CUDA call made with the GIL held shows).

    py-spy record --gil --native --threads -r 500 -d 15 -f raw -o gil.raw -p <server pid>
    python scripts/gil_waits.py --holders gil.raw
"""
from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator

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


def samples(path: str) -> Iterator[tuple[list[str], int]]:
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if stack and n.isdigit():
            yield stack.split(";"), int(n)


def where(frames: list[str]) -> str:
    """The innermost Python frame, and the innermost native call under it outside the
    interpreter (an MLX or CUDA call made holding the GIL)."""
    py = [i for i, f in enumerate(frames) if ".py:" in f]
    if not py:
        return frames[-1]
    native = [f.split(" (")[0] for f in frames[py[-1] + 1:]
              if not f.startswith("0x") and "libpython" not in f and ".cpython-" not in f
              and not f.startswith(("_Py", "Py", "method_vectorcall", "cfunction_"))]
    return frames[py[-1]] + (f" > {native[-1]}" if native else "")


def holders(path: str, top: int) -> None:
    by_thread: Counter[str] = Counter()
    spots: dict[str, Counter[str]] = {}
    for frames, n in samples(path):
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else frames[0]
        by_thread[thread] += n
        spots.setdefault(thread, Counter())[where(frames)] += n
    total = sum(by_thread.values())
    print(f"GIL held: {total} samples")
    for thread, n in by_thread.most_common():
        print(f"| {thread} | {n} | {100 * n / max(total, 1):.1f}% |")
        for spot, k in spots[thread].most_common(top):
            print(f"|   {spot} | {k} | {100 * k / max(total, 1):.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy's raw (collapsed stacks) output")
    ap.add_argument("--holders", action="store_true",
                    help="a --gil profile: who held the GIL, and where")
    ap.add_argument("--top", type=int, default=12, help="--holders: places a thread")
    args = ap.parse_args()
    if args.holders:
        holders(args.raw, args.top)
        return
    counts: Counter[str] = Counter()
    for frames, n in samples(args.raw):
        if not any("pipeserve/core/engine.py" in f for f in frames):
            continue
        counts[kind(frames)] += n
    total = sum(counts.values())
    print(f"engine thread: {total} samples")
    for name, n in counts.most_common():
        print(f"| {name} | {n} | {100 * n / max(total, 1):.1f}% |")


if __name__ == "__main__":
    main()
