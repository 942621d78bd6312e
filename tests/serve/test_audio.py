"""Audio and images in, end to end: `model=tiny_vlm model.arch=gemma4` (a generated Gemma 4
checkpoint with an audio tower and a vision tower whose image tokens attend both ways, as the
26B's) served by a real serve.py on 127.0.0.1 and called with the real openai SDK and raw SSE.
Greedy output with input_audio and image parts equals mlx-vlm's own generate on the same
weights, prompt and WAV / PNG files, token for token; audio and image rows batch with text rows
without changing any of them; the prompt cache keys audio and images by content; bad audio is
a 400 naming the part while a stream beside it finishes."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import wave
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pipeserve.model.tiny.vlm import ensure_model
from tests import media_util
from tests.media_util import async_client, client, metric, served_bytes, token_bytes

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")

QUESTION = "What is said?"


def wav(seed: int, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    """A short tone plus noise, 16-bit PCM, written with the stdlib wave module."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * (200 + 300 * rng.random()) * t) + 0.1 * rng.standard_normal(t.size)
    pcm = (np.clip(np.repeat(x[:, None], channels, axis=1), -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


# one at the feature extractor's rate; one stereo at 24 kHz (mixed down and resampled)
AUDIO_A, AUDIO_B, AUDIO_C = wav(1), wav(2, 0.8, 24000, 2), wav(3, 0.6)


def audio_part(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


greedy = partial(media_util.greedy, max_tokens=12)   # audio answers are compared at 12 tokens


def audio_message(data: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [audio_part(data), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def omni(server_factory: Any, model_cache: Path) -> Any:
    server = server_factory("model=tiny_vlm", "model.arch=gemma4", "media.max_audio_s=2",
                            "media.max_request_audio_s=3", "scheduler.prefill_chunk=32")
    server.path = ensure_model("gemma4", "float32", model_cache)
    return server


_REFERENCE: dict[str, Any] = {}


def mlx_vlm_greedy(path: Path, audio: bytes | None, text: str, max_tokens: int,
                   tmp: Path, images: tuple[bytes, ...] = (), before: str = "") -> list[list[int]]:
    """mlx_vlm.stream_generate's greedy tokens (as bytes) for one user turn (`before`, the
    images, the clip, then `text`), each given as a file, as mlx-vlm's own CLI takes them;
    stopped at EOS."""
    from mlx_vlm import load, stream_generate
    if str(path) not in _REFERENCE:
        _REFERENCE[str(path)] = load(str(path))
    model, processor = _REFERENCE[str(path)]
    tok = processor.tokenizer
    content = ([{"type": "text", "text": before}] * bool(before)
               + [{"type": "image"}] * len(images) + [{"type": "audio"}] * (audio is not None)
               + [{"type": "text", "text": text}])
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                     add_generation_prompt=True)

    def file(data: bytes, ext: str) -> str:
        out = tmp / (hashlib.sha256(data).hexdigest()[:12] + ext)
        out.write_bytes(data)
        return str(out)
    media = {"image": [file(i, ".png") for i in images] or None,
             "audio": [file(audio, ".wav")] if audio is not None else None}
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    ids = []
    for r in stream_generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0,
                             **media):
        if r.token in eos:
            break
        ids.append(r.token)
    return token_bytes(tok, ids[:max_tokens])   # its loop yields one token past max_tokens


def test_greedy_equals_mlx_vlm_and_stream(omni: Any, tmp_path: Path) -> None:
    answers = []
    for audio in (AUDIO_A, AUDIO_B):
        resp = greedy(omni, audio_message(audio))
        ours = served_bytes(resp)
        assert len(ours) >= 6
        assert ours == mlx_vlm_greedy(omni.path, audio, QUESTION, 12, tmp_path)
        stream = client(omni).chat.completions.create(
            model="tiny_vlm", messages=audio_message(audio), max_tokens=12, temperature=0,
            stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream
                       if c.choices) == resp.choices[0].message.content
        answers.append(ours)
    assert answers[0] != answers[1]   # the audio matters


def test_audio_rows_beside_text_rows_equal_each_alone(omni: Any) -> None:
    rows = [audio_message(AUDIO_A), [{"role": "user", "content": "Tell me about trains."}],
            audio_message(AUDIO_B, "Who speaks?"), audio_message(AUDIO_A, "In what language?"),
            [{"role": "user", "content": "And about the weather?"}]]
    alone = [served_bytes(greedy(omni, m)) for m in rows]
    aclient = async_client(omni)

    async def together() -> list[Any]:
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="tiny_vlm", messages=m, max_tokens=12, temperature=0, logprobs=True)
            for m in rows))
    batched = asyncio.run(together())
    assert [served_bytes(r) for r in batched] == alone
    assert max(r.usage.model_extra["pipeserve"]["batch_size"] for r in batched) > 1


def test_prompt_cache_keys_audio_by_content(omni: Any, tmp_path: Path) -> None:
    text = "A long shared question about the recording, asked twice to test the cache."
    first = greedy(omni, audio_message(AUDIO_A, text))
    encodes = metric(omni, "pipeserve_vision_encoder_seconds_count")
    clips = metric(omni, "pipeserve_audio_clips_total")
    again = greedy(omni, audio_message(AUDIO_A, text))
    assert metric(omni, "pipeserve_vision_encoder_seconds_count") == encodes   # tower skipped
    assert metric(omni, "pipeserve_audio_clips_total") == clips + 1
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert served_bytes(again) == served_bytes(first)
    # another clip: at most the text before the clip is reused, never the clip
    other = greedy(omni, audio_message(AUDIO_C, text))
    assert other.usage.prompt_tokens_details.cached_tokens <= 4   # '<|im_start|>user\n<|audio>'
    assert served_bytes(other) == mlx_vlm_greedy(omni.path, AUDIO_C, text, 12, tmp_path)


def test_models_metrics_and_record_name_the_audio(omni: Any) -> None:
    modalities = client(omni).models.list().data[0].model_extra["modalities"]
    assert modalities == ["text", "image", "audio"]
    tokens = metric(omni, "pipeserve_audio_tokens_total")
    seconds = metric(omni, "pipeserve_audio_input_seconds_total")
    messages = [{"role": "user", "content": [audio_part(AUDIO_A), {"type": "text", "text": "and"},
                                             audio_part(AUDIO_C)]}]
    resp = client(omni).chat.completions.with_raw_response.create(
        model="tiny_vlm", messages=messages, max_tokens=4, temperature=0)
    digests = ",".join("sha256:" + hashlib.sha256(d).hexdigest() for d in (AUDIO_A, AUDIO_C))
    body = resp.parse()
    record = body.usage.model_extra["pipeserve"]
    assert record["audios"] == digests and "images" not in record
    assert record["audio_tokens"] == 25 + 15   # one per 40 ms: 1.0 s and 0.6 s
    assert record["audio_s"] == 1.6 and record["vision_encoder_s"] > 0
    details = body.usage.prompt_tokens_details
    assert details.audio_tokens == 40
    assert details.text_tokens == body.usage.prompt_tokens - 40
    assert f"audios={digests}" in resp.headers["x-pipeserve-record"]
    assert metric(omni, "pipeserve_audio_tokens_total") == tokens + 40
    assert metric(omni, "pipeserve_audio_input_seconds_total") == pytest.approx(seconds + 1.6)


def test_responses_input_audio_and_a_follow_up_turn(omni: Any) -> None:
    c = client(omni)
    first = c.responses.create(model="tiny_vlm", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [audio_part(AUDIO_B),
                                     {"type": "input_text", "text": QUESTION}]}])
    assert first.output_text == greedy(omni, audio_message(AUDIO_B)).choices[0].message.content
    follow = c.responses.create(model="tiny_vlm", max_output_tokens=4, temperature=0,
                                previous_response_id=first.id, input="And then?")
    # the stored turn brought its clip along: the follow-up's prompt has it, from the cache
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 25


def test_bad_audio_is_a_400_naming_the_part(omni: Any) -> None:
    corrupt = AUDIO_A[:12] + b"\x00garbage, not a fmt chunk" * 4
    cases = [
        (audio_part(corrupt), "could not be decoded"),
        (audio_part(b"plain text, not audio"), "not WAV, MP3 or FLAC"),
        (audio_part(wav(5, 2.5)), "2.50 s long; the limit is 2 s per clip (media.max_audio_s)"),
        (audio_part(wav(6, 0.02)), "20.0 ms long; the shortest clip this model takes is 40 ms"),
        ({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}, "base64"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "m4a"}},
         "format is 'm4a'"),
    ]
    for part, reason in cases:
        with pytest.raises(openai.BadRequestError) as e:
            greedy(omni, [{"role": "user", "content": [{"type": "text", "text": "Hear:"}, part]}])
        assert "messages[0].content[1]" in str(e.value) and reason in str(e.value), str(e.value)
    # two clips within the per-clip cap, past the request's: the second is named
    with pytest.raises(openai.BadRequestError) as e:
        greedy(omni, [{"role": "user", "content": [
            {"type": "text", "text": "Hear:"}, audio_part(wav(7, 1.8)), audio_part(wav(8, 1.5))]}])
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "messages[0].content[2]", err
    assert ("the audio is 1.50 s long, which brings the request's audio to 3.30 s; the limit "
            "is 3 s per request (media.max_request_audio_s)") in err["message"]
    # Gemma 4 takes no video (mlx-vlm's Gemma 4 video path is not served): a 400 saying so
    mp4 = base64.b64encode(b"\x00\x00\x00\x18ftypmp42").decode()
    with pytest.raises(openai.BadRequestError,
                       match=r"messages\[0\]\.content\[0\] is a video.*takes no video"):
        greedy(omni, [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}}]}])

    # a valid stream beside a corrupt clip finishes
    async def both() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=omni.base_url, timeout=60) as h:
            good = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "messages": audio_message(AUDIO_A), "max_tokens": 12,
                "temperature": 0, "stream": True})
            bad = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "max_tokens": 4,
                "messages": [{"role": "user", "content": [audio_part(corrupt)]}]})
            return await asyncio.gather(good, bad)
    good, bad = asyncio.run(both())
    assert bad.status_code == 400 and "messages[0].content[0]" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.text.rstrip().endswith("data: [DONE]")
    assert "content" in good.text


# -- images (bidirectional within each image at prefill) ---------------------------------------
def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# different aspect ratios: 12 and 10 image tokens (Gemma 4 sizes each image's token count)
IMAGE_A, IMAGE_B = png(1, (56, 40)), png(2, (32, 64))
LOOK = "What is in the picture?"


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def media_message(images: tuple[bytes, ...], audio: bytes | None = None, text: str = LOOK,
                  before: str = "") -> list[dict[str, Any]]:
    parts = ([{"type": "text", "text": before}] * bool(before) + [image_part(i) for i in images]
             + ([audio_part(audio)] if audio else []))
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_images_equal_mlx_vlm_alone_and_beside_text_and_audio(omni: Any, tmp_path: Path) -> None:
    """Each image's tokens attend both ways (mlx-vlm's overlay): one image; two, the second
    (tokens 29-38) across the 32-token chunk boundary (that chunk ends at 29); images with a
    clip (kept causal, as mlx-vlm's generate keeps them); each equal to mlx-vlm, and in one
    batch beside a text row and an audio row equal to each alone."""
    cases = [((IMAGE_A,), None, ""), ((IMAGE_A, IMAGE_B), None, "Two pictures:"),
             ((IMAGE_B,), AUDIO_C, "")]
    rows = [media_message(images, audio, before=before) for images, audio, before in cases]
    alone = [served_bytes(greedy(omni, m)) for m in rows]
    for (images, audio, before), ours in zip(cases, alone):
        assert len(ours) >= 6
        assert ours == mlx_vlm_greedy(omni.path, audio, LOOK, 12, tmp_path, images, before)
    assert alone[0] != served_bytes(greedy(omni, media_message((IMAGE_B,))))   # images matter
    rows += [[{"role": "user", "content": "Tell me about trains."}], audio_message(AUDIO_A)]
    alone += [served_bytes(greedy(omni, m)) for m in rows[3:]]
    aclient = async_client(omni)

    async def together() -> list[Any]:
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="tiny_vlm", messages=m, max_tokens=12, temperature=0, logprobs=True)
            for m in rows))
    media_util.assert_batched_equals_alone(lambda: asyncio.run(together()), alone, served_bytes)


def test_prompt_cache_keys_images_and_how_they_attend(omni: Any) -> None:
    """The same image and text again: the prefix is reused, the answer the same. The same turn
    continued with a clip: the image is now attended causally (as mlx-vlm's generate does with
    audio in the prompt), so the turn's cached KV, computed both ways, is not reused; without
    the clip the continuation reuses it."""
    text = "A longer question about the picture, asked twice to test the prompt cache."
    first = greedy(omni, media_message((IMAGE_B,), text=text))
    again = greedy(omni, media_message((IMAGE_B,), text=text))
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert served_bytes(again) == served_bytes(first)
    record = again.usage.model_extra["pipeserve"]
    assert record["images"] == "sha256:" + hashlib.sha256(IMAGE_B).hexdigest()
    turn = [*media_message((IMAGE_B,), text=text),
            {"role": "assistant", "content": first.choices[0].message.content}]
    with_text = greedy(omni, [*turn, {"role": "user", "content": "And then?"}])
    assert with_text.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    with_clip = greedy(omni, [*turn, {"role": "user", "content": [audio_part(AUDIO_A)]}])
    assert with_clip.usage.prompt_tokens_details.cached_tokens <= 4   # '<|im_start|>user\n<|image>'
