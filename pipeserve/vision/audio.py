"""Audio in: OpenAI `input_audio` parts (chat completions and Responses) for models with an
audio tower (Gemma 4 through mlx-vlm). Parsed on the event loop into MediaPart values
(kind "audio"); decoded off the loop (the tokenize stage's preparation pool) with miniaudio
through mlx-audio's reader — WAV, MP3, FLAC — under per-clip byte and duration caps, mixed
down to mono and resampled to the feature extractor's rate exactly as mlx-vlm's load_audio
does; then turned into log-mel features and the prompt's audio tokens by the checkpoint's own
feature extractor (AudioProcessor, no MLX). `encode` runs the tower at prefill (engine
thread). Every failure is an InvalidRequest naming the part (its JSON path) and the reason."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeserve.errors import InvalidRequest
from pipeserve.vision.media import MediaPart

FORMATS = ("wav", "mp3", "flac")


def from_input_audio(obj: Any, where: str) -> MediaPart:
    """An OpenAI input_audio object: {"data": <base64>, "format": "wav" | "mp3" | "flac"}."""
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}.input_audio must be an object with data (base64 audio) "
                             "and format (wav, mp3 or flac)", param=where)
    data, fmt = obj.get("data"), obj.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise InvalidRequest(f"{where}.input_audio.format is {str(fmt)[:20]!r}; this server "
                             f"decodes {', '.join(FORMATS)}", param=where)
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{where}.input_audio.data must be a non-empty base64 string",
                             param=where)
    if data.startswith("data:"):   # a data URL where the bare base64 belongs: take its payload
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"{where}: the audio data is not valid base64 ({e})",
                             param=where) from e
    return MediaPart(where, data=raw, kind="audio")


@dataclass(slots=True)
class AudioLimits:
    max_clip_bytes: int
    max_seconds: float
    max_clips: int
    max_request_seconds: float = 120.0

    @classmethod
    def of(cls, media: Any) -> AudioLimits:
        return cls(int(media.max_audio_mb * 1e6), float(media.max_audio_s),
                   int(media.max_audios), float(media.max_request_audio_s))


@dataclass(slots=True)
class DecodedAudio:
    waveform: np.ndarray   # float32 mono at the feature extractor's rate
    digest: str            # sha256 of the bytes the client sent
    seconds: float


def _format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0
                              and data[1] & 0x06):
        return "mp3"
    return None


def decode(data: bytes, where: str, limits: AudioLimits, rate: int, model_seconds: float,
           shortest_s: float = 0.0, used_seconds: float = 0.0) -> DecodedAudio:
    """One clip's waveform at `rate` Hz, mono (mlx-vlm's load_audio, from bytes). The duration
    is checked from the header before the samples are decoded: at most the server's and the
    model's longest clip, at least `shortest_s` (one audio token's worth: the tower gives a
    shorter clip no frame), and with the request's `used_seconds` at most its audio budget.
    Blocking: off the event loop."""
    import miniaudio
    from mlx_audio.audio_io import read

    if len(data) > limits.max_clip_bytes:
        raise InvalidRequest(f"{where}: the audio is {len(data)} bytes; the limit is "
                             f"{limits.max_clip_bytes} bytes per clip (media.max_audio_mb)",
                             param=where)
    fmt = _format(data)
    if fmt is None:
        raise InvalidRequest(f"{where}: the audio could not be decoded (its first bytes "
                             f"{data[:12]!r} are not WAV, MP3 or FLAC); send "
                             f"{', '.join(f.upper() for f in FORMATS)}", param=where)
    info_of = {"wav": miniaudio.wav_get_info, "mp3": miniaudio.mp3_get_info,
               "flac": miniaudio.flac_get_info}[fmt]
    try:
        info = info_of(data)
        if info.num_frames <= 0 or info.sample_rate <= 0:
            raise InvalidRequest(f"{where}: the {fmt.upper()} audio has no samples", param=where)
        seconds = info.num_frames / info.sample_rate
        limit, key = min((limits.max_seconds, "media.max_audio_s"),
                         (model_seconds, "the model's longest clip"))
        if seconds > limit:
            raise InvalidRequest(f"{where}: the audio is {seconds:.2f} s long; the limit is "
                                 f"{limit:g} s per clip ({key})", param=where)
        if seconds < shortest_s:
            raise InvalidRequest(f"{where}: the audio is {seconds * 1000:.1f} ms long; the "
                                 f"shortest clip this model takes is {shortest_s * 1000:g} ms "
                                 "(one audio token)", param=where)
        _check_request_seconds(where, seconds, used_seconds, limits)
        audio, sample_rate = read(io.BytesIO(data), dtype="float32")
    except InvalidRequest:
        raise
    except (miniaudio.MiniaudioError, RuntimeError, ValueError, KeyError, OSError,
            ZeroDivisionError, IndexError, TypeError, OverflowError, MemoryError) as e:
        raise InvalidRequest(f"{where}: the {fmt.upper()} audio could not be decoded "
                             f"({type(e).__name__}: {str(e)[:160]})", param=where) from e
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim > 1:   # mix down before resampling, as mlx-vlm's load_audio does
        audio = audio.mean(axis=1)
    if audio.size == 0:
        raise InvalidRequest(f"{where}: the {fmt.upper()} audio decodes to no samples",
                             param=where)
    audio = resample(audio, int(sample_rate), rate)
    return DecodedAudio(np.asarray(audio, dtype=np.float32), hashlib.sha256(data).hexdigest(),
                        seconds)


def _check_request_seconds(where: str, seconds: float, used: float, limits: AudioLimits) -> None:
    if used + seconds > limits.max_request_seconds:
        raise InvalidRequest(
            f"{where}: the audio is {seconds:.2f} s long, which brings the request's audio to "
            f"{used + seconds:.2f} s; the limit is {limits.max_request_seconds:g} s per request "
            "(media.max_request_audio_s)", param=where)


# The most up/down steps a polyphase filter is built for: its taps grow with the reduced rate
# ratio (128 per step), which every common rate keeps small (44100 -> 16000 is 160/441) and an
# odd one makes huge (383999 -> 16000: 384 million steps).
MAX_POLYPHASE_STEPS = 4096


def resample(audio: np.ndarray, orig: int, rate: int) -> np.ndarray:
    """`audio` from `orig` Hz to `rate` Hz: mlx-vlm's polyphase resampler (mlx-audio's) at
    every common rate; FFT resampling (cost n log n, whatever the ratio) at an odd one."""
    if orig == rate:
        return audio
    g = math.gcd(orig, rate)
    if max(orig // g, rate // g) <= MAX_POLYPHASE_STEPS:
        from mlx_audio.resample import resample_audio_array
        return resample_audio_array(audio, orig, rate, axis=-1)
    from scipy.signal import resample as fft_resample
    num = max(1, round(len(audio) * rate / orig))
    return np.asarray(fft_resample(audio, num), dtype=np.float32)


def decode_all(parts: list[MediaPart], limits: AudioLimits, rate: int, model_seconds: float,
               request_bytes: int, used_bytes: int = 0,
               shortest_s: float = 0.0) -> list[DecodedAudio]:
    """Every audio part's waveform, caps checked (`used_bytes`: the request's images, which
    share media.max_media_mb); a clip that brings the request's audio past
    media.max_request_audio_s is refused before its samples are decoded. Blocking: off the
    event loop."""
    if len(parts) > limits.max_clips:
        raise InvalidRequest(f"the request has {len(parts)} audio clips; the limit is "
                             f"{limits.max_clips} per request (media.max_audios)",
                             param=parts[limits.max_clips].where)
    out, total, seconds = [], used_bytes, 0.0
    for part in parts:
        assert part.data is not None
        total += len(part.data)
        if total > request_bytes:
            raise InvalidRequest(f"{part.where}: the request's media add up to more than "
                                 f"{request_bytes} bytes (media.max_media_mb)", param=part.where)
        out.append(decode(part.data, part.where, limits, rate, model_seconds, shortest_s,
                          seconds))
        seconds += out[-1].seconds
    return out


@dataclass
class PreparedAudio:
    text: str                                    # placeholders expanded to the clips' tokens
    features: list[tuple[np.ndarray, np.ndarray]]  # per clip: log-mel (1, T, F), valid (1, T)
    tokens_per_clip: list[int]


class AudioProcessor:
    """A checkpoint's audio side (mlx-vlm's Gemma4Processor): its feature extractor, audio token
    and begin/end markers, and how many tokens a clip gets (one per audio_ms_per_token, at most
    audio_seq_length). Preparation pool; never touches MLX."""

    def __init__(self, proc: Any) -> None:
        self.extractor = proc.feature_extractor
        self.rate = int(self.extractor.sampling_rate)
        self.token, self.boa, self.eoa = proc.audio_token, proc.boa_token, proc.eoa_token
        token_id = proc.audio_token_id
        self.token_id = int(token_id if token_id is not None
                            else proc.tokenizer.convert_tokens_to_ids(self.token))
        self.ms_per_token = float(proc.audio_ms_per_token)
        self.seq_length = int(proc.audio_seq_length)
        self.max_seconds = self.seq_length * self.ms_per_token / 1000.0

    def num_tokens(self, waveform: np.ndarray) -> int:
        duration_ms = len(waveform) / self.rate * 1000.0
        return min(math.ceil(duration_ms / self.ms_per_token), self.seq_length)

    def prepare(self, text: str, clips: list[np.ndarray], where: list[str]) -> PreparedAudio:
        found = text.count(self.token)
        if found != len(clips):
            raise InvalidRequest(
                f"the chat template wrote {found} audio placeholders for {len(clips)} audio "
                "clips; each input_audio part must be inside a message the template renders",
                param=where[0] if where else "messages")
        counts = [self.num_tokens(c) for c in clips]
        spans = iter(self.boa + self.token * n + self.eoa for n in counts)
        expanded = re.sub(re.escape(self.token), lambda _: next(spans), text)
        features = []
        for clip in clips:   # a clip per call: its features are its own, not padded to another's
            out = self.extractor([clip], sampling_rate=self.rate, return_attention_mask=True)
            features.append((np.asarray(out["input_features"]),
                             np.asarray(out["input_features_mask"])))
        return PreparedAudio(expanded, features, counts)


def encode(vlm: Any, features: list[tuple[np.ndarray, np.ndarray]], counts: list[int],
           dtype: Any) -> Any:
    """The clips' soft tokens (sum(counts), D): each clip through the audio tower and its
    projector, its first `counts[i]` frames taken (as mlx-vlm's scatter takes them for a clip).
    Engine thread."""
    import mlx.core as mx

    out = []
    for (feat, valid), n in zip(features, counts):
        enc, _ = vlm.audio_tower(mx.array(feat).astype(dtype), ~mx.array(valid).astype(mx.bool_))
        tokens = vlm.embed_audio(enc)[0]
        out.append(tokens[mx.arange(n) % tokens.shape[0]])
    return mx.concatenate(out, axis=0)


def check_modalities(parts: list[MediaPart], vision: Any, model_name: str) -> None:
    """Refuse, at the first part the loaded model cannot take, naming the part and why."""
    takes = (["text"] + (["image"] if vision is not None else [])
             + (["audio"] if vision is not None and vision.audio is not None else []))
    for part in parts:
        if part.kind == "audio" and "audio" not in takes:
            raise InvalidRequest(
                f"{part.where} is audio, but model {model_name!r} has no audio tower and takes "
                f"{' and '.join(takes)} only; serve a model with an audio tower (model.path=<a "
                "Gemma 4 E2B/E4B mlx-vlm checkpoint>) for audio; GET /v1/models lists each "
                "model's modalities", param=part.where)
        if part.kind in ("image", "video") and vision is None:
            article = "an" if part.kind == "image" else "a"
            raise InvalidRequest(
                f"{part.where} is {article} {part.kind}, but model {model_name!r} has no vision "
                "tower and takes text only; serve a vision-language model (model.path=<an "
                f"mlx-vlm checkpoint>) for {part.kind}s (GET /v1/models lists each model's "
                "modalities)", param=part.where)


def prepare_audio(processor: AudioProcessor, clips: list[MediaPart], text: str, media: Any,
                  limits: AudioLimits, request_bytes: int, used_bytes: int) -> str:
    """Decode the request's clips onto `media` (a PromptMedia) and expand the rendered
    prompt's audio placeholders. Preparation pool."""
    decoded = decode_all(clips, limits, processor.rate, processor.max_seconds, request_bytes,
                         used_bytes, processor.ms_per_token / 1000.0)
    prepared = processor.prepare(text, [d.waveform for d in decoded], [p.where for p in clips])
    media.audio_features = prepared.features
    media.audio_digests = [d.digest for d in decoded]
    media.tokens_per_audio = prepared.tokens_per_clip
    media.audio_token_id = processor.token_id
    media.audio_seconds = sum(d.seconds for d in decoded)
    return prepared.text
