"""pipeserve framework: config, engine, scheduler, request state, metrics, HTTP adapters."""
from pipeserve.model import mlx_env as _mlx_env  # noqa: F401  (before anything imports mlx.core)
from pipeserve.model import blas as _blas  # noqa: F401  (must run before anything imports mlx.core)
