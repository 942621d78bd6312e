"""Images in: vision-language models through mlx-vlm. media.py decodes what clients send (event
loop side, no MLX), processor.py turns images into pixel arrays and a prompt's placeholders into
image tokens (preparation pool), encoder.py runs the vision tower at prefill (engine thread).
video.py does what media.py and processor.py do for videos (Qwen-VL), mixed.py merges images
and videos of one prompt."""
from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError

INSTALL = "pip install 'pipeserve[vision]'   (or: pip install mlx-vlm)"


def require_mlx_vlm(what: str) -> None:
    """Refuse at launch, naming the package and the install command, when mlx-vlm is missing."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{what} has a vision tower, served through the mlx-vlm package, which "
                          f"is not installed; install it with: {INSTALL}") from e


def check_vision(cfg: Any, keep_hidden: bool) -> None:
    """Refuse at launch what does not compose with image rows (their prompt chunks run on
    input embeddings, which only the target's own prefill passes)."""
    if keep_hidden:
        raise ConfigError(f"draft={cfg.draft.name} with a vision-language model: the MTP head "
                          "learns from prompt chunks fed as token ids, and image rows' chunks are "
                          "embeddings; use draft=none, ngram or model")
    if cfg.server.isolate:
        raise ConfigError("server.isolate=true with a vision-language model: requests cross to "
                          "the engine's process as token ids, without their images; leave "
                          "server.isolate unset for a VLM")
    distributed = getattr(getattr(cfg, "distributed", None), "name", "none")
    if distributed != "none":
        raise ConfigError(f"distributed={distributed} with a vision-language model: images do "
                          "not cross to the other ranks yet; serve it on one process")
