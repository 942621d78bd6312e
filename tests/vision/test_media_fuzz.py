"""The media fuzz: images (every listed format) and audio clips (WAV, FLAC, MP3) with bit flips,
truncations and header rewrites, through the real decoders. Each input either decodes or is an
InvalidRequest naming the part: anything else would reach the client as a 500. Seeded, a few
thousand inputs, small images (bounded in time and memory)."""
from __future__ import annotations

import io
import random
import struct
import wave

import numpy as np
import pytest
from PIL import Image

from pipeserve.errors import InvalidRequest
from pipeserve.vision import audio
from pipeserve.vision.media import MediaLimits, decode

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")

LIMITS = MediaLimits(max_image_bytes=2_000_000, max_image_pixels=4_000_000, max_images=4,
                     max_request_bytes=4_000_000, allow_remote=False, allow_private=False,
                     fetch_timeout_s=5.0, max_request_pixels=8_000_000)
AUDIO = audio.AudioLimits(max_clip_bytes=2_000_000, max_seconds=5.0, max_clips=2)
IMAGE_FORMATS = ["PNG", "JPEG", "WEBP", "AVIF", "GIF", "BMP", "TIFF"]


def _image(fmt: str, rng: random.Random) -> bytes:
    pixels = np.frombuffer(rng.randbytes(32 * 24 * 3), dtype=np.uint8).reshape(24, 32, 3)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _wav(rate: int, rng: random.Random) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(rng.randbytes(2 * rate // 10))
    return buf.getvalue()


def _flac(rng: random.Random) -> bytes:
    from tests.vision.test_audio_decode import encoded
    return encoded("flac", "flac", 0.2 * np.sin(np.arange(2205) / 7.0) + 0.01 * rng.random(), 22050)


def mutations(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    """Bit flips, truncations, and rewrites of the first 64 bytes (where headers live)."""
    out = []
    for i in range(count):
        b = bytearray(data)
        kind = i % 4
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b = b[:rng.randrange(1, len(b))]
        elif kind == 2:
            at = rng.randrange(min(64, len(b) - 4))
            b[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF,
                                                         rng.getrandbits(32)]))
        else:
            at = rng.randrange(min(64, len(b)))
            b[at] = rng.randrange(256)
        out.append(bytes(b))
    return out


def _outcome(fn: object, *args: object) -> str:
    try:
        fn(*args)   # type: ignore[operator]
    except InvalidRequest as e:
        assert e.param == "messages[0].content[0]", e.param
        assert e.message.startswith("messages[0].content[0]"), e.message
        return "400"
    return "ok"


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_mutated_images_decode_or_are_400s(fmt: str) -> None:
    rng = random.Random(fmt)
    seen = {"ok": 0, "400": 0}
    for data in mutations(_image(fmt, rng), rng, 300):
        seen[_outcome(decode, data, "messages[0].content[0]", LIMITS)] += 1
    assert seen["400"] > 0 and sum(seen.values()) == 300


@pytest.mark.parametrize("kind", ["wav", "wav_odd_rate", "flac"])
def test_mutated_audio_decodes_or_is_a_400(kind: str) -> None:
    rng = random.Random(kind)
    data = (_flac(rng) if kind == "flac"
            else _wav(44_100 if kind == "wav" else 44_101, rng))
    seen = {"ok": 0, "400": 0}
    for clip in mutations(data, rng, 200):
        seen[_outcome(audio.decode, clip, "messages[0].content[0]", AUDIO, 16_000, 30.0)] += 1
    assert seen["400"] > 0 and sum(seen.values()) == 200


def test_a_flac_with_sample_rate_zero_is_a_400() -> None:
    data = bytearray(_flac(random.Random(0)))
    # STREAMINFO follows "fLaC" + a 4-byte block header; the 20-bit rate starts at its byte 10
    at = 4 + 4 + 10
    data[at] = 0
    data[at + 1] = 0
    data[at + 2] &= 0x0F
    with pytest.raises(InvalidRequest, match=r"content\[0\]"):
        audio.decode(bytes(data), "messages[0].content[0]", AUDIO, 16_000, 30.0)
