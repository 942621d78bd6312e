"""Video inputs without a model: PyAV decoding and frame sampling — the same source frames,
pixel for pixel, as mlx-vlm's own OpenCV loader samples from the same file — under the byte,
duration, pixel, count and per-request caps, corrupt videos refused by part, and remote videos
fetched from a real HTTP server on 127.0.0.1 only when remote and private media are allowed."""
from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeserve.errors import InvalidRequest
from pipeserve.vision.media import MediaLimits, MediaPart
from pipeserve.vision.video import VideoLimits, decode, decode_all, from_url
from tests.media_util import encode_video, local_server

av = pytest.importorskip("av", reason="the vision extra: pip install -e '.[vision]'")
FACTOR, MIN_FRAMES = 2, 4   # Qwen-VL's temporal patch, its video processor's min_frames


def limits(**kw) -> VideoLimits:
    media = MediaLimits(max_image_bytes=1_000_000, max_image_pixels=1_000_000, max_images=4,
                        max_request_bytes=kw.pop("max_request_bytes", 10_000_000),
                        allow_remote=kw.pop("allow_remote", False),
                        allow_private=kw.pop("allow_private", False), fetch_timeout_s=5.0,
                        max_request_pixels=kw.pop("max_request_pixels", 100_000_000),
                        prepare_s=kw.pop("prepare_s", 60.0))
    base = dict(fps=2.0, max_frames=32, max_bytes=5_000_000, max_seconds=60.0, max_videos=2,
                max_frame_pixels=1_000_000)
    return VideoLimits(**{**base, **kw}, media=media)


def video(frames: int, fps: int, size: tuple[int, int] = (64, 48), codec: str = "libx264",
          fmt: str = "mp4", rotation: int = 0) -> bytes:
    return encode_video(frames, fps, size, codec=codec, fmt=fmt, rotation=rotation)


@pytest.mark.parametrize("frames,fps,max_frames,codec,fmt,rotation", [
    (12, 4, 32, "libx264", "mp4", 0),      # 3 s at 2 fps: 6 frames
    (7, 3, 32, "libx264", "mp4", 0),       # at least 4 (min_frames), a multiple of 2
    (40, 10, 32, "libvpx-vp9", "webm", 0),  # 8 frames over 4 s
    (40, 10, 4, "mpeg4", "mp4", 0),        # capped at media.max_video_frames, evenly spread
    (8, 4, 32, "libx264", "mp4", 90),      # a portrait phone video: shown upright
])
def test_frames_equal_mlx_vlms_own_sampling(tmp_path: Path, frames: int, fps: int,
                                            max_frames: int, codec: str, fmt: str,
                                            rotation: int) -> None:
    from mlx_vlm.utils import VideoSampling, load_video
    data = video(frames, fps, codec=codec, fmt=fmt, rotation=rotation)
    ours = decode(data, "p", limits(max_frames=max_frames), FACTOR, MIN_FRAMES)
    file = tmp_path / f"clip.{fmt}"
    file.write_bytes(data)
    theirs, meta = load_video(str(file), VideoSampling(fps=2.0, max_frames=max_frames,
                                                       min_frames=MIN_FRAMES))
    assert ours.frames.shape == theirs.shape and ours.frames.dtype == np.uint8
    assert np.array_equal(ours.frames, theirs)
    assert ours.source_frames == frames and len(ours.frames) <= max_frames
    assert ours.frames.shape[2:] == ((64, 48) if rotation else (48, 64))


def test_a_single_frame_video_keeps_its_frame() -> None:
    # (mlx-vlm's loader refuses it; the processor repeats the frame to fill the temporal patch)
    assert decode(video(1, 1), "p", limits(), FACTOR, MIN_FRAMES).frames.shape == (1, 3, 48, 64)


def test_caps_and_corrupt_videos_name_the_part() -> None:
    clip = video(12, 4)
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[2\]: the video could not be decoded"):
        decode(b"\x00\x00\x00\x18ftypmp42 not really", "messages[0].content[2]", limits(),
               FACTOR, MIN_FRAMES)
    with pytest.raises(InvalidRequest, match=r"p: the video could not be decoded \(InvalidDataError"):
        decode(clip[: len(clip) // 3], "p", limits(), FACTOR, MIN_FRAMES)
    with pytest.raises(InvalidRequest, match=r"p: the video is \d+ bytes; the limit is 1000 bytes"):
        decode(clip, "p", limits(max_bytes=1000), FACTOR, MIN_FRAMES)
    with pytest.raises(InvalidRequest, match=r"p: the video's frames are 64x48 = 3072 pixels; "
                                             r"the limit is 3000 .*media\.max_video_pixels"):
        decode(clip, "p", limits(max_frame_pixels=3000), FACTOR, MIN_FRAMES)
    with pytest.raises(InvalidRequest, match=r"p: the video is 3\.0 s long; the limit is 2 s"):
        decode(clip, "p", limits(max_seconds=2), FACTOR, MIN_FRAMES)
    parts = [MediaPart(f"m[{i}]", data=clip, kind="video") for i in range(3)]
    with pytest.raises(InvalidRequest, match=r"3 videos; the limit is 2 .*media\.max_videos"):
        decode_all(parts, limits(), FACTOR, MIN_FRAMES, 0)
    with pytest.raises(InvalidRequest, match=r"m\[1\]: the request's images and videos add up"):
        decode_all(parts[:2], limits(max_request_bytes=len(clip) + 10), FACTOR, MIN_FRAMES, 0)
    with pytest.raises(InvalidRequest, match=r"m\[0\]: the request's images and videos add up"):
        decode_all(parts[:1], limits(max_request_bytes=len(clip) + 10), FACTOR, MIN_FRAMES, 20)
    # 6 sampled frames of 64x48 per video: the second brings the request to 36864 pixels
    with pytest.raises(InvalidRequest, match=r"m\[1\]: the request's sampled video frames add "
                                             r"up to 36864 decoded pixels; the limit is 30000 "
                                             r"per request \(media\.max_request_pixels\)"):
        decode_all(parts[:2], limits(max_request_pixels=30_000), FACTOR, MIN_FRAMES, 0)
    with pytest.raises(InvalidRequest, match=r"m\[0\]: preparing this request's media took "
                                             r".*media\.max_media_prepare_s"):
        decode_all(parts[:1], limits(), FACTOR, MIN_FRAMES, 0, started=time.monotonic() - 61)
    with pytest.raises(InvalidRequest, match="scheme 'file'"):
        from_url("file:///etc/passwd", "p")
    with pytest.raises(InvalidRequest, match=r"p: the video data is not valid base64"):
        from_url("data:video/mp4;base64,@@@", "p")


def test_a_video_that_takes_too_long_to_decode_is_a_400_naming_the_part_and_the_key() -> None:
    """media.max_video_decode_s bounds one video's decoding in wall-clock time (a file built
    to decode slowly must not hold a preparation thread); within it, the same clip decodes."""
    clip = video(40, 10)
    with pytest.raises(InvalidRequest, match=r"m\[0\]\.content\[1\]: decoding the video took "
                                             r"longer than 1e-06 s.*media\.max_video_decode_s"):
        decode(clip, "m[0].content[1]", limits(max_decode_s=1e-6), FACTOR, MIN_FRAMES)
    assert decode(clip, "p", limits(max_decode_s=30), FACTOR, MIN_FRAMES).frames.shape[0] == 8


def test_a_file_without_a_video_stream() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(InvalidRequest, match=r"p: the file has no video stream"):
        decode(buf.getvalue(), "p", limits(), FACTOR, MIN_FRAMES)


@pytest.fixture(scope="module")
def local_videos() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving one MP4, stopped after."""
    with local_server({"/clip.mp4": (200, {"Content-Type": "video/mp4"}, video(12, 4))}) as url:
        yield url


def test_remote_fetch_policy(local_videos: str) -> None:
    part = from_url(f"{local_videos}/clip.mp4", "messages[0].content[0]")
    with pytest.raises(InvalidRequest, match=r"content\[0\] is a remote video URL.*allow_remote_media"):
        decode_all([part], limits(), FACTOR, MIN_FRAMES, 0)
    with pytest.raises(InvalidRequest, match=r"resolves to 127\.0\.0\.1, a loopback, private"):
        decode_all([part], limits(allow_remote=True), FACTOR, MIN_FRAMES, 0)
    got = decode_all([part], limits(allow_remote=True, allow_private=True), FACTOR, MIN_FRAMES, 0)
    assert got[0].frames.shape == (6, 3, 48, 64)
    with pytest.raises(InvalidRequest, match=r"remote video is larger than 1000 bytes \(media\.max_video_mb\)"):
        decode_all([part], limits(allow_remote=True, allow_private=True, max_bytes=1000),
                   FACTOR, MIN_FRAMES, 0)


def test_prompt_cache_keys_name_each_video_and_its_kind() -> None:
    """Video tokens are keyed by the video's digest; the same bytes sent as an image key apart."""
    from types import SimpleNamespace

    from pipeserve.vision.rows import PromptMedia
    IMG, VID = 7, 8   # the image and video token ids of this made-up prompt
    prompt = [1, 2, VID, VID, VID, 3]

    def key(videos: list[str] = (), images: list[str] = (), ids: list[int] = prompt,
            mrope: bool = True) -> list[int]:
        media = PromptMedia(SimpleNamespace(mrope=mrope), {}, list(images), IMG,
                            [ids.count(IMG)] * len(images), video_digests=list(videos),
                            tokens_per_video=[ids.count(VID)] * len(videos), video_token_id=VID)
        return media.key_ids(ids)

    a, b = "a" * 64, "b" * 64
    assert key([a]) == key([a])
    assert key([a])[2:5] != key([b])[2:5] and key([a])[0] != key([b])[0]
    assert key([a], mrope=False)[:2] == [1, 2] and all(t < 0 for t in key([a], mrope=False)[2:5])
    as_image = key(images=[a], ids=[1, 2, IMG, IMG, IMG, 3], mrope=False)
    assert as_image[2:5] != key([a], mrope=False)[2:5]
    assert key(images=[a], ids=[1, 2, IMG, IMG, IMG, 3])[0] != key([a])[0]
