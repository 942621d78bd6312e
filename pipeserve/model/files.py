"""Whether a checkpoint's weight files are whole, read from their headers only (no tensor is
loaded): a download cut short or a damaged file is a launch error naming the file, what is
wrong and the fix, before the engine starts. Main thread, at launch; never imports MLX."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeserve.errors import ConfigError


def check_safetensors(directory: Path, shown: str) -> None:
    """Each *.safetensors directly under `directory` opens (its header and every tensor's byte
    range inside the file); `shown` is how the user wrote the path."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), "numpy"):
                pass
        except (SafetensorError, OSError) as e:
            reason = str(e).removeprefix("Error while deserializing header: ")
            raise ConfigError(f"model.path '{shown}': {path.name} is {_problem(path, reason)}; "
                              "download the checkpoint again") from None


def _problem(path: Path, reason: str) -> str:
    """'truncated at byte N of M' when the header parses and names a larger file, else
    'corrupt (<the library's reason>)'."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else {}   # else: a bad length
        end = 8 + n + max((t["data_offsets"][1] for k, t in header.items()
                           if k != "__metadata__"), default=0) if header else 0
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        end = 0
    if end > size:
        return f"truncated at byte {size} of {end}"
    return f"corrupt ({reason}; {size} bytes)"
