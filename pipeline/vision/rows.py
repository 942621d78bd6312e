"""PromptMedia: what one request's images became — pixel arrays for the tower, their digests
(prompt-cache keys, the record) and the image-token count — and, once its prefill starts on the
engine thread, the prompt's input embeddings. Built by tokenize (no MLX); `chunk` runs on the
engine thread only."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PromptMedia:
    encoder: Any                     # pipeline.vision.encoder.VisionEncoder (engine thread only)
    pixels: dict[str, np.ndarray]
    digests: list[str]               # sha256 of each image's bytes, in prompt order
    image_token_id: int
    tokens_per_image: list[int] = field(default_factory=list)
    embedded: Any = None             # encoder.Embedded, from the row's first prompt chunk to
                                     # its last
    started: bool = False            # its prefill began (the tower ran, or was skipped)
    encode_s: float = 0.0            # vision-encoder seconds this request cost
    counted: bool = False            # its images are in the metrics (stages/prefill.py)
    # its audio clips (pipeline/vision/audio.py): per clip the log-mel features and valid-frame
    # mask, the sha256 of its bytes and its audio-token count, in prompt order
    audio_features: list[Any] = field(default_factory=list)
    audio_digests: list[str] = field(default_factory=list)
    tokens_per_audio: list[int] = field(default_factory=list)
    audio_token_id: int = -1
    audio_seconds: float = 0.0       # seconds of audio the request sent
    _key: list[int] | None = None    # key_ids, once made

    @property
    def encoded(self) -> bool:
        """Whether the tower ran for this request (not skipped on a prompt-cache hit)."""
        return self.started and self.encode_s > 0

    @property
    def num_images(self) -> int:
        return len(self.digests)

    @property
    def num_image_tokens(self) -> int:
        return sum(self.tokens_per_image)

    @property
    def num_audios(self) -> int:
        return len(self.audio_digests)

    @property
    def num_audio_tokens(self) -> int:
        return sum(self.tokens_per_audio)

    def key_ids(self, prompt_ids: list[int]) -> list[int]:
        """The prompt-cache key of the prompt: each image token replaced by an id outside the
        vocabulary derived from its image's digest (so the same image and prefix hit, another
        image never does); for M-RoPE models, whose stored prefix depends on every image's
        layout, the first token also carries all digests. Made once (the prompt is fixed)."""
        if self._key is not None and len(self._key) == len(prompt_ids):
            return self._key
        out = list(prompt_ids)
        spans = ((self.image_token_id, self.digests, self.tokens_per_image),
                 (self.audio_token_id, self.audio_digests, self.tokens_per_audio))
        for token_id, digests, counts in spans:
            marks = []
            for digest, n in zip(digests, counts):
                marks.extend([-1 - int(digest[:15], 16)] * n)
            it = iter(marks)
            for i, t in enumerate(out):
                if t == token_id:
                    out[i] = next(it, out[i])
        if self.encoder.mrope and out:
            import hashlib
            salt = hashlib.sha256(("|".join(self.digests)).encode()).hexdigest()
            out[0] = -(1 << 62) - int(salt[:15], 16)
        self._key = out
        return out

    def chunk(self, prompt_ids: list[int], start: int, num: int) -> AbstractContextManager[dict[str, Any]]:
        """The model kwargs of prompt chunk [start, start + num): the tower runs at the first;
        the embeddings are let go with the last (prompt chunks never repeat)."""
        if not self.started:
            self.started = True
            marks = (self.image_token_id, self.audio_token_id)
            last = max(i for i, t in enumerate(prompt_ids) if t in marks)
            cached = start > last   # a prompt-cache hit covers every image and clip: no tower
            audio = ((self.audio_features, self.tokens_per_audio, cached)
                     if self.audio_digests else None)
            self.embedded = self.encoder.embed(
                prompt_ids, self.pixels,
                self.tokens_per_image if cached and self.digests else None, audio)
            self.encode_s = 0.0 if cached else self.embedded.encode_s
            self.pixels, self.audio_features = {}, []
        embedded = self.embedded
        if start + num >= len(prompt_ids) - 1:
            self.embedded = None
        return self.encoder.chunk(embedded, start, num)
