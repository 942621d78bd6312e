"""VisionEncoder: a checkpoint's vision tower and projector, loaded through mlx-vlm, sharing
the token embedding of the language model pipeserve runs (mlx-lm's, in the step core). At
prefill it turns a row's prompt ids and pixels into the prompt's input embeddings (image
features merged at the image tokens, exactly as mlx-vlm's get_input_embeddings does) and, for
M-RoPE models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL), the prompt's 3-D positions, and for Qwen3-VL
the deepstack features its first decoder layers add at the visual tokens. Engine thread."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pipeserve.errors import ConfigError
from pipeserve.vision import audio as A, gemma4 as G4, mixed, require_mlx_vlm
from pipeserve.vision.audio import AudioProcessor
from pipeserve.vision.processor import VisionProcessor

# mlx-vlm families wired in: model_type -> whether its decoder uses M-RoPE positions
FAMILIES = {"gemma3": False, "qwen2_5_vl": True, "qwen2_vl": True, "qwen3_vl": True,
            "qwen3_vl_moe": True, "qwen3_5": True, "qwen3_5_moe": True, "gemma4": False}
# families whose tower also returns deepstack features: the outputs of some tower layers,
# each added to the hidden states of one of the decoder's first layers at the visual tokens
DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# families whose mlx-vlm get_input_embeddings takes images and videos in one prompt (the
# others' prompts with both go through pipeserve/vision/mixed.py)
BOTH_KINDS = ("qwen3_vl",)
# families whose audio tower is served (pipeserve/vision/audio.py); their images and clips are
# merged by pipeserve/vision/gemma4.py
AUDIO_FAMILIES = ("gemma4",)


class _Hidden:
    """Holds objects on a module without making them part of its parameter tree."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class PositionedRope(nn.Module):
    """Stands in for an attention layer's RoPE in an M-RoPE decoder. Without positions armed
    it is the layer's own rope at the cache offset (text rows, decode); with positions armed
    (an image row's prompt chunk) it rotates by the given 3-D positions, with mlx-vlm's M-RoPE.
    Image rows store their prompt shifted by -rope_delta, so their decode positions are the
    cache offset, as every other row's (rotary scores depend on position differences only)."""

    def __init__(self, rope: nn.Module, rotary: Any, armed: _Hidden) -> None:
        super().__init__()
        self._h = _Hidden(rope=rope, rotary=rotary, armed=armed)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        positions = self._h.armed.positions
        if positions is None:
            return self._h.rope(x, offset=offset)
        rotated, _ = self._h.rotary.apply_rotary(x, x, positions, unsqueeze_dim=1)
        return rotated.astype(x.dtype)


_DEEPSTACK_CLASSES: dict[type, type] = {}


def add_deepstack(layer: nn.Module, index: int, armed: _Hidden) -> None:
    """Make decoder layer `index` add its deepstack features to its output at the visual
    tokens while a chunk is armed with them (mlx-vlm's Qwen3VLModel._deepstack_process, the
    same scatter-add), and nothing otherwise. The layer's class becomes a subclass of its own
    whose __call__ does that, so its parameters keep their names (adapters, KV layouts)."""
    base = type(layer)
    cls = _DEEPSTACK_CLASSES.get(base)
    if cls is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> mx.array:
            h = base.__call__(self, *args, **kwargs)
            armed = self._deepstack.armed.deepstack
            if armed is None:
                return h
            at, features = armed
            return h[0].at[at].add(features[self._deepstack.index])[None]
        cls = _DEEPSTACK_CLASSES[base] = type(f"Deepstack{base.__name__}", (base,),
                                              {"__call__": __call__})
    layer.__class__ = cls
    layer._deepstack = _Hidden(index=index, armed=armed)


@dataclass
class Embedded:
    """One prompt's input embeddings (L, D), and its M-RoPE positions (3, 1, L) shifted so that
    position L-1+1 is the cache offset L (None for 1-D RoPE models)."""

    embeddings: mx.array
    positions: mx.array | None
    encode_s: float
    per_layer: mx.array | None = None   # Gemma 4's per-layer inputs (L, layers, width)
    # Qwen3-VL's deepstack: the visual tokens' prompt positions, and per injected decoder
    # layer their features (layers, visual tokens, width), in prompt order
    visual: Any = None
    deepstack: mx.array | None = None
    # Gemma 4's bidirectional images: per prompt token its image's index, -1 elsewhere
    blocks: np.ndarray | None = None


class VisionEncoder:
    def __init__(self, vlm: Any, family: str, lm_dtype: Any) -> None:
        self.vlm = vlm
        self.family = family
        self.mrope = FAMILIES[family]
        self.dtype = lm_dtype
        self.armed = _Hidden(positions=None, deepstack=None, blocks=None)
        self.audio: Any = None   # pipeserve.vision.audio.AudioProcessor: the audio tower's side
        # Gemma 4 26B / 31B: each image's tokens attend to each other both ways at prefill
        self.bidirectional = family in AUDIO_FAMILIES and G4.bidirectional(vlm)

    @classmethod
    def load(cls, path: Path, config: dict[str, Any], lm: Any) -> VisionEncoder:
        require_mlx_vlm(f"model.path '{path}'")
        from mlx.utils import tree_flatten, tree_map
        from mlx_vlm.utils import load_model

        family = config.get("model_type", "")
        if family not in FAMILIES:
            raise ConfigError(
                f"model.path '{path}' is a {family!r} vision-language model; pipeserve serves "
                f"the mlx-vlm families {', '.join(sorted(FAMILIES))} so far — serve it with "
                "mlx-vlm's own server, or a text-only checkpoint here")
        vlm = load_model(Path(path), lazy=True)
        inner = vlm.language_model
        embed = lm.language_model.model.embed_tokens
        # (Qwen3.5's gated delta layers have no attention, so no rope: its first attention
        # layer's rotary, as every attention layer's)
        rotary = (next(layer.self_attn.rotary_emb for layer in inner.model.layers
                       if "self_attn" in layer) if FAMILIES[family] else None)
        # the tower shares the served decoder's embedding; mlx-vlm's own decoder is never run,
        # so its layers (lazy, never read from disk) are dropped
        inner.model.embed_tokens = embed
        if getattr(inner.model, "embed_tokens_per_layer", None) is not None:   # gemma4
            inner.model.embed_tokens_per_layer = lm.language_model.model.embed_tokens_per_layer
        inner.model.layers = []
        lm_dtype = embed.weight.dtype if mx.issubdtype(embed.weight.dtype, mx.floating) else mx.float32
        towers = [m for name, m in vlm.children().items()
                  if name != "language_model" and isinstance(m, nn.Module)]
        for tower in towers:
            tower.update(tree_map(lambda a: a.astype(lm_dtype) if mx.issubdtype(a.dtype, mx.floating)
                                  else a, tower.parameters()))
            mx.eval(tower.parameters())
        encoder = cls(vlm, family, lm_dtype)
        encoder.processor = VisionProcessor(path, family)
        if (family in AUDIO_FAMILIES and getattr(vlm, "audio_tower", None) is not None
                and getattr(encoder.processor.proc, "feature_extractor", None) is not None):
            encoder.audio = AudioProcessor(encoder.processor.proc)
        if rotary is not None:
            for layer in lm.layers:
                if "self_attn" in layer:
                    attn = layer.self_attn
                    attn.rope = PositionedRope(attn.rope, rotary, encoder.armed)
        if encoder.bidirectional:
            G4.add_image_overlay(lm.language_model.model, encoder.armed)
        if family in DEEPSTACK_FAMILIES:
            for index in range(len(vlm.config.vision_config.deepstack_visual_indexes)):
                add_deepstack(lm.layers[index], index, encoder.armed)
        encoder.num_params = sum(v.size for t in towers for _, v in tree_flatten(t.parameters()))
        return encoder

    def embed(self, prompt_ids: list[int], pixels: dict[str, Any],
              tokens_per_image: list[int] | None = None, audio: Any = None) -> Embedded:
        """The prompt's input embeddings with its images' (or videos') features merged in
        (evaluated). `tokens_per_image` given: the images (videos) lie in a prefix the prompt
        cache already holds, so the tower is skipped (their positions get zeros no chunk reads).
        `audio`: (features, tokens per clip, cached) of its audio clips (pipeserve/vision/audio.py)."""
        t0 = time.perf_counter()
        ids = mx.array([prompt_ids], dtype=mx.int32)
        if self.family in AUDIO_FAMILIES:
            soft = None
            if audio is not None and not audio[2]:
                soft = A.encode(self.vlm, audio[0], audio[1], self.dtype)
            embeddings, per_layer = G4.embed(
                self.vlm, ids, {} if tokens_per_image is not None else pixels,
                self.processor.image_token_id, self.audio.token_id if self.audio else -1, soft)
            embeddings = embeddings.astype(self.dtype)
            mx.eval(embeddings, *([per_layer] if per_layer is not None else []))
            return Embedded(embeddings, None, time.perf_counter() - t0, per_layer)
        extra = {k: mx.array(v) for k, v in pixels.items() if k != "pixel_values"}
        if tokens_per_image is not None:
            width = self.vlm.language_model.model.embed_tokens.weight.shape[-1]
            shape = ((len(tokens_per_image), tokens_per_image[0], width) if not self.mrope
                     else (sum(tokens_per_image), width))
            extra["cached_image_features"] = mx.zeros(shape, dtype=self.dtype)
        images = pixels.get("pixel_values")   # absent: a video's (pixel_values_videos in extra)
        if mixed.takes_both(pixels) and self.family not in BOTH_KINDS:
            # images and videos: mlx-vlm's Qwen2-VL / Qwen2.5-VL / Qwen3.5 / Qwen3-VL-MoE take
            # one kind per prompt (its Qwen3-VL both, with their deepstack features)
            out = mixed.input_embeddings(self.vlm, ids, pixels, tokens_per_image is not None,
                                         self.dtype)
        else:
            out = self.vlm.get_input_embeddings(ids, None if images is None else mx.array(images),
                                                mask=mx.ones(ids.shape, dtype=mx.int32), **extra)
        embeddings = out.inputs_embeds[0].astype(self.dtype)
        visual, deepstack = None, getattr(out, "deepstack_visual_embeds", None)
        if deepstack is not None and len(deepstack):   # the tower ran (not on a cache hit),
            # with deepstack layers (a list of them, or one array when mlx-vlm merged kinds)
            visual = np.nonzero(np.array(out.visual_pos_masks[0]))[0]
            deepstack = mx.stack(list(deepstack)).astype(self.dtype)
            mx.eval(deepstack)
        positions = None
        if self.mrope:
            delta = out.rope_deltas.reshape(-1)[0]
            positions = out.position_ids - delta   # decode at cache offset == true position
            mx.eval(embeddings, positions)
        else:
            mx.eval(embeddings)
        return Embedded(embeddings, positions, time.perf_counter() - t0, visual=visual,
                        deepstack=deepstack)

    @contextmanager
    def chunk(self, embedded: Embedded, start: int, num: int) -> Iterator[dict[str, Any]]:
        """The model kwargs of one prompt chunk [start, start + num), positions armed for it."""
        if embedded.positions is not None:
            self.armed.positions = embedded.positions[:, :, start:start + num]
        if embedded.deepstack is not None:   # this chunk's visual tokens, if any
            inside = (embedded.visual >= start) & (embedded.visual < start + num)
            if inside.any():
                at = mx.array(embedded.visual[inside] - start, dtype=mx.uint32)
                rows = mx.array(np.nonzero(inside)[0], dtype=mx.uint32)
                self.armed.deepstack = (at, embedded.deepstack[:, rows])
        if embedded.blocks is not None:   # Gemma 4: this chunk's image spans, if any
            blocks = embedded.blocks[start:start + num]
            if (blocks >= 0).any():
                self.armed.blocks = mx.array(blocks)
        try:
            inputs = {"input_embeddings": embedded.embeddings[None, start:start + num]}
            if embedded.per_layer is not None:
                inputs["per_layer_inputs"] = embedded.per_layer[None, start:start + num]
            yield inputs
        finally:
            self.armed.positions = self.armed.deepstack = self.armed.blocks = None
