"""The reproducibility record: what a response ran under — config hash, model id and
fingerprint, KV scheme, draft method, scheduling lane, the adapter, and the batch size it
decoded at. Sent in the `x-pipeserve-record` header and in JSON bodies' `usage.pipeserve`.
Event loop."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from pipeserve.config import ServeConfig
from pipeserve.core.config import SerialSchedulerConfig

HEADER = "x-pipeserve-record"


@dataclass(frozen=True, slots=True)
class Record:
    config_hash: str
    model_fingerprint: str | None   # None until the model is loaded
    kv_scheme: str                  # kv group option (cfg.kv.name)
    draft: str                      # draft group option (cfg.draft.name)
    lane: str                       # serial | continuous
    model: str | None = None        # the model id (model.name; a pool member's id)
    adapter: str | None = None      # the request's adapter as id@digest; absent when none
    batch_size: int | None = None   # most rows decoded together while this request decoded
    images: str | None = None       # the request's images as sha256:<digest>, comma-separated
    image_tokens: int | None = None  # of its prompt tokens, those carrying image features
    vision_encoder_s: float | None = None  # its vision-tower seconds (0: a cache hit held them)
                                           # (its audio tower's too)
    videos: str | None = None       # the request's videos as sha256:<digest>, comma-separated
    video_frames: int | None = None  # frames sampled from them, all together
    video_tokens: int | None = None  # of its prompt tokens, those carrying video features
    audios: str | None = None       # the request's audio clips as sha256:<digest>, comma-separated
    audio_tokens: int | None = None  # of its prompt tokens, those carrying audio features
    audio_s: float | None = None    # seconds of audio it sent

    def body(self) -> dict[str, Any]:
        # by name, not dataclasses.asdict: no deep copy (every field is a str or a number)
        return {k: v for k in _FIELDS if (v := getattr(self, k)) is not None}

    def header(self) -> str:
        """`key=value;...`, keys as in the body; absent fields (unknown yet) are left out."""
        return ";".join(f"{k}={v}" for k, v in self.body().items())

    def with_batch_size(self, batch_size: int | None) -> Record:
        return replace(self, batch_size=batch_size)

    def with_media(self, media: Any) -> Record:
        """The record of a request with images, videos or audio (Request.media), naming each by its
        digest."""
        if media is None:
            return self
        out = replace(self, vision_encoder_s=round(media.encode_s, 4))
        if media.digests:
            out = replace(out, images=",".join(f"sha256:{d}" for d in media.digests),
                          image_tokens=media.num_image_tokens)
        if media.video_digests:
            out = replace(out, videos=",".join(f"sha256:{d}" for d in media.video_digests),
                          video_frames=sum(media.video_frames), video_tokens=media.num_video_tokens)
        if media.audio_digests:
            out = replace(out, audios=",".join(f"sha256:{d}" for d in media.audio_digests),
                          audio_tokens=media.num_audio_tokens,
                          audio_s=round(media.audio_seconds, 3))
        return out

    def with_adapter(self, adapters: Any, choice: str | None) -> Record:
        """The record of a request that chose `choice` (Request.adapter) among `adapters`
        (the model's AdapterSet, or None: no adapters mounted)."""
        if adapters is None:
            return self
        return replace(self, adapter=adapters.identity(choice))


def base_record(cfg: ServeConfig, config_hash: str, fingerprint: str | None,
                adapter: str | None = None) -> Record:
    lane = "serial" if isinstance(cfg.scheduler, SerialSchedulerConfig) else "continuous"
    return Record(config_hash=config_hash, model_fingerprint=fingerprint,
                  kv_scheme=cfg.kv.name, draft=cfg.draft.name,
                  lane=lane, model=cfg.model.name, adapter=adapter)


_FIELDS = tuple(f.name for f in fields(Record))
