"""Audio parts decoded (pipeserve/vision/audio.py), without a model: WAV, MP3 and FLAC come out
sample for sample as mlx-vlm's own load_audio reads the same file (so served audio equals
mlx-vlm's generate); every cap and every malformed part is an InvalidRequest naming the part."""
from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
import pytest

from pipeserve.errors import InvalidRequest
from pipeserve.vision.audio import AudioLimits, decode, decode_all, from_input_audio
from pipeserve.vision.media import MediaPart

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")

LIMITS = AudioLimits(max_clip_bytes=1_000_000, max_seconds=2.0, max_clips=2)
TONE = 0.3 * np.sin(2 * np.pi * 440 * np.arange(22050) / 22050)   # 1 s at 22.05 kHz


def encoded(codec: str, fmt: str, samples: np.ndarray = TONE, rate: int = 22050) -> bytes:
    """`samples` as an MP3 or FLAC file, encoded in memory with PyAV."""
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((samples[None, :] * 32767).astype(np.int16),
                                           format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def wav(samples: np.ndarray = TONE, rate: int = 22050) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3"])
def test_decoded_as_mlx_vlm_loads_the_file(kind: str, tmp_path: Path) -> None:
    from mlx_vlm.utils import load_audio
    data = wav() if kind == "wav" else encoded("flac" if kind == "flac" else "libmp3lame", kind)
    file = tmp_path / f"clip.{kind}"
    file.write_bytes(data)
    clip = decode(data, "messages[0].content[0]", LIMITS, 16000, 30.0)
    assert clip.seconds == pytest.approx(1.0, abs=0.06)
    assert clip.waveform.dtype == np.float32 and clip.waveform.shape == (16000,)
    assert np.array_equal(clip.waveform, load_audio(str(file), 16000))


def test_caps_and_malformed_clips_name_the_part() -> None:
    where = "messages[1].content[2]"
    cases = [
        (wav()[:44] + b"\x00" * 8, "0.2 ms long; the shortest clip this model takes is 40 ms"),
        (b"RIFF\x00\x00\x00\x00WAVEjunk" * 3, "WAV audio could not be decoded"),
        (b"\x00\x01 not audio", "are not WAV, MP3 or FLAC"),
        (wav(np.zeros(22050 * 3)), "3.00 s long; the limit is 2 s per clip (media.max_audio_s)"),
        (b"x" * 1_000_001, "1000001 bytes; the limit is 1000000 bytes per clip"),
    ]
    for data, reason in cases:
        with pytest.raises(InvalidRequest) as e:
            decode(data, where, LIMITS, 16000, 30.0, 0.04)
        assert str(e.value).startswith(where) and reason in str(e.value), str(e.value)
    with pytest.raises(InvalidRequest, match=r"1\.00 s long; the limit is 0\.5 s per clip "
                                             r"\(the model's longest clip\)"):
        decode(wav(), where, LIMITS, 16000, 0.5)
    parts = [MediaPart(f"messages[0].content[{i}]", data=wav(), kind="audio") for i in range(3)]
    with pytest.raises(InvalidRequest, match=r"3 audio clips; the limit is 2 per request"):
        decode_all(parts, LIMITS, 16000, 30.0, 10**9)
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[1\]: the request's media "
                                             r"add up to more than"):
        decode_all(parts[:2], LIMITS, 16000, 30.0, len(wav()) + 10, used_bytes=5)
    # the request's seconds: the clip that passes the budget is refused from its header
    short = AudioLimits(max_clip_bytes=1_000_000, max_seconds=2.0, max_clips=4,
                        max_request_seconds=2.5)
    with pytest.raises(InvalidRequest) as e:
        decode_all(parts, short, 16000, 30.0, 10**9)
    assert e.value.param == "messages[0].content[2]"
    assert ("the audio is 1.00 s long, which brings the request's audio to 3.00 s; the limit is "
            "2.5 s per request (media.max_request_audio_s)") in str(e.value)
    assert len(decode_all(parts[:2], short, 16000, 30.0, 10**9)) == 2


def test_input_audio_parts_parsed_or_refused() -> None:
    where = "messages[0].content[1]"
    data = wav()
    part = from_input_audio({"data": base64.b64encode(data).decode(), "format": "wav"}, where)
    assert part.kind == "audio" and part.data == data and part.where == where
    dataurl = "data:audio/wav;base64," + base64.b64encode(data).decode()
    assert from_input_audio({"data": dataurl}, where).data == data
    for obj, reason in [("UklGRg==", "must be an object"), ({"format": "wav"}, "non-empty base64"),
                        ({"data": "@@", "format": "wav"}, "not valid base64"),
                        ({"data": "UklGRg==", "format": "aac"}, "format is 'aac'")]:
        with pytest.raises(InvalidRequest) as e:
            from_input_audio(obj, where)
        assert str(e.value).startswith(where) and reason in str(e.value), str(e.value)


def test_an_odd_sample_rate_resamples_in_bounded_memory() -> None:
    """A 50 ms WAV at 383,999 Hz: its reduced rate ratio would size a polyphase filter of tens
    of millions of taps (gigabytes); it comes out at 16 kHz, the tone kept, in a few MB."""
    import tracemalloc
    rate = 383_999
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(rate // 20) / rate)
    tracemalloc.start()
    clip = decode(wav(tone, rate), "messages[0].content[0]", LIMITS, 16000, 30.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20_000_000, peak
    assert clip.waveform.shape == (800,) and clip.waveform.dtype == np.float32
    reference = 0.3 * np.sin(2 * np.pi * 440 * np.arange(800) / 16000)
    assert np.abs(clip.waveform[50:-50] - reference[50:-50]).max() < 0.01
