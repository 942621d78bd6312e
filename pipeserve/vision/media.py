"""Media parts as clients send them (OpenAI image_url / input_image, Anthropic image blocks):
parsed on the event loop into MediaPart values, decoded with Pillow off the loop (the tokenize
stage's preparation pool) under per-image and per-request caps, EXIF orientation applied.
Every failure is an InvalidRequest naming the part (its JSON path) and the reason. No MLX."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.vision.fetch import fetch

FORMATS = "PNG, JPEG, WebP, AVIF, HEIC, GIF, BMP, TIFF"
# Pillow's plugin names for FORMATS: no other opener is tried (EPS would start Ghostscript)
OPENERS = ("PNG", "JPEG", "WEBP", "AVIF", "HEIF", "GIF", "BMP", "TIFF")
# data: URL subtypes each Pillow format answers to
SUBTYPES = {"PNG": {"png", "apng"}, "JPEG": {"jpeg", "jpg", "pjpeg"}, "WEBP": {"webp"},
            "AVIF": {"avif"}, "HEIF": {"heic", "heif", "heic-sequence", "heif-sequence"},
            "GIF": {"gif"}, "BMP": {"bmp", "x-bmp", "x-ms-bmp"}, "TIFF": {"tiff", "tif"}}
# what Pillow's openers raise on bad bytes (UnidentifiedImageError is an OSError), besides
# Image.DecompressionBombError
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError,
                 struct.error, ZeroDivisionError, MemoryError, RuntimeError)
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
    mime: str | None = None     # the type a data: URL (or an Anthropic block) declares


@dataclass(slots=True)
class MediaLimits:
    max_image_bytes: int
    max_image_pixels: int
    max_images: int
    max_request_bytes: int
    allow_remote: bool
    allow_private: bool
    fetch_timeout_s: float
    max_request_pixels: int = 100_000_000
    prepare_s: float = 60.0
    decode_s: float = 10.0

    @classmethod
    def of(cls, media: Any) -> MediaLimits:
        return cls(int(media.max_image_mb * 1e6), int(media.max_image_pixels),
                   int(media.max_images), int(media.max_media_mb * 1e6),
                   media.allow_remote_media, media.allow_private_media,
                   media.media_fetch_timeout_s, int(media.max_request_pixels),
                   float(media.max_media_prepare_s), float(media.max_image_decode_s))


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
        mime = head[5:].split(";", 1)[0].strip().lower() or None
        return MediaPart(where, data=_b64(payload, where, kind), kind=kind, mime=mime)
    if url.startswith(("http://", "https://")):
        return MediaPart(where, url=url, kind=kind)
    raise InvalidRequest(f"{where} has URL scheme {url.split(':', 1)[0]!r:.20}; {kind}s come as "
                         "data: URLs (or http(s) URLs when the server allows remote media)",
                         param=where)


def from_base64(data: Any, where: str, mime: Any = None) -> MediaPart:
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{where}.source.data must be a non-empty base64 string", param=where)
    return MediaPart(where, data=_b64(data, where),
                     mime=mime.strip().lower() if isinstance(mime, str) and mime else None)


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
    return list(decode_each(parts, limits))


def decode_each(parts: list[MediaPart], limits: MediaLimits,
                started: float | None = None) -> Iterator[Decoded]:
    """Each part's image in turn (a caller that lets go of one before taking the next holds one
    full-size image at a time), under the per-request caps: images, bytes, decoded pixels, and
    the preparation budget since `started` (checked between images)."""
    if len(parts) > limits.max_images:
        raise InvalidRequest(f"the request has {len(parts)} images; the limit is "
                             f"{limits.max_images} per request (media.max_images)",
                             param=parts[limits.max_images].where)
    started = time.monotonic() if started is None else started
    header_s = _check_sizes(parts, limits, started + limits.prepare_s)
    total = pixels = 0
    for part, spent in zip(parts, header_s):
        check_budget(started, limits.prepare_s, part.where)
        data = part.data
        if data is None:
            assert part.url is not None
            data = fetch(part.url, part.where, limits)
        total += len(data)
        if total > limits.max_request_bytes:
            raise InvalidRequest(f"{part.where}: the request's images add up to more than "
                                 f"{limits.max_request_bytes} bytes (media.max_media_mb)",
                                 param=part.where)
        decoded = decode(data, part.where, limits, pixels, part.mime,
                         started + limits.prepare_s, spent)
        pixels += decoded.image.width * decoded.image.height
        yield decoded
        del decoded, data   # not held while the next image decodes


def _check_sizes(parts: list[MediaPart], limits: MediaLimits,
                 budget_end: float) -> list[float]:
    """The request's inline images' sizes, read from their headers only, against the decoded
    pixel budget: a request past it is refused before any image is decoded. (Unreadable
    headers are left to decode, which names the error.) Returns the seconds each header took,
    which count against that image's decode time."""
    from PIL import Image

    _register_heif()
    pixels, spent = 0, []
    for part in parts:
        began = time.monotonic()
        if part.data is not None and len(part.data) <= limits.max_image_bytes:
            try:
                source = DeadlineReader(part.data, part.where, limits, budget_end)
                with Image.open(source, formats=OPENERS) as img:
                    _check_size(img, part.where, limits, pixels)
                    pixels += img.size[0] * img.size[1]
            except (*DECODE_ERRORS, Image.DecompressionBombError):   # decode() names it
                pass
        spent.append(time.monotonic() - began)
    return spent


def check_budget(started: float, budget_s: float, where: str) -> None:
    """Refuse a request whose media preparation has run past media.max_media_prepare_s."""
    spent = time.monotonic() - started
    if spent > budget_s:
        raise InvalidRequest(f"{where}: preparing this request's media took {spent:.1f} s; the "
                             f"budget is {budget_s:g} s per request (media.max_media_prepare_s) "
                             "— send fewer or smaller media", param=where)


def decode(data: bytes, where: str, limits: MediaLimits, used_pixels: int = 0,
           mime: str | None = None, budget_end: float = math.inf,
           spent_s: float = 0.0) -> Decoded:
    """One image, RGB, EXIF orientation applied; its size checked (alone and with the request's
    `used_pixels`) before its pixels are decoded, its format against the listed ones and
    against the data URL's declared type; its decoding ended at media.max_image_decode_s less
    `spent_s` (its header's reading so far), or at `budget_end`, the request's media budget."""
    from PIL import Image, ImageOps

    _register_heif()
    if len(data) > limits.max_image_bytes:
        raise InvalidRequest(f"{where}: the image is {len(data)} bytes; the limit is "
                             f"{limits.max_image_bytes} bytes per image (media.max_image_mb)",
                             param=where)
    source = DeadlineReader(data, where, limits, budget_end, spent_s)
    try:
        with Image.open(source, formats=OPENERS) as img:
            _check_size(img, where, limits, used_pixels)
            _check_mime(img.format, mime, where)
            img.decodermaxblock = DECODE_BLOCK
            img.load()
            rgb = ImageOps.exif_transpose(img).convert("RGB")
    except InvalidRequest:
        raise
    except (*DECODE_ERRORS, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"{where}: the image could not be decoded ({type(e).__name__}: "
                             f"{str(e)[:160]}); send {FORMATS}", param=where) from e
    return Decoded(rgb, hashlib.sha256(data).hexdigest(), len(data))


# Bytes the decoders take per call: between calls the deadline is checked. A JPEG scan can be a
# few bytes that walk every block of the image, so a block holds at most a few hundred of them.
DECODE_BLOCK = 4096


class DeadlineReader(io.BytesIO):
    """An image's bytes as Pillow's decoders read them, a block at a time; a read after the
    deadline ends the decode with a 400 (an image built to be slow, such as a JPEG of thousands
    of scans, costs far more time than its bytes and pixels suggest)."""

    def __init__(self, data: bytes, where: str, limits: MediaLimits,
                 budget_end: float = math.inf, spent_s: float = 0.0) -> None:
        super().__init__(data)
        self.where, self.limits = where, limits
        self.deadline = min(time.monotonic() + limits.decode_s - spent_s, budget_end)

    def read(self, size: int | None = -1) -> bytes:
        if time.monotonic() > self.deadline:
            raise InvalidRequest(
                f"{self.where}: decoding the image took longer than {self.limits.decode_s:g} s, "
                "the limit per image (media.max_image_decode_s), or ran past the request's "
                f"{self.limits.prepare_s:g} s (media.max_media_prepare_s); send a smaller or "
                "plainer image", param=self.where)
        return super().read(size)


def _check_size(img: Any, where: str, limits: MediaLimits, used_pixels: int) -> None:
    width, height = img.size
    if width * height > limits.max_image_pixels:
        raise InvalidRequest(
            f"{where}: the image is {width}x{height} = {width * height} pixels; the "
            f"limit is {limits.max_image_pixels} pixels per image "
            "(media.max_image_pixels)", param=where)
    if used_pixels + width * height > limits.max_request_pixels:
        raise InvalidRequest(
            f"{where}: the image is {width}x{height} = {width * height} pixels, which "
            f"brings the request's images to {used_pixels + width * height} decoded "
            f"pixels; the limit is {limits.max_request_pixels} per request "
            "(media.max_request_pixels)", param=where)


def _check_mime(fmt: str | None, mime: str | None, where: str) -> None:
    """A declared image type must name the format the bytes are in."""
    if mime is None or not mime.startswith("image/") or fmt not in SUBTYPES:
        return
    if mime.removeprefix("image/") not in SUBTYPES[fmt]:
        raise InvalidRequest(f"{where} declares {mime[:40]} but its bytes are a {fmt} image; "
                             "send the image's own type", param=where)
