"""Video in, end to end: `model=tiny_vlm model.arch=qwen2_5_vl` served by a real
serve.py on 127.0.0.1, sent videos made here with PyAV. Greedy output equals mlx-vlm's own
stream_generate on the same weights, prompt and video file (mlx-vlm decodes it with OpenCV and
samples its own frames), token for token; video rows batch beside text rows without changing
them; the prompt cache keys videos by content; bad videos are 400s naming the part."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pipeserve.model.tiny.vlm import ensure_model
from tests.media_util import (assert_batched_equals_alone, async_client, client, encode_video, greedy,
                              metric, served_bytes, token_bytes)

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")
av = pytest.importorskip("av", reason="the vision extra: pip install -e '.[vision]'")

QUESTION = "What happens in the video?"
FPS, MAX_FRAMES = 2.0, 32   # the server's defaults, which the mlx-vlm reference is given


def mp4(seed: int, frames: int, fps: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """An H.264 MP4 of random frames (each frame its own picture, so sampling matters)."""
    return encode_video(frames, fps, size, seed=seed)


VIDEO_A, VIDEO_B, VIDEO_C, VIDEO_D = mp4(1, 12, 4), mp4(2, 10, 5), mp4(3, 8, 4), mp4(4, 9, 3)


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def video_message(data: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(data)}},
                                         {"type": "text", "text": text}]}]


_REFERENCE: dict[str, Any] = {}


def mlx_vlm_greedy(path: Path, tmp: Path, video: bytes, text: str,
                   max_tokens: int) -> list[list[int]]:
    """mlx_vlm.stream_generate's greedy answer to one user turn (the video, then `text`), the
    video given as a file it decodes itself; each token as its bytes."""
    from mlx_vlm import load, stream_generate

    if str(path) not in _REFERENCE:
        _REFERENCE[str(path)] = load(str(path))
    model, processor = _REFERENCE[str(path)]
    tok = processor.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    file = tmp / f"{hashlib.sha256(video).hexdigest()[:12]}.mp4"
    file.write_bytes(video)
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    ids = []
    for r in stream_generate(model, processor, prompt, video=[str(file)], max_tokens=max_tokens,
                             temperature=0.0, fps=FPS, max_frames=MAX_FRAMES):
        if r.token in eos:
            break
        ids.append(r.token)
    return token_bytes(tok, ids[:max_tokens])


# Qwen2.5-VL (one run of video tokens per video) and Qwen3.5 (the family the product's video
# path serves: one "<t seconds>" marker and vision block per temporal patch); protocol-level
# tests (parsing, errors, other endpoints) run on one
ONE_ARCH = pytest.mark.parametrize("vlm", ["qwen2_5_vl"], indirect=True)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_5"])
def vlm(request: pytest.FixtureRequest, server_factory: Any, model_cache: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    arch = request.param
    server = server_factory("model=tiny_vlm", f"model.arch={arch}",
                            "media.max_video_seconds=5", "scheduler.prefill_chunk=64")
    server.arch = arch
    server.path = ensure_model(arch, "float32", model_cache)
    server.tmp = tmp_path_factory.mktemp("videos")
    yield server
    server.stop()   # one architecture's server at a time


def test_greedy_equals_mlx_vlm_and_stream(vlm: Any) -> None:
    answers = []
    for video in (VIDEO_A, VIDEO_B):
        resp = greedy(vlm, video_message(video))
        ours = served_bytes(resp)
        assert len(ours) >= 8
        assert ours == mlx_vlm_greedy(vlm.path, vlm.tmp, video, QUESTION, 16)
        stream = client(vlm).chat.completions.create(
            model="tiny_vlm", messages=video_message(video), max_tokens=16, temperature=0,
            stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == resp.choices[0].message.content
        answers.append(ours)
    assert answers[0] != answers[1]   # the video matters


def test_batch_of_video_and_text_rows_equals_each_alone(vlm: Any) -> None:
    rows = [video_message(VIDEO_A), [{"role": "user", "content": "Tell me about trains."}],
            video_message(VIDEO_C, "Describe it.")]
    alone = [served_bytes(greedy(vlm, m)) for m in rows]
    aclient = async_client(vlm)

    async def together() -> list[Any]:
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="tiny_vlm", messages=m, max_tokens=16, temperature=0, logprobs=True)
            for m in rows))
    assert_batched_equals_alone(lambda: asyncio.run(together()), alone, served_bytes)


def test_prompt_cache_keys_videos_by_content(vlm: Any) -> None:
    text = "A long shared question about the clip, asked twice to test the cache."
    first = greedy(vlm, video_message(VIDEO_B, text))
    encodes = metric(vlm, "pipeserve_vision_encoder_seconds_count")
    again = greedy(vlm, video_message(VIDEO_B, text))
    assert metric(vlm, "pipeserve_vision_encoder_seconds_count") == encodes   # tower skipped
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert served_bytes(again) == served_bytes(first)
    other = greedy(vlm, video_message(VIDEO_D, text))   # a video no request sent before
    assert metric(vlm, "pipeserve_vision_encoder_seconds_count") == encodes + 1
    # at most the text before the video is reused (M-RoPE: not even that), never the video
    assert other.usage.prompt_tokens_details.cached_tokens < 8
    assert served_bytes(other) == mlx_vlm_greedy(vlm.path, vlm.tmp, VIDEO_D, text, 16)


def model_forward_greedy(path: Path, tmp: Path, image: bytes, video: bytes,
                         messages: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """The greedy answer of mlx-vlm's own model to a prompt with an image and a video, which its
    generate does not take together (its get_input_embeddings merges one kind): mlx-vlm's
    processor makes the ids and both kinds' pixels, its vision tower encodes both in one call,
    the features go to their kinds' tokens, get_rope_index places both grids, and its language
    model decodes from those embeddings with its own KV cache."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    mlx_vlm_greedy(path, tmp, video, QUESTION, 1)   # loads the reference model
    model, processor = _REFERENCE[str(path)]
    tok = processor.tokenizer
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    file = tmp / "mixed.mp4"
    file.write_bytes(video)
    inp = prepare_inputs(processor, images=[Image.open(io.BytesIO(image))], videos=[str(file)],
                         prompts=[prompt], fps=FPS, max_frames=MAX_FRAMES)
    ids, grids = inp["input_ids"], (inp["image_grid_thw"], inp["video_grid_thw"])
    features = model.vision_tower(
        mx.concatenate([inp["pixel_values"], inp["pixel_values_videos"]]),
        mx.concatenate(grids), output_hidden_states=False)
    if isinstance(features, tuple):   # Qwen3.5's tower: (features, deepstack: none)
        features = features[0]
    features = np.array(features)
    lm = model.language_model
    embeds = np.array(lm.model.embed_tokens(ids))
    flat = np.array(ids)[0]
    n_image = int((flat == model.config.image_token_id).sum())
    embeds[0, flat == model.config.image_token_id] = features[:n_image]
    embeds[0, flat == model.config.video_token_id] = features[n_image:]
    positions, deltas = lm.get_rope_index(ids, *grids, mx.ones(ids.shape, dtype=mx.int32))
    cache = make_prompt_cache(lm)
    logits = lm(ids, mx.array(embeds), cache=cache, position_ids=positions,
                rope_deltas=deltas).logits
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    out: list[int] = []
    while len(out) < max_tokens:
        t = int(mx.argmax(logits[0, -1]).item())
        if t in eos:
            break
        out.append(t)
        logits = lm(mx.array([[t]]), cache=cache).logits
    return token_bytes(tok, out)


def test_an_image_and_a_video_in_one_prompt(vlm: Any) -> None:
    from tests.serve.test_vision import IMAGE_A
    from tests.serve.test_vision import data_url as image_url
    text = "Does the picture appear in the clip?"
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url(IMAGE_A)}},
        {"type": "text", "text": "Here is a clip:"},
        {"type": "video_url", "video_url": {"url": data_url(VIDEO_B)}},
        {"type": "text", "text": text}]}]
    resp = greedy(vlm, messages)
    record = resp.usage.model_extra["pipeserve"]
    assert record["images"] and record["videos"] and record["video_tokens"] > 0
    parts = [{"type": "image"}, {"type": "text", "text": "Here is a clip:"}, {"type": "video"},
             {"type": "text", "text": text}]
    turn = [{"role": "user", "content": parts}]
    assert served_bytes(resp) == model_forward_greedy(vlm.path, vlm.tmp, IMAGE_A, VIDEO_B, turn, 16)
    again = greedy(vlm, messages)   # from the prompt cache: the towers skipped, the same answer
    assert again.usage.prompt_tokens_details.cached_tokens == resp.usage.prompt_tokens - 1
    assert served_bytes(again) == served_bytes(resp)
    # a follow-up turn: its prefix (the image, the video, the answer) from the cache, so its
    # first chunk starts past every visual token (the towers skipped, their tokens' positions
    # still placed)
    answer, more = resp.choices[0].message.content, "And the colours?"
    follow = greedy(vlm, [*messages, {"role": "assistant", "content": answer},
                          {"role": "user", "content": more}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= resp.usage.prompt_tokens - 1
    assert served_bytes(follow) == model_forward_greedy(
        vlm.path, vlm.tmp, IMAGE_A, VIDEO_B, [*turn, {"role": "assistant", "content": answer},
                                              {"role": "user", "content": more}], 16)


@ONE_ARCH
def test_responses_input_video(vlm: Any) -> None:
    out = client(vlm).responses.create(model="tiny_vlm", max_output_tokens=16, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_video", "video_url": data_url(VIDEO_A)},
                                           {"type": "input_text", "text": QUESTION}]}])
    assert out.output_text == greedy(vlm, video_message(VIDEO_A)).choices[0].message.content
    follow = client(vlm).responses.create(model="tiny_vlm", max_output_tokens=4, temperature=0,
                                          previous_response_id=out.id, input="And then?")
    # the stored turn brought its video along: the follow-up's prompt has it, from the cache
    digest = "sha256:" + hashlib.sha256(VIDEO_A).hexdigest()
    assert follow.usage.model_extra["pipeserve"]["videos"] == digest
    assert follow.usage.input_tokens_details.cached_tokens > out.usage.input_tokens // 2


def test_models_metrics_and_record_name_the_videos(vlm: Any) -> None:
    models = client(vlm).models.list().data
    assert models[0].model_extra["modalities"] == ["text", "image", "video"]
    videos, frames = metric(vlm, "pipeserve_videos_total"), metric(vlm, "pipeserve_video_frames_total")
    resp = client(vlm).chat.completions.with_raw_response.create(
        model="tiny_vlm", messages=video_message(VIDEO_A, "Once more."), max_tokens=4,
        temperature=0)
    record = resp.parse().usage.model_extra["pipeserve"]
    digest = "sha256:" + hashlib.sha256(VIDEO_A).hexdigest()
    assert record["videos"] == digest and "images" not in record
    assert record["video_frames"] == 6   # 12 frames at 4 fps: 3 s at 2 fps
    assert record["video_tokens"] > 0
    details = resp.parse().usage.prompt_tokens_details
    assert details.model_extra["video_tokens"] == record["video_tokens"]
    assert details.text_tokens == resp.parse().usage.prompt_tokens - record["video_tokens"]
    assert f"videos={digest}" in resp.headers["x-pipeserve-record"]
    assert metric(vlm, "pipeserve_videos_total") == videos + 1
    assert metric(vlm, "pipeserve_video_frames_total") == frames + 6


@ONE_ARCH
def test_bad_videos_are_400s_naming_the_part(vlm: Any) -> None:
    cases = [
        (b"not a video at all", "could not be decoded"),
        (VIDEO_A[: len(VIDEO_A) // 3], "could not be decoded"),   # cut short: no index, no frames
        (mp4(5, 12, 2), "the limit is 5 s"),                       # 6 s > media.max_video_seconds=5
        (mp4(6, 4, 4, size=(20, 20)), "cannot be processed"),      # smaller than one merged patch
    ]
    for data, reason in cases:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Watch:"},
            {"type": "video_url", "video_url": {"url": data_url(data)}}]}]
        with pytest.raises(openai.BadRequestError) as e:
            greedy(vlm, messages)
        assert "messages[0].content[1]" in str(e.value) and reason in str(e.value), str(e.value)
    remote = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/clip.mp4"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\].*remote video"):
        greedy(vlm, remote)

    r = httpx.post(f"{vlm.base_url}/v1/messages", timeout=60, json={
        "model": "tiny_vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Watch:"},
            {"type": "video", "source": {"type": "base64", "media_type": "video/mp4",
                                         "data": base64.b64encode(VIDEO_A).decode()}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("messages[0].content[1] has type 'video': "
                                                   "Anthropic Messages has no video block")

    # a valid stream beside a bad request finishes
    async def together() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=vlm.base_url, timeout=60) as h:
            good = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "messages": video_message(VIDEO_A), "max_tokens": 16,
                "temperature": 0, "stream": True})
            bad = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00 ftyp")}}]}]})
            return await asyncio.gather(good, bad)
    good, bad = asyncio.run(together())
    assert bad.status_code == 400 and "messages[0].content[0]" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.text.rstrip().endswith("data: [DONE]")


def test_a_model_without_a_video_path_refuses_video(server_factory: Any) -> None:
    gemma = server_factory("model=tiny_vlm", "model.arch=gemma3")
    r = httpx.post(f"{gemma.base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny_vlm", "max_tokens": 4, "messages": video_message(VIDEO_A)})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("messages[0].content[0] is a video") and "takes no video" in message
    models = httpx.get(f"{gemma.base_url}/v1/models", timeout=30).json()["data"]
    assert models[0]["modalities"] == ["text", "image"]
