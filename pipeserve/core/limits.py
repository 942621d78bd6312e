"""EngineLimits: the facts of a loaded model that the HTTP side and the request stages check
against (context length, logit width): part of the engine's published face. Pure data; never
imports mlx."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine facts the request stages check against, fixed once the model is loaded (they
    never touch the model itself)."""

    max_context: int   # tokens of prompt + output: the model's, capped by admission.max_context
    vocab_size: int    # width of the model's logits: token ids are < this

    @classmethod
    def of(cls, cfg: ServeConfig, loaded: LoadedModel) -> EngineLimits:
        text = loaded.config.get("text_config") or {}
        vocab = int(loaded.config.get("vocab_size") or text.get("vocab_size")
                    or len(loaded.tokenizer))
        native = loaded.max_context
        return cls(min(cfg.admission.max_context or native, native), vocab)
