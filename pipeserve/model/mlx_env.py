"""MLX settings read from the environment when mlx.core is first imported, set here before that
(each only where the operator has not set it).

MLX_ENABLE_CACHE_THRASHING_CHECK=0: MLX's CUDA backend keeps its CUDA graphs (and cuDNN plans) in
LRU caches, and with this check on, a cache that has missed more than twice its capacity over
the process's whole life raises on every later miss ("Cache thrashing is happening ...", MLX
0.32 `backend/cuda/lru_cache.h`): the counter is never reset, so a server that has met enough
distinct step shapes over hours fails steps from then on. A miss only costs building the graph
again; a server keeps serving through it."""
from __future__ import annotations

import os
import sys

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}

for _name, _value in DEFAULTS.items():
    os.environ.setdefault(_name, _value)


CUDA_GRAPHS = "MLX_USE_CUDA_GRAPHS"


def use_cuda_graphs(setting: bool | None) -> str | None:
    """MLX_USE_CUDA_GRAPHS for this process and the processes it starts, from
    server.cuda_graphs: True or False sets it; None leaves it as the operator set it, or unset
    (MLX's default: on). MLX reads it once, at its first device work; this sets it only before
    mlx.core is imported. Returns the value in force ("1" where unset), or None where mlx.core
    was imported already (then nothing changes)."""
    if "mlx.core" in sys.modules:
        return None
    if setting is not None:
        os.environ[CUDA_GRAPHS] = "1" if setting else "0"
    return os.environ.get(CUDA_GRAPHS, "1")
