"""The `media` group's schema: what one request may send as images, video and audio, and
whether remote URLs are fetched. Imports no mlx: checked at launch."""
from __future__ import annotations

from dataclasses import dataclass, fields

from pipeserve.errors import check_positive as _positive


@dataclass
class MediaConfig:
    # images (models with a vision tower): caps per image and per request, remote URLs
    max_image_mb: float = 20.0        # decimal MB of one image's bytes
    max_image_pixels: int = 40_000_000  # width x height of one image, checked before decoding
    max_images: int = 16              # images in one request
    max_media_mb: float = 64.0        # decimal MB of all of one request's images
    allow_remote_media: bool = False  # fetch http(s) image URLs (else only data: URLs)
    allow_private_media: bool = False  # with remote media: also loopback/private/link-local hosts
    media_fetch_timeout_s: float = 10.0  # wall-clock seconds one remote image may take
    max_request_pixels: int = 100_000_000  # width x height of all of one request's images
    max_media_prepare_s: float = 60.0  # seconds preparing one request's media (checked per part)
    max_image_decode_s: float = 10.0  # wall-clock seconds decoding one image may take
    media_workers: int = 2            # threads preparing media, apart from text preparation
    max_media_queue: int = 8          # media requests waiting for those threads; more get 429
    # video (models whose processor takes video: Qwen2-VL / Qwen2.5-VL), sampled to frames
    video_fps: float = 2.0            # frames sampled per second of video
    max_video_frames: int = 32        # frames sampled from one video at most (evenly spread)
    max_video_mb: float = 50.0        # decimal MB of one video's bytes
    max_video_seconds: float = 300.0  # duration of one video (decoding reads every frame)
    max_video_pixels: int = 8_294_400  # width x height of a video's frames (3840x2160)
    max_videos: int = 4               # videos in one request
    max_video_decode_s: float = 30.0  # wall-clock seconds decoding one video's frames may take
    # audio (models with an audio tower): input_audio parts, caps per clip and per request
    max_audio_mb: float = 20.0        # decimal MB of one audio clip's bytes
    max_audio_s: float = 30.0         # seconds of one clip, checked before decoding
    max_audios: int = 8               # audio clips in one request
    max_request_audio_s: float = 120.0  # seconds of all of one request's clips, from headers

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                _positive(f"media.{f.name}", getattr(self, f.name), allow_none=False)
