"""pipeserve/model/mlx_env.py: MLX settings read when mlx.core is first imported are set by
importing pipeserve, before it, unless the operator set them. MLX's CUDA graph-cache fuse
(MLX_ENABLE_CACHE_THRASHING_CHECK) raises on every miss once a cache has missed twice its
capacity over the process's life; a server runs with it off. Pure logic: fresh interpreters."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

PROBE = ("import sys, os, pipeserve; assert 'mlx.core' not in sys.modules; import mlx.core; "
         "print(os.environ.get('MLX_ENABLE_CACHE_THRASHING_CHECK'))")


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_thrashing_fuse_is_off_unless_the_operator_sets_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
    assert _run(env) == "0"
    assert _run(env | {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}) == "1"


GRAPHS = ("import os, sys, pipeserve; from pipeserve.model.mlx_env import use_cuda_graphs; "
          "print(use_cuda_graphs({setting})); import mlx.core; "
          "print(use_cuda_graphs(True), os.environ.get('MLX_USE_CUDA_GRAPHS', 'unset'))")


def test_cuda_graphs_follow_the_config_then_the_operator_then_mlxs_default() -> None:
    """server.cuda_graphs true/false wins; unset, an operator's MLX_USE_CUDA_GRAPHS stays, and
    with neither MLX's default (on) is left alone; once mlx.core is imported nothing changes."""
    base = {k: v for k, v in os.environ.items() if k != "MLX_USE_CUDA_GRAPHS"}
    cases = [(None, None, ["1", "None", "unset"]), (None, "0", ["0", "None", "0"]),
             (True, "0", ["1", "None", "1"]), (False, None, ["0", "None", "0"])]
    for setting, operator, want in cases:
        env = base | ({"MLX_USE_CUDA_GRAPHS": operator} if operator else {})
        out = subprocess.run([sys.executable, "-c", GRAPHS.format(setting=setting)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == want, (setting, operator, out.stdout)
