"""Video in (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5): `video_url` / `input_video` parts,
decoded with PyAV off the event loop (the tokenize stage's preparation pool) under byte,
duration, pixel and frame caps, sampled to frames at media.video_fps the way mlx-vlm's
load_video samples them (evenly spaced source frame indices, a multiple of the model's
temporal patch), then turned into the model's `pixel_values_videos` / `video_grid_thw` and
`<|video_pad|>` tokens (Qwen3: in timestamped blocks) by the checkpoint's own (mlx-vlm,
numpy) video processor. Every failure is an InvalidRequest naming the part. No MLX."""
from __future__ import annotations

import hashlib
import io
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeserve.errors import InvalidRequest
from pipeserve.vision.media import MediaLimits, MediaPart, from_url as media_url
from pipeserve.vision.fetch import fetch
from pipeserve.vision.media import check_budget

KINDS = ("video_url", "input_video", "video")   # the part types that carry a video
INSTALL = "pip install 'pipeserve[vision]'   (or: pip install av)"


@dataclass(slots=True)
class VideoLimits:
    fps: float
    max_frames: int
    max_bytes: int
    max_seconds: float
    max_videos: int
    max_frame_pixels: int
    media: MediaLimits             # the per-request byte cap and the remote-URL rules
    max_decode_s: float = 30.0     # wall clock for one video's probe and frame decoding

    @classmethod
    def of(cls, media: Any) -> VideoLimits:
        return cls(float(media.video_fps), int(media.max_video_frames),
                   int(media.max_video_mb * 1e6), float(media.max_video_seconds),
                   int(media.max_videos), int(media.max_video_pixels), MediaLimits.of(media),
                   float(media.max_video_decode_s))


def part_url(part: dict[str, Any]) -> Any:
    """The URL a video part carries, in the shapes vLLM and mlx-vlm's server take:
    {"type": "video_url", "video_url": {"url": ...}} (or a string), {"type": "input_video",
    "video_url" | "video": ...}, {"type": "video", "video": ...}."""
    url = part.get("video_url", part.get("video"))
    return url.get("url") if isinstance(url, dict) else url


def from_url(url: Any, where: str) -> MediaPart:
    """A video URL: a base64 data URL (decoded here) or an http(s) URL (fetched later)."""
    return media_url(url, where, kind="video")


@dataclass(slots=True)
class DecodedVideo:
    frames: np.ndarray      # (T, C, H, W) uint8 RGB, the sampled frames in order
    digest: str             # sha256 of the bytes the client sent
    nbytes: int
    source_frames: int      # frames in the video's stream
    source_fps: float
    indices: list[int]      # the source frame index of each sampled frame


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int,
                   factor: int, min_frames: int) -> list[int]:
    """Which source frames to keep: mlx-vlm's load_video rule — duration x fps frames, at least
    min_frames, at most max_frames and the video's own count, rounded down to a multiple of
    the temporal patch (`factor`), spread evenly from the first frame to the last. A video
    shorter than one temporal patch keeps all its frames (the processor repeats the last)."""
    lo = math.ceil(min_frames / factor) * factor
    hi = math.floor(min(max_frames, total) / factor) * factor
    n = min(max(total / source_fps * fps, lo), hi, total)
    n = math.floor(n / factor) * factor
    if n <= 0:
        n = min(total, max_frames)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def decode_all(parts: list[MediaPart], limits: VideoLimits, factor: int, min_frames: int,
               other_bytes: int, started: float | None = None) -> list[DecodedVideo]:
    """Every video part decoded and sampled (fetching remote ones when allowed). `other_bytes`:
    what the request's images already count against media.max_media_mb. Blocking: call it
    off the event loop."""
    if len(parts) > limits.max_videos:
        raise InvalidRequest(f"the request has {len(parts)} videos; the limit is "
                             f"{limits.max_videos} per request (media.max_videos)",
                             param=parts[limits.max_videos].where)
    out, total, pixels = [], other_bytes, 0
    started = time.monotonic() if started is None else started
    for part in parts:
        check_budget(started, limits.media.prepare_s, part.where)
        data = part.data
        if data is None:
            assert part.url is not None
            data = fetch(part.url, part.where, limits.media, what="video",
                         max_bytes=limits.max_bytes, key="media.max_video_mb")
        total += len(data)
        if total > limits.media.max_request_bytes:
            raise InvalidRequest(f"{part.where}: the request's images and videos add up to more "
                                 f"than {limits.media.max_request_bytes} bytes "
                                 "(media.max_media_mb)", param=part.where)
        out.append(decode(data, part.where, limits, factor, min_frames,
                          started + limits.media.prepare_s))
        pixels += out[-1].frames.size // 3   # the sampled frames, decoded
        if pixels > limits.media.max_request_pixels:
            raise InvalidRequest(f"{part.where}: the request's sampled video frames add up to "
                                 f"{pixels} decoded pixels; the limit is "
                                 f"{limits.media.max_request_pixels} per request "
                                 "(media.max_request_pixels)", param=part.where)
    return out


def decode(data: bytes, where: str, limits: VideoLimits, factor: int,
           min_frames: int, budget_end: float = math.inf) -> DecodedVideo:
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"{where}: the video is {len(data)} bytes; the limit is "
                             f"{limits.max_bytes} bytes per video (media.max_video_mb)",
                             param=where)
    try:
        import av
    except ImportError as e:
        raise InvalidRequest(f"{where} is a video, but this server has no video decoder "
                             f"installed (PyAV); install it with: {INSTALL}", param=where) from e
    deadline = min(time.monotonic() + limits.max_decode_s, budget_end)
    try:
        total, source_fps = _probe(data, where, limits, deadline)
        keep = sample_indices(total, source_fps, limits.fps, limits.max_frames, factor,
                              min_frames)
        frames = _frames(data, keep, where, limits, deadline)
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError, IndexError, EOFError) as e:
        raise InvalidRequest(f"{where}: the video could not be decoded ({type(e).__name__}: "
                             f"{str(e)[:160]}); send a video file ffmpeg reads (MP4, WebM, "
                             "MOV, MKV, AVI, ...)", param=where) from e
    if not frames:
        raise InvalidRequest(f"{where}: no frame of the video could be decoded", param=where)
    if len({f.shape for f in frames}) > 1:
        raise InvalidRequest(f"{where}: the video's frame size changes mid-stream; send a "
                             "video of one frame size", param=where)
    return DecodedVideo(np.stack(frames).transpose(0, 3, 1, 2), hashlib.sha256(data).hexdigest(),
                        len(data), total, source_fps, keep[:len(frames)])


def _overdue(where: str, limits: VideoLimits, deadline: float) -> None:
    """A 400 once one video's decoding has taken longer than media.max_video_decode_s (a
    file built to be slow to decode must not hold a preparation thread for minutes)."""
    if time.monotonic() > deadline:
        raise InvalidRequest(
            f"{where}: decoding the video took longer than {limits.max_decode_s:g} s, the limit "
            "per video (media.max_video_decode_s), or ran past the request's "
            f"{limits.media.prepare_s:g} s (media.max_media_prepare_s); send a shorter or "
            "smaller video",
            param=where)


def _probe(data: bytes, where: str, limits: VideoLimits, deadline: float) -> tuple[int, float]:
    """The video stream's frame count (its packets, demuxed without decoding) and frame rate,
    the pixel and duration caps checked before any frame is decoded."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise InvalidRequest(f"{where}: the file has no video stream", param=where)
        stream = container.streams.video[0]
        if container.duration is not None and container.duration / 1e6 > limits.max_seconds:
            raise InvalidRequest(
                f"{where}: the video is {container.duration / 1e6:.1f} s long; the limit is "
                f"{limits.max_seconds:g} s per video (media.max_video_seconds)", param=where)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_frame_pixels:
            raise InvalidRequest(
                f"{where}: the video's frames are {width}x{height} = {width * height} pixels; "
                f"the limit is {limits.max_frame_pixels} pixels per frame "
                "(media.max_video_pixels)", param=where)
        count, last = 0, 0.0
        for packet in container.demux(stream):
            _overdue(where, limits, deadline)
            if packet.size and packet.pts is not None:
                count += 1
                last = max(last, float((packet.pts + (packet.duration or 0)) * packet.time_base))
                if last > limits.max_seconds:
                    raise InvalidRequest(
                        f"{where}: the video is longer than {limits.max_seconds:g} s, the limit "
                        "per video (media.max_video_seconds)", param=where)
        if count == 0:
            raise InvalidRequest(f"{where}: the video stream has no frames", param=where)
        rate = stream.average_rate
        fps = float(rate) if rate else (count / last if last > 0 else 1.0)
        return count, fps


def _frames(data: bytes, keep: list[int], where: str, limits: VideoLimits,
            deadline: float) -> list[np.ndarray]:
    """The frames at the kept indices (presentation order), as (H, W, 3) uint8 RGB, turned
    upright by the stream's display rotation (as players and mlx-vlm's OpenCV reader show a
    phone's portrait video); decoding stops after the last one."""
    import av

    wanted, out = set(keep), []   # distinct and ascending (sample_indices)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            _overdue(where, limits, deadline)
            if i in wanted:
                rgb = frame.to_ndarray(format="rgb24")
                turns = round(getattr(frame, "rotation", 0) / 90) % 4   # counter-clockwise
                out.append(np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb)
            if i >= keep[-1]:
                break
    return out


@dataclass
class PreparedVideos:
    text: str                              # the prompt, video placeholders expanded
    pixels: dict[str, np.ndarray]          # pixel_values_videos, video_grid_thw
    tokens_per_video: list[int]


# families whose processor writes a video as one "<t seconds>" marker and vision block per
# temporal patch (mlx-vlm's Qwen3VLProcessor), not as one run of video tokens
TIMESTAMPED = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def group_seconds(video: DecodedVideo, temporal_patch: int) -> list[float]:
    """Each temporal patch's time in the video, as mlx-vlm's Qwen3-VL processor computes it
    from the sampled frames' source indices: the mean of its first and last frame's time (the
    last frame repeated to fill the final patch)."""
    indices = list(video.indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch)
    times = [i / video.source_fps for i in indices]
    return [(times[k] + times[k + temporal_patch - 1]) / 2
            for k in range(0, len(times), temporal_patch)]


def _expand_timestamped(processor: Any, text: str, grids: list[np.ndarray],
                        videos: list[DecodedVideo], merge: int, temporal_patch: int) -> str:
    """Qwen3-VL / Qwen3.5: each `<vision_start><|video_pad|><vision_end>` of the prompt becomes,
    per temporal patch, `<t.t seconds>` and a vision block of that patch's tokens, as mlx-vlm's
    Qwen3VLProcessor writes it (a bare `<|video_pad|>` becomes all the video's tokens)."""
    token, mark = processor.video_token, "\x00video\x00"
    start, end = processor.proc.vision_start_token, processor.proc.vision_end_token
    wrapped = start + token + end
    for grid, video in zip(grids, videos):
        t, per_patch = int(grid[0]), int(grid[1] * grid[2]) // (merge ** 2)
        if wrapped in text:
            blocks = "".join(f"<{s:.1f} seconds>" + start + mark * per_patch + end
                             for s in group_seconds(video, temporal_patch))
            text = text.replace(wrapped, blocks, 1)
        else:
            text = text.replace(token, mark * (t * per_patch), 1)
    return text.replace(mark, token)


def prepare(processor: Any, text: str, videos: list[DecodedVideo],
            where: list[str]) -> PreparedVideos:
    """Pixels and tokens of the videos, as mlx-vlm's Qwen-VL processor makes them: each
    `<|video_pad|>` of the rendered prompt becomes grid_t x grid_h x grid_w / merge^2 tokens
    (Qwen3-VL / Qwen3.5: in one timestamped block per temporal patch)."""
    token = processor.video_token
    found = text.count(token)
    if found != len(videos):
        raise InvalidRequest(
            f"the chat template wrote {found} video placeholders for {len(videos)} videos; "
            "each video part must be inside a message the template renders",
            param=where[0] if where else "messages")
    vp = processor.video_processor
    pixels, grids = [], []
    for video, at in zip(videos, where):
        try:
            out = vp(videos=[video.frames])
        except ValueError as e:   # e.g. frames smaller than one merged patch
            raise InvalidRequest(f"{at}: the video's frames cannot be processed ({e})",
                                 param=at) from e
        pixels.append(np.asarray(out["pixel_values_videos"]))
        grids.append(np.asarray(out["video_grid_thw"]))
    grid = np.concatenate(grids)
    merge = int(getattr(vp, "merge_size", 2))
    counts = [int(np.prod(g)) // (merge ** 2) for g in grid]
    if getattr(processor, "family", None) in TIMESTAMPED:
        expanded = _expand_timestamped(processor, text, list(grid), videos, merge,
                                       int(getattr(vp, "temporal_patch_size", 2)))
    else:
        pieces = text.split(token)
        expanded = pieces[0] + "".join(token * n + rest for n, rest in zip(counts, pieces[1:]))
    return PreparedVideos(expanded, {"pixel_values_videos": np.concatenate(pixels),
                                     "video_grid_thw": grid}, counts)


def refuse_unserved(parts: list[MediaPart], vision: Any, model: str) -> None:
    """A video part for a model that takes none is a 400 saying so (before any decoding)."""
    at = next((p.where for p in parts if p.kind == "video"), None)
    if at is not None and vision is not None and vision.processor.video_processor is None:
        raise InvalidRequest(
            f"{at} is a video, but model {model!r} ({vision.family}) takes no video: its "
            "processor has no video path; send frames as image parts, or serve a model that "
            "takes video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5; GET /v1/models lists each "
            "model's modalities)", param=at)


def attach(media: Any, processor: Any, text: str, parts: list[MediaPart], limits: VideoLimits,
           image_bytes: int) -> str:
    """Decode, sample and process the request's videos into `media` (a PromptMedia): their
    pixels, digests, tokens and frame counts. Returns the prompt with their tokens expanded.
    Preparation pool."""
    vp = processor.video_processor
    videos = decode_all(parts, limits, int(getattr(vp, "temporal_patch_size", 2)),
                        int(getattr(vp, "min_frames", 4)), image_bytes)
    prepared = prepare(processor, text, videos, [p.where for p in parts])
    media.pixels.update(prepared.pixels)
    media.video_digests = [v.digest for v in videos]
    media.tokens_per_video = prepared.tokens_per_video
    media.video_frames = [len(v.frames) for v in videos]
    media.video_token_id = processor.video_token_id
    return prepared.text
