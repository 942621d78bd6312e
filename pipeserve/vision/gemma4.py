"""Gemma 4's images and audio on mlx-lm's decoder (the mlx-vlm Gemma4 model's towers). `embed`
builds a prompt's input embeddings: its images through the vision tower (mlx-vlm's
get_input_embeddings) and its clips' soft tokens (pipeserve/vision/audio.py) at their tokens.
On a checkpoint whose text config says use_bidirectional_attention "vision" (Gemma 4 26B and
31B), the tokens of each image attend to each other both ways at prefill: `add_image_overlay`
makes the decoder OR a block mask onto the causal masks of a chunk armed with its image spans,
on full and sliding layers alike, as mlx-vlm's Gemma4TextModel builds it. A chunk never splits
an image span (PromptMedia.whole_spans), so one chunk's overlay is the whole prompt's. Engine
thread."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_causal_mask


def bidirectional(vlm: Any) -> bool:
    """Whether the checkpoint's image tokens attend both ways at prefill."""
    text = getattr(vlm.config, "text_config", None)
    return getattr(text, "use_bidirectional_attention", None) == "vision"


def embed(vlm: Any, ids: mx.array, pixels: dict[str, np.ndarray], image_token: int,
          audio_token: int, audio_soft: Any) -> tuple[mx.array, Any]:
    """The prompt's inputs for mlx-lm's decoder, from ids (1, L): the input embeddings mlx-vlm
    builds, given before mlx-lm's own embed_scale multiply (text rows are the raw embedding
    rows, so they come out bit-equal to mlx-vlm's; image and audio rows are its features over
    embed_scale), and mlx-vlm's per-layer inputs (multimodal positions on token 0's row).
    `pixels` empty or `audio_soft` None: those media lie in a cached prefix no chunk reads (their
    rows are left as their token's)."""
    images = [mx.array(pixels[k]) for k in sorted(pixels, key=lambda k: int(k.rsplit("_", 1)[1]))]
    if images:   # as mlx-vlm's processor hands them on: one batch when their shapes agree
        same = len({i.shape for i in images}) == 1
        values: Any = mx.concatenate(images) if same else [i[0] for i in images]
    else:
        values = None
    out = vlm.get_input_embeddings(ids, values, mask=mx.ones(ids.shape, dtype=mx.int32))
    inner = vlm.language_model.model
    embeddings = inner.embed_tokens(ids)[0]
    if values is not None:
        is_image = (ids[0] == image_token)[:, None]
        embeddings = mx.where(is_image, out.inputs_embeds[0] / inner.embed_scale, embeddings)
    if audio_soft is not None:
        is_audio = ids[0] == audio_token
        index = mx.maximum(mx.cumsum(is_audio.astype(mx.int32)) - 1, 0)
        audio = (audio_soft.astype(embeddings.dtype) / inner.embed_scale)[index]
        embeddings = mx.where(is_audio[:, None], audio, embeddings)
    per_layer = out.per_layer_inputs   # None: a Gemma 4 without per-layer inputs (26B, 31B)
    return embeddings, per_layer[0] if per_layer is not None else None


def overlay(mask: Any, blocks: mx.array, n: int, window: int | None) -> mx.array:
    """`mask` (a chunk of n queries; its last n keys are the chunk's own) with each image's
    queries also seeing all of that image's keys."""
    if not isinstance(mask, mx.array):   # "causal" or None: the chunk has no cached prefix
        mask = create_causal_mask(n, window_size=window)
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    before = mx.zeros((n, mask.shape[-1] - n), dtype=mx.bool_)
    return mask | mx.concatenate([before, same], axis=1)


_CLASSES: dict[type, type] = {}


def add_image_overlay(text_model: Any, armed: Any) -> None:
    """Make mlx-lm's Gemma4TextModel OR the image overlay onto its masks while a chunk is armed
    with its tokens' image spans (armed.blocks: per token its image's index, -1 elsewhere).
    Its class becomes a subclass of its own, so its parameters keep their names."""
    base = type(text_model)
    cls = _CLASSES.get(base)
    if cls is None:
        def _make_masks(self: Any, h: mx.array, cache: Any) -> list[Any]:
            blocks = self._images.armed.blocks
            if blocks is None:
                return base._make_masks(self, h, cache)
            made: dict[str, Any] = {}
            for layer, c in zip(self.layers, cache):
                kind = layer.layer_type
                if kind not in made:
                    window = self.window_size if kind == "sliding_attention" else None
                    mask = create_attention_mask(h, c, window_size=window, return_array=True)
                    made[kind] = overlay(mask, blocks, h.shape[1], window)
            return [made[layer.layer_type] for layer in self.layers]
        cls = _CLASSES[base] = type(f"ImageOverlay{base.__name__}", (base,),
                                    {"_make_masks": _make_masks})
    text_model.__class__ = cls
    text_model._images = _Armed(armed)


class _Armed:
    """Holds the encoder's armed state on the module without making it a parameter."""

    def __init__(self, armed: Any) -> None:
        self.armed = armed
