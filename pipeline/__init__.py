"""pipeserve framework: config, engine, scheduler, request state, metrics, HTTP adapters."""
from pipeline import blas as _blas  # noqa: F401  (must run before anything imports mlx.core)
