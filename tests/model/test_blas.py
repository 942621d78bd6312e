"""The CPU BLAS that `pip install` brings really serves MLX's float32 matmuls (pipeserve/model/blas.py),
in fresh interpreters, since the library must be loaded before mlx.core is first imported."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.model import blas

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="BLAS interposition is Linux-only")

PROBE = r"""
import json, os, sys
import numpy as np
import pipeserve                     # interposes the BLAS
import mlx.core as mx
from pipeserve.model import blas
rng = np.random.default_rng(0)
a = rng.standard_normal((257, 576), dtype=np.float32)
b = rng.standard_normal((576, 384), dtype=np.float32)
with mx.stream(mx.cpu):
    c = np.array(mx.array(a) @ mx.array(b))
ref = a.astype(np.float64) @ b.astype(np.float64)
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/" in l})
print(json.dumps({"loaded": blas.loaded, "name": blas.name, "version": blas.version,
                  "threads": blas.threads, "skipped": blas.skipped, "describe": blas.describe(),
                  "err": float(np.abs(c - ref).max() / np.abs(ref).max()), "maps": maps}))
"""


def probe(**env: str) -> tuple[dict[str, Any], str]:
    """Run PROBE in a fresh interpreter; its JSON and its stdout's other lines (MKL_VERBOSE)."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PIPESERVE_BLAS", "MKL_VERBOSE", *blas.THREAD_VARS)}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    *other, last = res.stdout.strip().splitlines()
    return json.loads(last), "\n".join(other)


def mkl_rt() -> set[str]:
    """The libmkl_rt files the `mkl` wheel installed."""
    return {os.path.normpath(f.locate()) for f in metadata.files("mkl") or []
            if f.name.startswith("libmkl_rt.so")}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the mkl wheel is x86_64-only")
def test_pip_mkl_serves_mlx_float32_matmul() -> None:
    out, verbose = probe(MKL_VERBOSE="1")
    assert out["name"] == "mkl", out["describe"]
    assert out["loaded"] in mkl_rt()                   # the pip wheel's file, not a system lib
    assert out["loaded"] in out["maps"]                 # mapped into the process
    assert "Math Kernel Library" in out["version"] and out["threads"] == 1
    assert re.search(r"MKL_VERBOSE SGEMM\(", verbose), verbose   # MLX's GEMM went through MKL
    assert out["err"] < 1e-5, out["err"]
    # sequential MKL: no OpenMP runtime in the process
    assert not any("libiomp5" in m for m in out["maps"]), out["maps"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the mkl wheel is x86_64-only")
def test_missing_candidates_are_skipped_and_named() -> None:
    out, _ = probe(PIPESERVE_BLAS="/nonexistent/libopenblas.so.0,nosuchblas,mkl")
    assert out["name"] == "mkl" and out["loaded"] in mkl_rt()
    assert out["skipped"][0] == "/nonexistent/libopenblas.so.0: not found"
    assert "unknown name 'nosuchblas'" in out["skipped"][1]
    assert out["err"] < 1e-5


def test_none_keeps_mlx_reference_blas() -> None:
    out, _ = probe(PIPESERVE_BLAS="none")
    assert out["loaded"] is None and out["name"] is None
    assert "reference BLAS" in out["describe"]
    assert not any(re.search(r"libmkl|libopenblas", m) for m in out["maps"]), out["maps"]
    assert out["err"] < 1e-4                            # slow, not wrong


def test_fallback_order_is_the_docs() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    m = re.search(r"`pipeserve/model/blas\.py` tries, in order:\s+(.+?);", page, re.S)
    assert m, "docs/models.md names the BLAS order"
    stated = re.findall(r"`([\w-]+)`", m.group(1))
    assert stated == [c.name for c in blas.CANDIDATES]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the mkl wheel is x86_64-only")
def test_server_reports_its_blas(server: Any) -> None:
    srv = server
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    assert re.search(r'pipeserve_build_info\{[^}]*blas="mkl"', text), text[:2000]
    assert re.search(r"CPU BLAS: mkl \(.*libmkl_rt\.so", srv.log()), srv.log()[-2000:]
