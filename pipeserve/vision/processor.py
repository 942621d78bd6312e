"""VisionProcessor: a vision-language checkpoint's image processor (mlx-vlm's, numpy out) and
its prompt expansion — each image placeholder of the rendered chat becomes the image tokens
the vision tower's features fill, as the family's mlx-vlm processor writes them. Runs on the
preparation pool (never touches MLX); built once at load."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeserve.errors import InvalidRequest


@dataclass
class Prepared:
    text: str                              # the rendered prompt, placeholders expanded
    pixels: dict[str, np.ndarray]          # pixel_values (+ image_grid_thw) for the tower
    tokens_per_image: list[int] = field(default_factory=list)


class VisionProcessor:
    def __init__(self, path: Path, family: str) -> None:
        from mlx_vlm.utils import load_processor

        self.family = family
        proc = load_processor(Path(path))
        self.proc = proc   # the whole processor (pipeserve/vision/audio.py reads its audio side)
        self.image_processor = proc.image_processor
        tok = proc.tokenizer
        if family == "gemma3":
            self.placeholder = tok.boi_token
            self.image_token = tok.image_token
            self.expansion = proc.full_image_sequence
        elif family == "gemma4":   # an image's token count follows its aspect ratio
            self.placeholder = self.image_token = proc.image_token
            self.boi, self.eoi = proc.boi_token, proc.eoi_token
        else:   # qwen2_vl / qwen2_5_vl / qwen3_vl
            self.placeholder = self.image_token = tok.image_token if hasattr(
                tok, "image_token") else "<|image_pad|>"
            self.merge = int(getattr(self.image_processor, "merge_size", 2))
        self.image_token_id = int(tok.convert_tokens_to_ids(self.image_token))
        # video: mlx-vlm's numpy video processor where the family has one (Qwen-VL; not Gemma 3)
        self.video_processor = (getattr(proc, "video_processor", None)
                                if family != "gemma4" else None)   # gemma4: images and audio
        self.video_token = getattr(proc, "video_token", None)
        self.video_token_id = (int(tok.convert_tokens_to_ids(self.video_token))
                               if self.video_processor is not None else -1)

    def prepare(self, text: str, images: Iterable[Any], where: list[str]) -> Prepared:
        """`images` (one per entry of `where`, possibly a generator) through the image
        processor one at a time: each image's copies are freed before the next is taken."""
        found = text.count(self.placeholder)
        if found != len(where):
            raise InvalidRequest(
                f"the chat template wrote {found} image placeholders for {len(where)} images; "
                "each image part must be inside a message the template renders",
                param=where[0] if where else "messages")
        if self.family == "gemma4":
            return self._prepare_gemma4(text, images)
        outs = []
        for image in images:
            outs.append(self.image_processor(images=[image], return_tensors="np"))
            del image   # let go before the generator decodes the next one
        out = {key: np.concatenate([np.asarray(o[key]) for o in outs])
               for key in ("pixel_values", "image_grid_thw") if key in outs[0]}
        if self.family == "gemma3":
            pixels = {"pixel_values": out["pixel_values"]}
            count = self.expansion.count(self.image_token)
            return Prepared(text.replace(self.placeholder, self.expansion), pixels,
                            [count] * len(outs))
        grid = np.asarray(out["image_grid_thw"])
        counts = [int(np.prod(g)) // (self.merge ** 2) for g in grid]
        pieces = text.split(self.placeholder)
        expanded = pieces[0] + "".join(self.image_token * n + rest
                                       for n, rest in zip(counts, pieces[1:]))
        return Prepared(expanded, {"pixel_values": np.asarray(out["pixel_values"]),
                                   "image_grid_thw": grid}, counts)

    def _prepare_gemma4(self, text: str, images: Iterable[Any]) -> Prepared:
        """mlx-vlm's Gemma4Processor: each image resized to its own token count, its
        placeholder expanded to begin, that many image tokens, end; pixels one key per image
        (their shapes differ)."""
        pixels, counts = {}, []
        for i, image in enumerate(images):
            data, (count,) = self.image_processor([image])
            del image
            pixels[f"pixel_values_{i}"] = np.asarray(data["pixel_values"])
            counts.append(int(count))
        spans = iter(self.boi + self.image_token * n + self.eoi for n in counts)
        expanded = re.sub(re.escape(self.placeholder), lambda _: next(spans), text)
        return Prepared(expanded, pixels, counts)
