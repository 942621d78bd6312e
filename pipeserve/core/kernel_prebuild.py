"""Quantized-matmul kernels built in parallel before the kernel warm-up (CUDA only).

MLX's CUDA backend compiles each quantized-matmul kernel (a CUTLASS template) with NVRTC the
first time a shape class meets it: tens of seconds each, one after another on the engine thread.
Its kernel cache on disk (MLX_PTX_CACHE_DIR) is read by any process, so child processes build
the kernels a server will meet — one per row count class, each with its own private cache
folder seeded with what the shared one already holds — and their new files are moved into the
shared folder whole (the listing file first, the kernel file last, each by rename), so the
engine's warm-up that follows loads them instead of compiling them. A child that fails or
runs past the timeout costs nothing but its time: the warm-up then builds what is missing."""
from __future__ import annotations

import argparse
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

# Row counts whose kernels are built: one child each. MLX picks its tile by row count class
# (up to 16, 32, 64, 128, more); both a (rows, K) input and a decode step's (rows, 1, K) run.
ROW_CLASSES = (16, 32, 64, 128, 256)
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
        if f.is_file() and not f.name.startswith("."):
            dst = private / f.relative_to(shared)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dst)
            except OSError:
                shutil.copyfile(f, dst)
                os.utime(dst)


@dataclass
class Report:
    children: int
    seconds: float
    modules: list[str]
    failed: list[str]


def prebuild(specs: Iterable[QuantSpec], dtype: str, rows: Iterable[int],
             timeout_s: float = 300.0, force: bool = False) -> Report | None:
    """Build the quantized-matmul kernels of `specs` at each row class in child processes, at
    most the CPU count less one at once; None where there is nothing to do (no CUDA, no
    quantized layer). `force` runs the children on any device (the tests' CPU)."""
    import mlx.core as mx
    cuda = getattr(mx, "cuda", None)
    specs = list(specs)
    if not specs or not (force or (cuda is not None and cuda.is_available())):
        return None
    shared = shared_cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    jobs = [(s, r) for s in specs for r in rows]
    width = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    t0, modules, failed = time.perf_counter(), [], []
    with tempfile.TemporaryDirectory(prefix="pipeserve-kernels-") as top:
        running: list[tuple[subprocess.Popen[bytes], Path, str, float]] = []
        pending = list(enumerate(jobs))
        while pending or running:
            while pending and len(running) < width:
                i, (spec, r) = pending.pop(0)
                private = Path(top) / str(i)
                private.mkdir()
                seed(shared, private)
                env = dict(os.environ, MLX_PTX_CACHE_DIR=str(private),
                           PYTHONPATH=os.pathsep.join(filter(None, (
                               str(ROOT), os.environ.get("PYTHONPATH")))))
                cmd = [sys.executable, "-m", "pipeserve.core.kernel_prebuild", "--dtype", dtype,
                       "--bits", str(spec.bits), "--group-size", str(spec.group_size),
                       "--mode", spec.mode, "--k", str(spec.k), "--rows", str(r)]
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                running.append((proc, private, f"{spec.bits}-bit rows={r}", time.perf_counter()))
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
                else:   # killed or crashed: a kernel file it was writing may be cut short
                    last = (err.decode(errors="replace").strip().splitlines() or [""])[-1]
                    failed.append(f"{name}: exit {proc.returncode} {last[-200:]}")
    return Report(len(jobs), time.perf_counter() - t0, sorted(set(modules)), failed)


def _child(argv: list[str] | None = None) -> None:
    """A child: one quantized matmul of each input shape of a row class, evaluated."""
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", required=True)
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--mode", default="affine")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--rows", type=int, required=True)
    a = p.parse_args(argv)
    import mlx.core as mx
    dtype = getattr(mx, a.dtype)
    w = mx.random.normal((256, a.k)).astype(dtype)
    qs = mx.quantize(w, group_size=a.group_size, bits=a.bits, mode=a.mode)
    wq, scales, biases = qs[0], qs[1], (qs[2] if len(qs) > 2 else None)
    for shape in ((a.rows, a.k), (a.rows, 1, a.k)):
        x = mx.random.normal(shape).astype(dtype)
        y = mx.quantized_matmul(x, wq, scales, biases, transpose=True,
                                group_size=a.group_size, bits=a.bits, mode=a.mode)
        mx.eval(y)


if __name__ == "__main__":
    _child()
