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

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}

for _name, _value in DEFAULTS.items():
    os.environ.setdefault(_name, _value)
