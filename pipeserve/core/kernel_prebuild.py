"""Kernels built in parallel before the kernel warm-up (CUDA only).

MLX's CUDA backend compiles a kernel module with NVRTC the first time an operation meets it, one
after another on the engine thread: about 35 s for each quantized-matmul row class (a CUTLASS
template) and 2-7 s for each gather and scatter variant the sampler and the embedding use. Its
kernel cache on disk (MLX_PTX_CACHE_DIR) is read by any process, so child processes build those
modules — one module a child, each child with its own private cache folder seeded with what the
shared one already holds — and the new files are moved into the shared folder whole (the
listing file first, the kernel file last, each by rename); the warm-up that follows loads them
instead of compiling them. A child that fails or runs past the timeout costs only its time:
the warm-up then builds what is missing itself. Kernels fused by mx.compile are named by their
graph and are left to the warm-up."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[2]   # the folder holding the pipeserve package

# Row counts whose quantized-matmul kernels are built, one child each: MLX picks the kernel's
# tile by the rows of a (rows, K) input, up to 64 (a decode step's (rows, 1, K) is the 16-row
# class); a larger tile in a later MLX would be built by the warm-up itself.
ROW_CLASSES = (16, 32, 64)
STAMP = "pipeserve-prebuilt.txt"   # in the shared folder: the jobs built there already
SUFFIXES = (".cu", ".txt", ".ptx")   # the order they are published: the kernel file last


@dataclass(frozen=True)
class QuantSpec:
    """One quantization a model's matmuls use, and the input width of its first such layer
    (a real layer's width meets whatever alignment the kernel asks)."""
    bits: int
    group_size: int
    mode: str
    k: int


def quant_specs(model: Any) -> list[QuantSpec]:
    """The distinct quantizations of a model's quantized linear and embedding layers."""
    import mlx.nn as nn
    found: dict[tuple[int, int, str], QuantSpec] = {}
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            key = (int(m.bits), int(m.group_size), str(getattr(m, "mode", "affine")))
            k = int(m.weight.shape[-1]) * 32 // key[0]   # packed uint32 words -> inputs
            found.setdefault(key, QuantSpec(*key, k=k))
    return [found[key] for key in sorted(found)]


def shared_cache_dir() -> Path:
    """The folder MLX's CUDA backend keeps compiled kernels in (its default when unset)."""
    import mlx.core as mx
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def row_classes(max_rows: int, prefill_chunk: int) -> list[int]:
    """The row count classes a server meets: decode batches up to max_rows, prompt chunks up
    to prefill_chunk (a class past both is never met)."""
    top = max(max_rows, prefill_chunk)
    out = []
    for r in ROW_CLASSES:
        out.append(min(r, top))
        if r >= top:
            break
    return sorted(set(out))


def publish(private: Path, shared: Path) -> list[str]:
    """Move the kernel files a child built in `private` into `shared`, each whole by rename
    (through a temporary name in `shared`), a module's kernel file after its listing; files
    `shared` already has are left. Returns the module names published."""
    modules = []
    for ptx in sorted(private.rglob("*.ptx")):
        rel = ptx.relative_to(private)
        if (shared / rel).exists() or ptx.is_symlink() or ptx.stat().st_nlink > 1:
            continue   # the shared folder's own (a hard link seeded in), or already there
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        for suffix in SUFFIXES:
            src = ptx.with_suffix(suffix)
            if not src.exists():
                continue
            dst = (shared / rel).with_suffix(suffix)
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        modules.append(str(rel.with_suffix("")))
    return modules


def seed(shared: Path, private: Path) -> None:
    """Hard-link (or copy) what the shared folder holds into a child's private one, so a child
    compiles only what is missing."""
    if not shared.is_dir():
        return
    for f in shared.rglob("*"):
        if f.is_file() and not f.name.startswith(".") and f.name != STAMP:
            dst = private / f.relative_to(shared)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dst)
            except OSError:
                shutil.copyfile(f, dst)
                os.utime(dst)


def indexing_jobs(dtype: str, quantized: bool) -> list[list[str]]:
    """The gather and scatter modules a step meets (the embedding's lookups, the sampler's
    top-k / top-p / min-p gathers, logit_bias and the penalties' scatters), as child arguments;
    read off an H200 launch's kernel cache (4-bit Qwen3, every sampling path)."""
    jobs = [["gather", dtype, "uint32", "1"], ["gather", dtype, "uint32", "2"],
            ["gather", dtype, "int32", "1"], ["gather", "int32", "int32", "1"],
            ["gather", "uint32", "int32", "1"],
            ["gather_axis", dtype, "int32"], ["gather_axis", dtype, "uint32"],
            ["gather_axis", "uint32", "uint32"],
            ["scatter", dtype, "int32", "sum", "2"], ["scatter", dtype, "uint32", "assign", "2"],
            ["scatter", dtype, "uint32", "sum", "2"], ["scatter_axis", dtype, "uint32", "assign"]]
    if quantized:   # a quantized embedding gathers its packed words
        jobs.append(["gather", "uint32", "uint32", "1"])
    return jobs


def matmul_jobs(specs: Iterable[QuantSpec], dtype: str, rows: Iterable[int]) -> list[list[str]]:
    return [["qmm", dtype, str(s.bits), str(s.group_size), s.mode, str(s.k), str(r)]
            for s in specs for r in rows]


@dataclass
class Report:
    children: int
    seconds: float
    modules: list[str]
    failed: list[str]


def prebuild(jobs: list[list[str]], timeout_s: float = 300.0,
             force: bool = False) -> Report | None:
    """Run each job (a child's arguments) in its own child process, in order, at most the CPU
    count less one at once, except those the shared folder's stamp says were built there
    already; None where there is nothing to do (no job, or no CUDA). `force` runs the children
    on any device (the tests' CPU)."""
    import mlx.core as mx
    cuda = getattr(mx, "cuda", None)
    if not jobs or not (force or (cuda is not None and cuda.is_available())):
        return None
    shared = shared_cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    stamp = shared / STAMP
    done = set(stamp.read_text().splitlines()) if stamp.exists() else set()
    jobs = [j for j in jobs if " ".join(j) not in done]
    if not jobs:
        return Report(0, 0.0, [], [])
    width = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    t0, modules, failed = time.perf_counter(), [], []
    with tempfile.TemporaryDirectory(prefix="pipeserve-kernels-") as top:
        running: list[tuple[subprocess.Popen[bytes], Path, str, float]] = []
        pending = list(enumerate(jobs))
        while pending or running:
            while pending and len(running) < width:
                i, job = pending.pop(0)
                private = Path(top) / str(i)
                private.mkdir()
                seed(shared, private)
                env = dict(os.environ, MLX_PTX_CACHE_DIR=str(private),
                           PYTHONPATH=os.pathsep.join(filter(None, (
                               str(ROOT), os.environ.get("PYTHONPATH")))))
                cmd = [sys.executable, "-m", "pipeserve.core.kernel_prebuild", *job]
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                running.append((proc, private, " ".join(job), time.perf_counter()))
            time.sleep(0.05)
            for item in list(running):
                proc, private, name, started = item
                if proc.poll() is None and time.perf_counter() - started < timeout_s:
                    continue
                if proc.returncode is None:   # past the timeout
                    proc.kill()
                running.remove(item)
                _, err = proc.communicate()
                if proc.returncode == 0:
                    modules.extend(publish(private, shared))
                    with open(stamp, "a") as f:   # a launch on this cache skips it
                        f.write(name + "\n")
                else:   # killed or crashed: a kernel file it was writing may be cut short
                    last = (err.decode(errors="replace").strip().splitlines() or [""])[-1]
                    failed.append(f"{name}: exit {proc.returncode} {last[-200:]}")
    return Report(len(jobs), time.perf_counter() - t0, sorted(set(modules)), failed)


def _child(argv: list[str]) -> None:
    """A child: one operation that meets the module its arguments name, evaluated."""
    import mlx.core as mx
    op, dt = argv[0], getattr(mx, argv[1])
    if op == "qmm":
        bits, group, mode, k, rows = int(argv[2]), int(argv[3]), argv[4], int(argv[5]), int(argv[6])
        qs = mx.quantize(mx.random.normal((256, k)).astype(dt), group_size=group, bits=bits,
                         mode=mode)
        x = mx.random.normal((rows, k)).astype(dt)
        mx.eval(mx.quantized_matmul(x, qs[0], qs[1], qs[2] if len(qs) > 2 else None,
                                    transpose=True, group_size=group, bits=bits, mode=mode))
        return
    it = getattr(mx, argv[2])
    a = mx.ones((8, 8), dtype=dt)
    i, j = mx.array([1, 0, 3], dtype=it), mx.array([2, 2, 5], dtype=it)
    if op == "gather":
        out = a[i] if argv[3] == "1" else a[i, j]
    elif op == "gather_axis":
        out = mx.take_along_axis(a, mx.broadcast_to(i, (8, 3)), axis=-1)
    elif op == "scatter":
        v = mx.ones((3,), dtype=dt)
        if argv[3] == "sum":
            out = a.at[i, j].add(v)
        else:
            a[i, j] = v   # an array index assigned: a Scatter, not a slice update
            out = a
    elif op == "scatter_axis":
        out = mx.put_along_axis(a, mx.broadcast_to(i, (8, 3)), mx.ones((8, 3), dtype=dt),
                                axis=-1)
    else:
        raise SystemExit(f"unknown kernel job {argv}")
    mx.eval(out)


if __name__ == "__main__":
    _child(sys.argv[1:])
