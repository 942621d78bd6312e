"""Images in: vision-language models through mlx-vlm. media.py decodes what clients send (event
loop side, no MLX), processor.py turns images into pixel arrays and a prompt's placeholders into
image tokens (preparation pool), encoder.py runs the vision tower at prefill (engine thread)."""
from __future__ import annotations

from pipeline.errors import ConfigError

INSTALL = "pip install 'pipeserve[vision]'   (or: pip install mlx-vlm)"


def require_mlx_vlm(what: str) -> None:
    """Refuse at launch, naming the package and the install command, when mlx-vlm is missing."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{what} has a vision tower, served through the mlx-vlm package, which "
                          f"is not installed; install it with: {INSTALL}") from e
