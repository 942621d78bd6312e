"""PromptMedia: what one request's images became — pixel arrays for the tower, their digests
(prompt-cache keys, the record) and the image-token count — and, once its prefill starts on the
engine thread, the prompt's input embeddings. Built by tokenize (no MLX); `chunk` runs on the
engine thread only."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeserve.errors import InvalidRequest


@dataclass
class PromptMedia:
    encoder: Any                     # pipeserve.vision.encoder.VisionEncoder (engine thread only)
    pixels: dict[str, np.ndarray]
    digests: list[str]               # sha256 of each image's bytes, in prompt order
    image_token_id: int
    tokens_per_image: list[int] = field(default_factory=list)
    # videos (pipeserve/vision/video.py): digests, tokens and sampled frames of each, in order
    video_digests: list[str] = field(default_factory=list)
    tokens_per_video: list[int] = field(default_factory=list)
    video_frames: list[int] = field(default_factory=list)
    video_token_id: int = -1
    embedded: Any = None             # encoder.Embedded, from the row's first prompt chunk to
                                     # its last
    started: bool = False            # its prefill began (the tower ran, or was skipped)
    encode_s: float = 0.0            # vision-encoder seconds this request cost
    counted: bool = False            # its images are in the metrics (pipeserve/stages/prefill.py)
    # its audio clips (pipeserve/vision/audio.py): per clip the log-mel features and valid-frame
    # mask, the sha256 of its bytes and its audio-token count, in prompt order
    audio_features: list[Any] = field(default_factory=list)
    audio_digests: list[str] = field(default_factory=list)
    tokens_per_audio: list[int] = field(default_factory=list)
    audio_token_id: int = -1
    audio_seconds: float = 0.0       # seconds of audio the request sent
    # Gemma 4 26B / 31B without audio in the prompt: per prompt token its image's index, -1
    # elsewhere (each image's tokens attend to each other both ways at prefill)
    blocks: np.ndarray | None = None
    _key: list[int] | None = None    # key_ids, once made

    @property
    def _both_ways(self) -> bool:
        """It has images, on a model whose image tokens attend both ways (Gemma 4 26B, 31B)."""
        return bool(getattr(self.encoder, "bidirectional", False) and self.digests)

    @property
    def causal_images(self) -> bool:
        """Images on a bidirectional model kept causal: with audio in the prompt, as mlx-vlm's
        generate keeps them."""
        return self._both_ways and bool(self.audio_digests)

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
    def num_video_tokens(self) -> int:
        return sum(self.tokens_per_video)

    @property
    def num_audios(self) -> int:
        return len(self.audio_digests)

    @property
    def num_audio_tokens(self) -> int:
        return sum(self.tokens_per_audio)

    def check_tokens(self, prompt_ids: list[int]) -> None:
        """The encoded prompt holds exactly the image, video and audio tokens its media fill,
        and does not end in one (tokenize, after encoding); else a 400 saying which."""
        for token, count, need, noun, plural, article in (
                (self.image_token_id, self.num_images, self.num_image_tokens, "image", "images",
                 "an image"),
                (self.video_token_id, len(self.video_digests), self.num_video_tokens, "video",
                 "videos", "a video"),
                (self.audio_token_id, self.num_audios, self.num_audio_tokens, "audio",
                 "audio clips", "audio")):
            if not count and noun != "image":
                continue
            found = sum(1 for t in prompt_ids if t == token)
            if found != need or prompt_ids[-1] == token:
                raise InvalidRequest(
                    f"the prompt has {found} {noun} tokens where its {count} {plural} need "
                    f"{need} (a message's text spells the {noun} token, or the prompt ends in "
                    f"{article}); remove {noun} markup from the text", param="messages")
        if self._both_ways and not self.audio_digests:
            self.blocks = image_spans(prompt_ids, self.image_token_id)

    def whole_spans(self, pos: int, num: int) -> int:
        """`num`, moved so that prompt chunk [pos, pos + num) does not end inside an image whose
        tokens attend both ways: to the image's start when it starts inside the chunk, else to
        its end (the scheduler asks this of every chunk)."""
        blocks, end = self.blocks, pos + num
        if (blocks is None or end >= len(blocks) or blocks[end] < 0
                or blocks[end - 1] != blocks[end]):
            return num
        where = np.flatnonzero(blocks == blocks[end])
        return int(where[0]) - pos if where[0] > pos else int(where[-1]) + 1 - pos

    def key_ids(self, prompt_ids: list[int]) -> list[int]:
        """The prompt-cache key of the prompt: each image (video) token replaced by an id outside
        the vocabulary derived from its image's (video's) digest, so the same media and prefix
        hit, other media never do; for M-RoPE models, whose stored prefix depends on every
        image's layout, the first token also carries all digests. Made once (the prompt is
        fixed)."""
        if self._key is not None and len(self._key) == len(prompt_ids):
            return self._key
        marks: dict[int, Any] = {}   # images in [-2^60 - 1, -1], videos and audio below
        # images kept causal on a bidirectional model (pipeserve/vision/gemma4.py) have their
        # own marks: their KV differs from the same image's attended both ways
        image_base = -(3 << 60) if self.causal_images else -1
        for token, digests, counts, base in (   # (disjoint: the same bytes as two kinds differ)
                (self.image_token_id, self.digests, self.tokens_per_image, image_base),
                (self.video_token_id, self.video_digests, self.tokens_per_video, -(1 << 61)),
                (self.audio_token_id, self.audio_digests, self.tokens_per_audio, -(1 << 62))):
            ids = [base - int(d[:15], 16) for d, n in zip(digests, counts) for _ in range(n)]
            marks[token] = iter(ids)
        out = list(prompt_ids)
        for i, t in enumerate(out):
            if t in marks:
                out[i] = next(marks[t], out[i])
        if self.encoder.mrope and out:
            import hashlib
            names = "|".join(self.digests) + ("/" + "|".join(self.video_digests)
                                              if self.video_digests else "")
            salt = hashlib.sha256(names.encode()).hexdigest()
            out[0] = -(1 << 62) - int(salt[:15], 16)
        self._key = out
        return out

    def chunk(self, prompt_ids: list[int], start: int, num: int) -> AbstractContextManager[dict[str, Any]]:
        """The model kwargs of prompt chunk [start, start + num): the tower runs at the first;
        the embeddings are let go with the last (prompt chunks never repeat)."""
        if not self.started:
            self.started = True
            marks = (self.image_token_id, self.video_token_id, self.audio_token_id)
            last = max(i for i, t in enumerate(prompt_ids) if t in marks)
            cached = start > last   # a prompt-cache hit covers every image, video and clip
            audio = ((self.audio_features, self.tokens_per_audio, cached)
                     if self.audio_digests else None)
            visual = self.tokens_per_image + self.tokens_per_video
            self.embedded = self.encoder.embed(prompt_ids, self.pixels,
                                               visual if cached and visual else None, audio)
            self.encode_s = 0.0 if cached else self.embedded.encode_s
            self.pixels, self.audio_features = {}, []
            self.embedded.blocks = self.blocks
        embedded = self.embedded
        if start + num >= len(prompt_ids) - 1:
            self.embedded = None
        return self.encoder.chunk(embedded, start, num)


def image_spans(prompt_ids: list[int], image_token: int) -> np.ndarray:
    """Per prompt token the index of the image it belongs to (a run of image tokens), -1 for
    every other token."""
    is_image = np.asarray(prompt_ids) == image_token
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1)
