"""EngineLimits: what a loaded engine publishes for the HTTP side and the request stages to check
against (context, vocabulary, modalities, rows, KV sizes, the mounted adapters) and the model's
host side they tokenize with. Frozen: an engine replaces it whole when a fact changes (an
adapter swap). Pure data; never imports mlx."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.memory import MemoryModel
    from pipeserve.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine facts the request stages check against, published once the model is loaded."""

    max_context: int   # tokens of prompt + output: the model's, capped by admission.max_context
    vocab_size: int    # width of the model's logits: token ids are < this
    # the model as the request stages use it (tokenizer, chat template, config, processors);
    # the HTTP side never calls its weights
    model: Any = None
    max_rows: int = 1   # rows the scheduler runs at once (scheduler.max_batch as resolved)
    modalities: tuple[str, ...] = ("text",)
    memory: MemoryModel | None = None   # the memory estimate (KV bytes per token, safe context)
    kv_pool_bytes: int | None = None    # kv=paged: what the block pool holds
    adapters: Any = None   # a snapshot of the mounted AdapterSet (None: no adapters)
    device: str = ""
    dimensions: int = 0    # an embedding model's vector width (0: a generative model)
    # whether every layer's cache cuts back to any prefix (then a chat needs no checkpoint at
    # its history's end); None where the weights are not here to ask (a pool's parent)
    rewinds: bool | None = None

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self.memory.kv_bytes_per_token if self.memory is not None else None

    @property
    def max_safe_context(self) -> int | None:
        return self.memory.max_safe_context if self.memory is not None else None

    @classmethod
    def of(cls, cfg: ServeConfig, loaded: LoadedModel, **published: Any) -> EngineLimits:
        """The limits of `loaded` under `cfg`; `published`: the engine's other fields."""
        text = loaded.config.get("text_config") or {}
        vocab = int(loaded.config.get("vocab_size") or text.get("vocab_size")
                    or len(loaded.tokenizer))
        native = loaded.max_context
        adapters = loaded.adapters
        return cls(min(cfg.admission.max_context or native, native), vocab, model=loaded,
                   modalities=modalities_of(loaded),
                   adapters=adapters.snapshot() if adapters is not None else None, **published)


def modalities_of(loaded: LoadedModel) -> tuple[str, ...]:
    """What a model reads besides text: images, video and audio when its processor takes
    them (model.vision)."""
    vision = getattr(loaded, "vision", None)
    if vision is None:
        return ("text",)
    found = ["text", "image"]
    if vision.processor.video_processor is not None:
        found.append("video")
    if vision.audio is not None:
        found.append("audio")
    return tuple(found)
