"""Images in: vision-language models through mlx-vlm. media.py decodes what clients send (event
loop side, no MLX), processor.py turns images into pixel arrays and a prompt's placeholders into
image tokens (preparation pool), encoder.py runs the vision tower at prefill (engine thread).
video.py does what media.py and processor.py do for videos (Qwen-VL), mixed.py merges images
and videos of one prompt."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import ConfigError

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
        raise ConfigError(f"draft={cfg.draft.name} with a vision-language model: its head "
                          "reads the target's hidden states of prompt chunks fed as token ids, and "
                          "image rows' chunks are "
                          "embeddings; use draft=none, ngram or model, or serve the checkpoint "
                          "text only with model.vision=false")
    if cfg.server.isolate:
        raise ConfigError("server.isolate=true with a vision-language model: requests cross to "
                          "the engine's process as token ids, without their images; leave "
                          "server.isolate unset for a VLM, or serve it text only with "
                          "model.vision=false")
    distributed = getattr(getattr(cfg, "distributed", None), "name", "none")
    if distributed != "none":
        raise ConfigError(f"distributed={distributed} with a vision-language model: images do "
                          "not cross to the other ranks yet; serve it on one process, or text "
                          "only with model.vision=false")


# Towers that do not run on MLX's CUDA backend (a floating-point exception kills the process in
# the tower's forward, in mlx-vlm's own generate too; the log is under docs/bench/). Refused at
# launch, rather than dying with every in-flight request at the first image.
CUDA_BROKEN = ("qwen2_vl", "qwen2_5_vl")


def check_backend(family: str, cuda: bool) -> None:
    """Refuse at launch a vision family whose tower crashes this MLX backend."""
    if cuda and family in CUDA_BROKEN:
        import mlx.core as mx
        raise ConfigError(
            f"a {family} vision-language model on MLX {mx.__version__}'s CUDA backend: its "
            "vision tower dies with a floating-point exception there (in mlx-vlm's own generate "
            "too), which would end the server at the first image; serve it on the CPU backend "
            "(MLX's CPU wheel) or on Apple silicon, or serve a Gemma 3 VLM on this GPU")

