"""Does the CPU a decode loop runs on change its speed? On a GPU a one-stream step is bound by
the host (building the graph, launching its kernels), so a slower core, a core far from the
GPU (another NUMA node) or a core whose SMT sibling is busy shows as tokens a second.

Prints the machine's NUMA nodes, each node's CPUs, the GPU's local CPUs (sysfs), then, per CPU
set, mlx-lm's bare generate_step loop pinned there (os.sched_setaffinity before MLX loads),
alone and beside a busy Python thread on the same core's SMT sibling. One JSON line each.

    python scripts/placement_probe.py --size medium --tokens 256 --reps 3
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOOP = r"""
import json, os, sys, threading, time
cpus, sibling, path, n, reps = (json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3],
                                int(sys.argv[4]), int(sys.argv[5]))
os.sched_setaffinity(0, cpus)            # this thread, and every thread MLX starts after
if sibling is not None:                  # a thread that only runs Python, on the sibling
    def spin():
        os.sched_setaffinity(0, [sibling])
        x = 0
        while True:
            x += 1
    threading.Thread(target=spin, daemon=True).start()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tok = load(path)
ids = mx.array(tok.encode("The placement of a thread on a core"))
for _ in generate_step(ids, model, max_tokens=16):
    pass
rates = []
for _ in range(reps):
    stamps = [time.perf_counter() for _ in generate_step(ids, model, max_tokens=n)]
    rates.append(round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 1))
print(json.dumps({"tok_s": rates}))
"""


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def gpu_local_cpus() -> list[tuple[str, int, list[int]]]:
    """(PCI address, NUMA node, local CPUs) of each NVIDIA display/3D controller."""
    found = []
    for dev in sorted(glob.glob("/sys/bus/pci/devices/*")):
        if read(f"{dev}/vendor") == "0x10de" and read(f"{dev}/class")[:6] in ("0x0300", "0x0302"):
            found.append((os.path.basename(dev), int(read(f"{dev}/numa_node") or -1),
                          cpulist(read(f"{dev}/local_cpulist"))))
    return found


def sibling_of(cpu: int) -> int | None:
    sibs = cpulist(read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
    others = [c for c in sibs if c != cpu]
    return others[0] if others else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", help="the generated qwen3 shape (model=tiny)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pipeserve.model.tiny.text import ensure_model
    path = ensure_model(size=args.size, dtype=args.dtype, cache_dir=args.cache_dir)

    nodes = {int(Path(p).name[4:]): cpulist(read(f"{p}/cpulist"))
             for p in sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))}
    allowed = sorted(os.sched_getaffinity(0))
    gpus = gpu_local_cpus()
    print(json.dumps({"what": "topology", "cpus": allowed, "numa_nodes": nodes,
                      "gpus": [{"pci": p, "numa_node": n, "local_cpus": c} for p, n, c in gpus],
                      "siblings": {c: sibling_of(c) for c in allowed}}), flush=True)
    sets: list[tuple[str, list[int]]] = [("all", allowed)]
    for node, cpus in nodes.items():
        mine = [c for c in cpus if c in allowed]
        if mine and len(nodes) > 1:
            sets.append((f"node {node}", mine))
    first, last = allowed[0], allowed[-1]
    sets += [(f"cpu {first}", [first]), (f"cpu {last}", [last])]
    for label, cpus in sets:
        runs = [("alone", None)]
        if len(cpus) == 1 and (sib := sibling_of(cpus[0])) is not None and sib in allowed:
            runs.append((f"busy sibling {sib}", sib))
        for how, sib in runs:
            proc = subprocess.run([sys.executable, "-c", LOOP, json.dumps(cpus), json.dumps(sib),
                                   str(path), str(args.tokens), str(args.reps)],
                                  capture_output=True, text=True, timeout=300)
            line = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
            try:
                rates = json.loads(line[0])["tok_s"]
            except (ValueError, KeyError):
                rates = line[0]
            print(json.dumps({"what": "bare loop", "cpus": label, "beside": how,
                              "tok_s": rates}), flush=True)


if __name__ == "__main__":
    main()
