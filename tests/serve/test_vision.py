"""Images in, end to end: `model=tiny_vlm` (a generated mlx-vlm checkpoint) served
by a real serve.py on 127.0.0.1 and called with the real openai and anthropic SDKs. Greedy
output equals mlx_vlm's own generate on the same weights, prompt and image, token for token;
image rows batch with text rows and another image's rows without changing any of them; the
prompt cache keys images by content; bad images are 400s that name the part."""
from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from pipeserve.model.tiny.vlm import ensure_model
from tests.media_util import (assert_batched_equals_alone, async_client, client, greedy, metric,
                              served_bytes, token_bytes)

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")

ARCHS = ["gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# Qwen3.5's mixture-of-experts decoder: the same model code but its MLPs, so the tests of the
# decoder's own output (greedy against mlx-vlm, batching) run on it too
WITH_MOE = pytest.mark.parametrize("vlm", [*ARCHS, "qwen3_5_moe"], indirect=True)
# protocol-level tests (parsing, errors, other endpoints): one architecture's server suffices
ONE_ARCH = pytest.mark.parametrize("vlm", ["gemma3"], indirect=True)
QUESTION = "What is in the picture?"


def png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


IMAGE_A, IMAGE_B, IMAGE_C = png(1, (56, 40)), png(2, (48, 64)), png(4, (40, 40))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(data: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(data)}},
                                         {"type": "text", "text": text}]}]


_REFERENCE: dict[str, Any] = {}


def _reference(path: Path) -> Any:
    from mlx_vlm import load
    if str(path) not in _REFERENCE:
        _REFERENCE[str(path)] = load(str(path))
    return _REFERENCE[str(path)]


def reference_bytes(path: Path, prompt: str, image: bytes, max_tokens: int) -> list[list[int]]:
    """mlx_vlm.stream_generate's greedy tokens for a rendered prompt (stopped at EOS), as bytes."""
    from mlx_vlm import stream_generate
    model, processor = _reference(path)
    tok = processor.tokenizer
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    ids = []
    for r in stream_generate(model, processor, prompt, image=[Image.open(io.BytesIO(image))],
                             max_tokens=max_tokens, temperature=0.0):
        if r.token in eos:
            break
        ids.append(r.token)
    return token_bytes(tok, ids[:max_tokens])   # its loop yields one token past max_tokens


def mlx_vlm_greedy(path: Path, image: bytes, text: str, max_tokens: int) -> list[list[int]]:
    """mlx-vlm's greedy answer to one user turn: the image, then `text`."""
    _, processor = _reference(path)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    return reference_bytes(path, prompt, image, max_tokens)


def first_image_token(path: Path, text: str) -> int:
    """Where mlx-vlm's processor puts the prompt's first image token."""
    from mlx_vlm.utils import prepare_inputs
    mlx_vlm_greedy(path, IMAGE_A, text, 1)
    _, processor = _REFERENCE[str(path)]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    ids = prepare_inputs(processor, images=[Image.open(io.BytesIO(IMAGE_A))],
                         prompts=[prompt])["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids(
        "<image_soft_token>" if "<image_soft_token>" in processor.tokenizer.get_vocab()
        else "<|image_pad|>")
    return ids.index(image_id)


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request: pytest.FixtureRequest, server_factory: Any, model_cache: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    arch = request.param
    # a RAM tier of ~2 prompts' KV: older entries spill to the SSD tier, where they hit again
    # (Qwen3.5's attention heads are 64 wide, not 16: its prompts' KV is ~4x larger)
    ram_gb = 0.0004 if arch.startswith("qwen3_5") else 0.0001
    server = server_factory("model=tiny_vlm", f"model.arch={arch}", "media.max_image_pixels=20000",
                            "cache=ssd", f"cache.ssd.dir={tmp_path_factory.mktemp('ssd')}",
                            f"cache.ram_gb={ram_gb}", "scheduler.prefill_chunk=64")
    server.arch = arch
    server.path = ensure_model(arch, "float32", model_cache)
    yield server
    server.stop()   # one architecture's server at a time


@WITH_MOE
def test_greedy_equals_mlx_vlm_and_stream(vlm: Any) -> None:
    for image in (IMAGE_A, IMAGE_B):
        resp = greedy(vlm, image_message(image))
        ours = served_bytes(resp)
        assert len(ours) >= 8
        assert ours == mlx_vlm_greedy(vlm.path, image, QUESTION, 16), vlm.arch
        stream = client(vlm).chat.completions.create(
            model="tiny_vlm", messages=image_message(image), max_tokens=16, temperature=0,
            stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == resp.choices[0].message.content
    # the image matters: two images, two answers
    assert served_bytes(greedy(vlm, image_message(IMAGE_A))) != served_bytes(
        greedy(vlm, image_message(IMAGE_B)))


def test_an_image_inside_a_prompt_of_several_chunks(vlm: Any) -> None:
    """scheduler.prefill_chunk=64: the image's features and positions are cut per chunk."""
    before = "Some context first. " * 14
    messages = [{"role": "user", "content": [
        {"type": "text", "text": before},
        {"type": "image_url", "image_url": {"url": data_url(IMAGE_B)}},
        {"type": "text", "text": "Now the question: " + QUESTION}]}]
    resp = greedy(vlm, messages)
    assert resp.usage.prompt_tokens > 2 * 64
    model, processor = _reference(vlm.path)
    tok = processor.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": before}, {"type": "image"},
        {"type": "text", "text": "Now the question: " + QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    assert served_bytes(resp) == reference_bytes(vlm.path, prompt, IMAGE_B, 16)


@WITH_MOE
def test_batch_of_images_and_text_equals_each_alone(vlm: Any) -> None:
    rows = [image_message(IMAGE_A), [{"role": "user", "content": "Tell me about trains."}],
            image_message(IMAGE_B, "Describe it."), image_message(IMAGE_A, "And the colours?")]
    alone = [served_bytes(greedy(vlm, m)) for m in rows]
    aclient = async_client(vlm)

    async def together() -> list[Any]:
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="tiny_vlm", messages=m, max_tokens=16, temperature=0, logprobs=True)
            for m in rows))
    assert_batched_equals_alone(lambda: asyncio.run(together()), alone, served_bytes)


def test_prompt_cache_keys_images_by_content(vlm: Any) -> None:
    text = "A long shared question about the picture, asked twice to test the cache."
    first = greedy(vlm, image_message(IMAGE_A, text))
    encodes = metric(vlm, "pipeserve_vision_encoder_seconds_count")
    images = metric(vlm, "pipeserve_images_total")
    again = greedy(vlm, image_message(IMAGE_A, text))
    assert metric(vlm, "pipeserve_vision_encoder_seconds_count") == encodes   # tower skipped
    assert metric(vlm, "pipeserve_images_total") == images + 1                # image counted
    other = greedy(vlm, image_message(IMAGE_C, text))   # an image no request sent before
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert served_bytes(again) == served_bytes(first)
    # another image: at most the text before the image is reused, never the image
    assert other.usage.prompt_tokens_details.cached_tokens <= first_image_token(vlm.path, text)
    assert served_bytes(other) == mlx_vlm_greedy(vlm.path, IMAGE_C, text, 16)
    # a follow-up turn: the image and the answer from the cache, so the prompt's first chunk
    # starts past the image's tokens (the tower skipped; their positions still placed)
    turn = [{"type": "image"}, {"type": "text", "text": text}]
    history = [{"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And the colours?"}]
    follow = greedy(vlm, [*image_message(IMAGE_A, text), *history])
    assert follow.usage.prompt_tokens_details.cached_tokens >= n - 1
    prompt = _reference(vlm.path)[1].tokenizer.apply_chat_template(
        [{"role": "user", "content": turn}, *history], tokenize=False, add_generation_prompt=True)
    assert served_bytes(follow) == reference_bytes(vlm.path, prompt, IMAGE_A, 16)


@ONE_ARCH
def test_anthropic_image_block(vlm: Any) -> None:
    c = anthropic.Anthropic(base_url=vlm.base_url, api_key="x", max_retries=0, timeout=60)
    msg = c.messages.create(model="tiny_vlm", max_tokens=16, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMAGE_B).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert msg.content[0].text == greedy(vlm, image_message(IMAGE_B)).choices[0].message.content
    counted = c.messages.count_tokens(model="tiny_vlm", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(IMAGE_B).decode()}},
        {"type": "text", "text": QUESTION}]}])
    # image tokens included (Anthropic's input_tokens leaves out what the cache read)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


@ONE_ARCH
def test_bad_images_are_400s_naming_the_part(vlm: Any) -> None:
    big = png(3, (200, 150))   # 30000 pixels > media.max_image_pixels=20000
    cases = [
        (b"not an image at all", "could not be decoded"),
        (big, "30000 pixels"),
    ]
    for data, reason in cases:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": data_url(data)}}]}]
        with pytest.raises(openai.BadRequestError) as e:
            greedy(vlm, messages)
        assert "messages[0].content[1]" in str(e.value) and reason in str(e.value)
    bad_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,@@@"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\].*base64"):
        greedy(vlm, bad_url)

    # a valid stream beside a bad request finishes
    async def both() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=vlm.base_url, timeout=60) as h:
            good = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "messages": image_message(IMAGE_A), "max_tokens": 16,
                "temperature": 0, "stream": True})
            bad = h.post("/v1/chat/completions", json={
                "model": "tiny_vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG broken")}}]}]})
            return await asyncio.gather(good, bad)
    good, bad = asyncio.run(both())
    assert bad.status_code == 400 and "messages[0].content[0]" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.text.rstrip().endswith("data: [DONE]")


@ONE_ARCH
def test_audio_on_an_image_model_is_a_400_saying_it_has_no_audio_tower(vlm: Any) -> None:
    wav = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()
    with pytest.raises(openai.BadRequestError,
                       match=r"messages\[0\]\.content\[1\] is audio, but model 'tiny_vlm' has no "
                             r"audio tower and takes text and image only"):
        greedy(vlm, [{"role": "user", "content": [
            {"type": "text", "text": "Hear:"},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}])


@ONE_ARCH
def test_remote_urls_refused_by_default(vlm: Any) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\].*remote"):
        greedy(vlm, messages)


def test_ssd_tier_serves_an_image_prefix_after_ram_eviction(vlm: Any) -> None:
    text = "Once more about this very picture, kept on disk."
    first = greedy(vlm, image_message(IMAGE_B, text))
    for k in range(5):   # other images push it out of the RAM tier onto the SSD tier
        greedy(vlm, image_message(png(10 + k, (40, 40)), f"Filler {k} pushing the cache."))
    ssd_hits = metric(vlm, 'pipeserve_prompt_cache_hits_total{cache_tier="ssd"}')
    again = greedy(vlm, image_message(IMAGE_B, text))
    assert metric(vlm, 'pipeserve_prompt_cache_hits_total{cache_tier="ssd"}') == ssd_hits + 1
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert served_bytes(again) == served_bytes(first)


def test_models_metrics_and_record_name_the_images(vlm: Any) -> None:
    models = client(vlm).models.list().data
    # Qwen-VL's processors also take video (tests/serve/test_video.py); Gemma 3's does not
    assert models[0].model_extra["modalities"] == (
        ["text", "image"] if vlm.arch == "gemma3" else ["text", "image", "video"])
    images, tokens = metric(vlm, "pipeserve_images_total"), metric(vlm, "pipeserve_image_tokens_total")
    encodes = metric(vlm, "pipeserve_vision_encoder_seconds_count")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGE_A)}},
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(IMAGE_C)}}]}]
    resp = client(vlm).chat.completions.with_raw_response.create(
        model="tiny_vlm", messages=messages, max_tokens=4, temperature=0)
    import hashlib
    digests = ",".join("sha256:" + hashlib.sha256(d).hexdigest() for d in (IMAGE_A, IMAGE_C))
    record = resp.parse().usage.model_extra["pipeserve"]
    assert record["images"] == digests
    assert record["image_tokens"] > 0 and record["vision_encoder_s"] > 0
    details = resp.parse().usage.prompt_tokens_details
    assert details.image_tokens == record["image_tokens"]
    assert details.text_tokens == resp.parse().usage.prompt_tokens - details.image_tokens
    assert f"images={digests}" in resp.headers["x-pipeserve-record"]
    assert metric(vlm, "pipeserve_images_total") == images + 2
    assert metric(vlm, "pipeserve_vision_encoder_seconds_count") == encodes + 1
    assert metric(vlm, "pipeserve_image_tokens_total") > tokens


@ONE_ARCH
def test_responses_input_image_and_a_follow_up_turn(vlm: Any) -> None:
    c = client(vlm)
    first = c.responses.create(model="tiny_vlm", max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE_A)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert first.output_text == greedy(vlm, image_message(IMAGE_A)).choices[0].message.content
    follow = c.responses.create(model="tiny_vlm", max_output_tokens=4, temperature=0,
                                previous_response_id=first.id, input="And the colours?")
    # the stored turn brought its image along: the follow-up's prompt has it, from the cache
    assert follow.output_text and follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl", "qwen3_vl"])
def test_image_rows_on_the_paged_kv_layout_equal_mlx_vlm(arch: str, server_factory: Any,
                                                         model_cache: Path) -> None:
    """kv=paged (lossless) holds image rows' KV in its block pool: greedy output with an image,
    one request alone and two with different images in one batch, equals mlx-vlm's own
    generate (dense caches) token for token."""
    server = server_factory("model=tiny_vlm", f"model.arch={arch}", "kv=paged",
                            "media.max_image_pixels=20000")
    server.arch, server.path = arch, ensure_model(arch, "float32", model_cache)
    want = {img: mlx_vlm_greedy(server.path, img, QUESTION, 16) for img in (IMAGE_A, IMAGE_B)}
    assert served_bytes(greedy(server, image_message(IMAGE_A))) == want[IMAGE_A]

    async def both() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(c.chat.completions.create(
            model="tiny_vlm", messages=image_message(img), max_tokens=16, temperature=0,
            logprobs=True) for img in (IMAGE_A, IMAGE_B)))
    together = asyncio.run(both())
    assert [served_bytes(r) for r in together] == [want[IMAGE_A], want[IMAGE_B]]


@pytest.mark.parametrize("vlm", ["qwen3_vl"], indirect=True)
def test_qwen3_vl_video_alone_and_beside_an_image_equals_mlx_vlm(vlm: Any, tmp_path: Path) -> None:
    """Qwen3-VL's video: one "<t seconds>" block per temporal patch, the tower's deepstack
    features at the video's tokens; mlx-vlm's Qwen3-VL takes an image and a video in one
    prompt, so both are checked against its own stream_generate (tests/serve/test_video.py has
    the rest of the video tests, on Qwen2.5-VL and Qwen3.5)."""
    from mlx_vlm import stream_generate

    from tests.serve.test_video import FPS, MAX_FRAMES, mlx_vlm_greedy, mp4
    from tests.serve.test_video import data_url as video_url
    assert "video" in client(vlm).models.list().data[0].model_extra["modalities"]
    video = mp4(2, 10, 5)
    alone = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_url(video)}},
        {"type": "text", "text": QUESTION}]}]
    assert served_bytes(greedy(vlm, alone)) == mlx_vlm_greedy(vlm.path, tmp_path, video,
                                                               QUESTION, 16)
    both = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGE_A)}},
        {"type": "text", "text": "and a clip:"},
        {"type": "video_url", "video_url": {"url": video_url(video)}},
        {"type": "text", "text": QUESTION}]}]
    model, processor = _reference(vlm.path)
    tok = processor.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and a clip:"}, {"type": "video"},
        {"type": "text", "text": QUESTION}]}], tokenize=False, add_generation_prompt=True)
    file = tmp_path / "clip.mp4"
    file.write_bytes(video)
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    ids: list[int] = []
    for r in stream_generate(model, processor, prompt, image=[Image.open(io.BytesIO(IMAGE_A))],
                             video=[str(file)], max_tokens=16, temperature=0.0, fps=FPS,
                             max_frames=MAX_FRAMES):
        if r.token in eos:
            break
        ids.append(r.token)
    resp = greedy(vlm, both)
    assert resp.usage.model_extra["pipeserve"]["video_tokens"] > 0
    assert served_bytes(resp) == token_bytes(tok, ids[:16])
