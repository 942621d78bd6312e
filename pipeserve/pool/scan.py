"""pool.model_dir: the models a directory holds — each subdirectory with a config.json and
safetensors weights, and each .gguf file, directly under it — as pool member ids and their
overrides (`model.path=<it>`, and `model.task=embed` for an embedding model). Main thread at
launch; an executor thread on POST /v1/models/rescan (a listing and each config.json)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from pipeserve.errors import ConfigError
from pipeserve.pool.config import ID_PATTERN


def member_id(name: str) -> str:
    """A directory or file name as a pool id: characters ids cannot hold become '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name.removesuffix(".gguf"))
    return cleaned.lstrip("._-")[:64]


# encoder architectures mlx-embeddings loads: such a directory is an embedding model, as is any
# sentence-transformers export (it ships config_sentence_transformers.json)
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "xlm_roberta", "modernbert"})


def encoder_task(path: Path) -> str | None:
    """`rerank` for a cross-encoder (a sequence-classification head), `embed` for another
    encoder or a sentence-transformers export, None for a generative model."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    if config.get("model_type") in ENCODER_TYPES and any(
            "SequenceClassification" in str(a) for a in config.get("architectures") or []):
        return "rerank"
    if (path / "config_sentence_transformers.json").is_file():
        return "embed"
    return "embed" if config.get("model_type") in ENCODER_TYPES else None


def scan(model_dir: str) -> dict[str, list[str]]:
    """id → member overrides for every model under `model_dir`, in name order."""
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"pool.model_dir {model_dir!r} is not a directory")
    found: dict[str, list[str]] = {}
    for path in sorted(root.iterdir()):
        is_model = ((path.is_dir() and (path / "config.json").is_file()
                     and any(path.glob("*.safetensors")))
                    or (path.is_file() and path.suffix == ".gguf"))
        model_id = member_id(path.name)
        if is_model and ID_PATTERN.match(model_id) and model_id not in found:
            found[model_id] = [f"model.path='{path.absolute()}'"]   # quoted: any characters
            task = encoder_task(path) if path.is_dir() else None
            if task is not None:
                found[model_id].append(f"model.task={task}")
    return found
