"""The model cache: where generated (tiny.py), converted (gguf.py) and fetched (embedded.py)
model directories live, and the one way each is published there."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | Path | None) -> Path:
    """model.cache_dir, else $PIPESERVE_CACHE, else ~/.cache/pipeserve/models."""
    if cache_dir is None:
        cache_dir = os.environ.get("PIPESERVE_CACHE") or Path.home() / ".cache" / "pipeserve" / "models"
    return Path(cache_dir).expanduser()


def publish(final: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` and rename the result to `final` atomically (two processes racing
    publish one copy); a failed write leaves nothing behind."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)   # fails if another process already published it
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        release_mlx_buffers()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def release_mlx_buffers() -> None:
    """Give back the buffers a writer's arrays were freed into. MLX keeps freed buffers in a
    cache that on CUDA may grow to its whole memory limit, and that memory is the device's:
    an 8B model's draws and casts (~48 GB) would stay with the process that made the model
    (bench.py, for every server it then runs beside it) until it exits."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()
