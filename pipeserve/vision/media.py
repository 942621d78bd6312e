"""Media parts as clients send them (OpenAI image_url / input_image, Anthropic image blocks):
parsed on the event loop into MediaPart values, decoded with Pillow off the loop (the tokenize
stage's preparation pool) under per-image and per-request caps, EXIF orientation applied.
Every failure is an InvalidRequest naming the part (its JSON path) and the reason. No MLX."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.vision.fetch import fetch

FORMATS = "PNG, JPEG, WebP, AVIF, HEIC, GIF, BMP, TIFF"
_HEIF: list[bool] = []   # pillow-heif's opener registered (once, at the first decode)


def _register_heif() -> None:
    """HEIC/HEIF through pillow-heif (the vision extra), when it is installed."""
    if _HEIF:
        return
    try:
        from pillow_heif import register_heif_opener
        register_heif_opener()
    except ImportError:
        pass
    _HEIF.append(True)


@dataclass(slots=True)
class MediaPart:
    """One image (or audio clip) a message carries: its bytes (a data URL or base64 block) or a
    remote URL."""

    where: str                  # the part's JSON path, e.g. messages[0].content[1]
    data: bytes | None = None
    url: str | None = None      # http(s), fetched only when media.allow_remote_media
    kind: str = "image"         # or "video" (pipeserve/vision/video.py), "audio" (audio.py)


@dataclass(slots=True)
class MediaLimits:
    max_image_bytes: int
    max_image_pixels: int
    max_images: int
    max_request_bytes: int
    allow_remote: bool
    allow_private: bool
    fetch_timeout_s: float

    @classmethod
    def of(cls, media: Any) -> MediaLimits:
        return cls(int(media.max_image_mb * 1e6), int(media.max_image_pixels),
                   int(media.max_images), int(media.max_media_mb * 1e6),
                   media.allow_remote_media, media.allow_private_media,
                   media.media_fetch_timeout_s)


def from_url(url: Any, where: str, kind: str = "image") -> MediaPart:
    """An image (or video) URL: a base64 data URL (decoded here) or an http(s) URL (fetched
    later, when the server allows remote media)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where} needs {'an' if kind == 'image' else 'a'} {kind} URL "
                             f"string (a data: URL such as data:{kind}/<type>;base64,..., or "
                             "http(s) when the server allows remote media)", param=where)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest(f"{where} is a data URL that is not base64 "
                                 f"(expected data:{kind}/<type>;base64,<data>)", param=where)
        return MediaPart(where, data=_b64(payload, where, kind), kind=kind)
    if url.startswith(("http://", "https://")):
        return MediaPart(where, url=url, kind=kind)
    raise InvalidRequest(f"{where} has URL scheme {url.split(':', 1)[0]!r:.20}; {kind}s come as "
                         "data: URLs (or http(s) URLs when the server allows remote media)",
                         param=where)


def from_base64(data: Any, where: str) -> MediaPart:
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{where}.source.data must be a non-empty base64 string", param=where)
    return MediaPart(where, data=_b64(data, where))


def _b64(payload: str, where: str, kind: str = "image") -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"{where}: the {kind} data is not valid base64 ({e})",
                             param=where) from e


@dataclass(slots=True)
class Decoded:
    image: Any      # PIL.Image.Image, RGB, EXIF orientation applied
    digest: str     # sha256 of the bytes the client sent
    nbytes: int


def decode_all(parts: list[MediaPart], limits: MediaLimits) -> list[Decoded]:
    """Every part's image (fetching remote ones when allowed), caps checked. Blocking: call it
    off the event loop."""
    if len(parts) > limits.max_images:
        raise InvalidRequest(f"the request has {len(parts)} images; the limit is "
                             f"{limits.max_images} per request (media.max_images)",
                             param=parts[limits.max_images].where)
    out, total = [], 0
    for part in parts:
        data = part.data
        if data is None:
            assert part.url is not None
            data = fetch(part.url, part.where, limits)
        total += len(data)
        if total > limits.max_request_bytes:
            raise InvalidRequest(f"{part.where}: the request's images add up to more than "
                                 f"{limits.max_request_bytes} bytes (media.max_media_mb)",
                                 param=part.where)
        out.append(decode(data, part.where, limits))
    return out


def decode(data: bytes, where: str, limits: MediaLimits) -> Decoded:
    from PIL import Image, ImageOps, UnidentifiedImageError

    _register_heif()
    if len(data) > limits.max_image_bytes:
        raise InvalidRequest(f"{where}: the image is {len(data)} bytes; the limit is "
                             f"{limits.max_image_bytes} bytes per image (media.max_image_mb)",
                             param=where)
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_image_pixels:
                raise InvalidRequest(
                    f"{where}: the image is {width}x{height} = {width * height} pixels; the "
                    f"limit is {limits.max_image_pixels} pixels per image "
                    "(media.max_image_pixels)", param=where)
            img.load()
            rgb = ImageOps.exif_transpose(img).convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError, EOFError) as e:
        raise InvalidRequest(f"{where}: the image could not be decoded ({type(e).__name__}: "
                             f"{str(e)[:160]}); send {FORMATS}", param=where) from e
    return Decoded(rgb, hashlib.sha256(data).hexdigest(), len(data))
