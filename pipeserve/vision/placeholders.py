"""A request's media into its prompt, for tokenize: the checks that refuse media this model
does not take, then each image decoded (caps, EXIF), each video's frames sampled, each audio
clip resampled, and the chat template's placeholders expanded to their tokens; the result is
the prompt text and its PromptMedia. On media's own threads (the preparation pool's media
side); never touches MLX."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeserve.vision import video
from pipeserve.vision.audio import AudioLimits, check_modalities, prepare_audio
from pipeserve.vision.config import MediaConfig
from pipeserve.vision.media import MediaLimits, MediaPart, decode_each
from pipeserve.vision.rows import PromptMedia


@dataclass(frozen=True)
class MediaPrep:
    vision: Any          # pipeserve.vision.encoder.VisionEncoder, or None (a text-only model)
    model_name: str
    media_limits: MediaLimits
    video_limits: video.VideoLimits
    audio_limits: AudioLimits

    @classmethod
    def of(cls, cfg: MediaConfig, vision: Any, model_name: str) -> MediaPrep:
        return cls(vision, model_name, MediaLimits.of(cfg), video.VideoLimits.of(cfg),
                   AudioLimits.of(cfg))

    def check(self, parts: list[MediaPart]) -> None:
        """Refuse a modality the model does not take (or this server does not serve for it)."""
        check_modalities(parts, self.vision, self.model_name)
        video.refuse_unserved(parts, self.vision, self.model_name)

    def expand(self, parts: list[MediaPart], text: str) -> tuple[str, PromptMedia]:
        """Decode the request's images (caps, EXIF), videos (sampled frames) and audio clips
        (caps, resampling), expand the template's placeholders."""
        images = [p for p in parts if p.kind == "image"]
        videos = [p for p in parts if p.kind == "video"]
        clips = [p for p in parts if p.kind == "audio"]
        media = PromptMedia(self.vision, {}, [], self.vision.processor.image_token_id)
        used = 0

        def each_image() -> Iterator[Any]:   # one full-size image alive at a time
            nonlocal used
            for decoded in decode_each(images, self.media_limits, started):
                media.digests.append(decoded.digest)
                used += decoded.nbytes
                yield decoded.image
                del decoded
        started = time.monotonic()
        if images:
            prepared = self.vision.processor.prepare(text, each_image(),
                                                     [p.where for p in images])
            text, media.pixels = prepared.text, prepared.pixels
            media.tokens_per_image = prepared.tokens_per_image
        if videos:
            text = video.attach(media, self.vision.processor, text, videos, self.video_limits,
                                used)
            used += sum(len(p.data or b"") for p in videos)
        if clips:
            text = prepare_audio(self.vision.audio, clips, text, media, self.audio_limits,
                                 self.media_limits.max_request_bytes, used)
        return text, media
