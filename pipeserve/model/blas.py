"""Interpose a real BLAS under MLX's CPU backend, before mlx.core is first imported.

The Linux `mlx[cpu]` wheel links netlib's reference BLAS (~2 GFLOP/s for float32 GEMM). libmlx
calls the standard `cblas_sgemm` (and LAPACK's `sgetrf_`, ...); a library loaded RTLD_GLOBAL
before it exports those names first, so MLX's float32 matmuls run through it. The same GEMMs
are computed either way; only their speed (and last-bit rounding) changes.

CANDIDATES are tried in order; the first that loads wins:

1. `mkl`: Intel oneMKL from PyPI, pyproject's dependency on Linux x86_64 (`libmkl_rt`).
2. `cmeel-openblas`: OpenBLAS from PyPI (`pip install cmeel-openblas`). Needs the system's
   libgfortran.so.5 and is built for AVX-512 CPUs only (`SKYLAKEX`, no runtime dispatch).
3. `debian-openblas`: `apt-get install libopenblas0-pthread`.

numpy's and `scipy-openblas32`/`-64`'s OpenBLAS are no candidates: their symbols are prefixed
(`scipy_cblas_sgemm`), so MLX's `cblas_sgemm` never reaches them.

`PIPESERVE_BLAS` overrides the order: a comma-separated list of candidate names or library
paths tried instead, or `none` for MLX's bundled reference BLAS. Threads: one BLAS thread
unless `MKL_NUM_THREADS` / `OPENBLAS_NUM_THREADS` / `OMP_NUM_THREADS` say otherwise (MLX's
CPU stream is one thread, and the engine shares the cores with the event loop)."""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Candidate:
    name: str
    dist: str | None           # PyPI distribution that ships it; None: a system library
    files: tuple[str, ...]     # file names inside `dist`, or absolute paths


CANDIDATES = (
    Candidate("mkl", "mkl", ("libmkl_rt.so.3", "libmkl_rt.so.2")),
    Candidate("cmeel-openblas", "cmeel-openblas", ("libopenblas.so.0",)),
    Candidate("debian-openblas", None, ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
                                         "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
                                         "/usr/lib64/libopenblas.so.0")),
)
THREAD_VARS = ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")

loaded: str | None = None     # path of the library serving MLX's GEMMs; None: reference BLAS
name: str | None = None       # its candidate name, or the path PIPESERVE_BLAS gave
version: str | None = None    # what the library says it is (openblas_get_config / MKL version)
threads: int | None = None    # BLAS threads it runs with
skipped: list[str] = []       # "name: why" for every candidate tried before it, for the log


def _paths(c: Candidate) -> list[str]:
    if c.dist is None:
        return [p for p in c.files if os.path.exists(p)]
    try:
        files = metadata.files(c.dist) or []
    except metadata.PackageNotFoundError:
        return []
    return [os.path.normpath(f.locate()) for want in c.files for f in files if f.name == want]


def _describe(lib: ctypes.CDLL) -> tuple[str, int | None]:
    if hasattr(lib, "MKL_Get_Version_String"):
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        return buf.value.decode(), lib.MKL_Get_Max_Threads()
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        return lib.openblas_get_config().decode(), lib.openblas_get_num_threads()
    return "unknown BLAS", None


def _configure(lib: ctypes.CDLL) -> None:
    """One thread by default, set before the library's first GEMM."""
    if any(v in os.environ for v in THREAD_VARS):
        return
    if hasattr(lib, "MKL_Set_Num_Threads"):
        if "MKL_THREADING_LAYER" not in os.environ:
            lib.MKL_Set_Threading_Layer(1)   # MKL_THREADING_SEQUENTIAL: no OpenMP runtime
        lib.MKL_Set_Num_Threads(1)
    elif hasattr(lib, "openblas_set_num_threads"):
        lib.openblas_set_num_threads(1)


def _load(label: str, paths: list[str]) -> bool:
    global loaded, name, version, threads
    if not paths:
        skipped.append(f"{label}: not found")
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            skipped.append(f"{label}: {e}")
            continue
        if not hasattr(lib, "cblas_sgemm"):
            skipped.append(f"{label}: {path} exports no cblas_sgemm")
            continue
        _configure(lib)
        loaded, name = path, label
        version, threads = _describe(lib)
        return True
    return False


def interpose() -> str | None:
    """Load the first BLAS found; a no-op off Linux or once mlx.core is imported."""
    if loaded or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return loaded
    by_name = {c.name: c for c in CANDIDATES}
    wanted = os.environ.get("PIPESERVE_BLAS", "").strip()
    if wanted.lower() == "none":
        skipped.append("PIPESERVE_BLAS=none")
        return None
    for item in [w.strip() for w in wanted.split(",") if w.strip()] or list(by_name):
        if item in by_name:
            found = _load(item, _paths(by_name[item]))
        elif "/" in item:
            found = _load(item, [item] if os.path.exists(item) else [])
        else:
            skipped.append(f"PIPESERVE_BLAS: unknown name {item!r} (known: {', '.join(by_name)})")
            continue
        if found:
            break
    return loaded


def describe() -> str:
    """One line for the startup log: which library serves MLX's CPU GEMMs."""
    if loaded:
        return f"{name} ({loaded}; {version}; {threads} thread(s))"
    if not sys.platform.startswith("linux"):
        return "MLX's own (nothing interposed off Linux)"
    return ("MLX's bundled reference BLAS, slow float32 matmul ("
            + ("; ".join(skipped) or "nothing tried") + ")")


interpose()
