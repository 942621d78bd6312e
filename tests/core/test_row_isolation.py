"""Row isolation on a real engine (tiny model, no HTTP): a row whose own sampling work raises
inside the sample stage fails alone — a Failed event naming its stage, no exception text —
while the rows of the same steps produce exactly what they produce alone. And the truncation
filters, run uncompiled, equal mlx-lm's compiled ones."""
from __future__ import annotations

import asyncio
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc

from pipeserve.errors import StageError
from pipeserve.request import SamplingParams
from pipeserve.core.sampling import min_p, sampling_logits, top_k, top_p

NO_EOS = {0: -100.0, 2: -100.0}
PROMPTS = [[5, 17, 99, 3], [44, 8, 250, 7, 61], [300, 12]]


def outcome(harness: Any, reqs: list[Any]) -> list[Any]:
    async def one(req: Any) -> Any:
        try:
            return (await harness.generate_many([req]))[0]["ids"]
        except Exception as e:   # the Failed event's error
            return e
    async def run() -> list[Any]:
        return await asyncio.gather(*(one(r) for r in reqs))
    return asyncio.run(run())


def test_a_row_whose_sampling_raises_fails_alone(engine_factory: Any) -> None:
    """repetition_penalty -1 passes nothing at admission here (the request goes straight to
    the engine) and makes mlx-lm's penalty raise when the row's sampling state is built."""
    h = engine_factory("cache=off")
    alone = [h.generate(p, max_tokens=24, logit_bias=NO_EOS)["ids"] for p in PROMPTS]
    sampled_alone = h.generate(PROMPTS[0], max_tokens=24, temperature=1.0, seed=5,
                               logit_bias=NO_EOS)["ids"]
    good = [h.request(p, max_tokens=24, logit_bias=NO_EOS) for p in PROMPTS]
    sampled = h.request(PROMPTS[0], max_tokens=24, temperature=1.0, seed=5, logit_bias=NO_EOS)
    bad = h.request(PROMPTS[1], max_tokens=24, temperature=1.0, repetition_penalty=-1.0)
    got = outcome(h, [*good, sampled, bad])
    assert got[:3] == alone
    assert got[3] == sampled_alone
    err = got[4]
    assert isinstance(err, StageError) and err.request_ids == [bad.request_id]
    assert "internal error" in err.message and "ValueError" not in err.message
    # the engine goes on: the same rows again, after the failure
    assert outcome(h, [h.request(p, max_tokens=24, logit_bias=NO_EOS) for p in PROMPTS]) == alone


def _lp(seed: int, vocab: int = 300) -> mx.array:
    x = mx.random.normal((1, vocab), key=mx.random.key(seed)) * 2
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_filters_equal_mlx_lm(seed: int) -> None:
    lp = _lp(seed)
    for p in (0.1, 0.5, 0.9, 0.99):
        assert mx.array_equal(top_p(lp, p), apply_top_p(lp, p)).item()
    for p in (0.01, 0.2, 0.9):
        assert mx.array_equal(min_p(lp, p), apply_min_p(lp, p)).item()
    for k in (1, 5, 299):
        assert mx.array_equal(top_k(lp, k), apply_top_k(lp, k)).item()


def test_xtc_is_the_exact_mixture_of_mlx_lms_two_outcomes() -> None:
    """mlx-lm's XTC cuts with probability p (a uniform draw) and otherwise leaves the logits;
    our distribution is (1 - p) * plain + p * cut, with mlx-lm's cut (its probability 1)."""
    lp = _lp(7)
    eos = [2]
    for p, threshold in ((0.5, 0.01), (1.0, 0.02), (0.25, 0.005)):
        sp = SamplingParams(temperature=0.7, xtc_probability=p, xtc_threshold=threshold)
        ours = mx.softmax(sampling_logits(lp, sp, eos), axis=-1)
        cut = apply_xtc(lp, 1.0, threshold, eos)
        want = (1 - p) * mx.softmax(lp / 0.7, axis=-1) + p * mx.softmax(cut / 0.7, axis=-1)
        assert np.allclose(np.array(ours), np.array(want), atol=1e-6)
        assert not np.allclose(np.array(ours), np.array(mx.softmax(lp / 0.7, axis=-1)))


def test_edge_values_stay_finite() -> None:
    """top_k past the vocabulary keeps every token, top_p 0 keeps the best, and a tiny
    temperature still leaves the best token finite (no all -inf row)."""
    lp = _lp(3)
    best = int(mx.argmax(lp).item())
    plain = sampling_logits(lp, SamplingParams(temperature=1.0), [])
    assert mx.array_equal(sampling_logits(lp, SamplingParams(temperature=1.0, top_k=10 ** 6), []),
                          plain).item()
    only = sampling_logits(lp, SamplingParams(temperature=1.0, top_p=0.0), [])
    assert np.isfinite(np.array(only)).sum() == 1 and np.isfinite(np.array(only))[0, best]
    cold = np.array(sampling_logits(lp, SamplingParams(temperature=1e-30), []))
    assert cold[0, best] == 0 and np.isfinite(cold).sum() >= 1


def test_with_drafts_a_failing_row_leaves_the_verify_steps_exact(engine_factory: Any) -> None:
    """draft=ngram: the bystanders' drafts are verified in the same forwards as the failing
    row (sample's verify distributions, then verify's acceptance read its state)."""
    h = engine_factory("cache=off", "draft=ngram")
    loop = [5, 17, 99, 3] * 6   # a repeating prompt: the n-gram proposer drafts from it
    alone = [h.generate(p, max_tokens=32, logit_bias=NO_EOS)["ids"] for p in (loop, PROMPTS[1])]
    verified = h.metrics.spec_verifies.labels("ngram")._value.get()
    assert verified > 0
    bad = h.request(PROMPTS[2], max_tokens=24, temperature=1.0, repetition_penalty=-1.0)
    got = outcome(h, [h.request(loop, max_tokens=32, logit_bias=NO_EOS),
                      h.request(PROMPTS[1], max_tokens=32, logit_bias=NO_EOS), bad])
    assert got[:2] == alone
    assert isinstance(got[2], StageError) and got[2].request_ids == [bad.request_id]
    assert h.metrics.spec_verifies.labels("ngram")._value.get() > verified


def test_a_row_whose_vision_tower_raises_fails_alone(engine_factory: Any) -> None:
    """A request whose pixels reach the engine malformed (here: a third of the processor's
    pixel rows cut off after tokenize, so Gemma 3's SigLIP patch grid no longer fits its
    position table) makes the tower raise on that row's own chunk: that row fails alone, with
    a Failed event, while an image row and a text row in the same steps produce exactly what
    they produce alone, and the engine serves on."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (pip install -e '.[vision]')")
    import io

    from PIL import Image

    from pipeserve.markup.output import OutputMarkup
    from pipeserve.request import PromptInput, Request
    from pipeserve.vision.media import MediaPart
    from pipeserve.stages.tokenize import Tokenize

    h = engine_factory("model=tiny_vlm", "model.arch=gemma3", "cache=off")
    tokenize = Tokenize(h.cfg, h.loaded, OutputMarkup.infer(h.loaded.tokenizer))

    def png(seed: int) -> bytes:
        rgb = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        return buf.getvalue()

    def image_request(seed: int, cut: bool = False) -> Request:
        msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}]
        req = Request(request_id=f"img-{seed}-{cut}", endpoint="test",
                      inputs=PromptInput(messages=msg, media=[
                          MediaPart(where="messages[0].content[0]", data=png(seed))]),
                      sampling=SamplingParams(temperature=0.0, max_tokens=12, logit_bias=NO_EOS))
        req = asyncio.run(tokenize(req))
        if cut:
            pixels = req.media.pixels["pixel_values"]
            req.media.pixels["pixel_values"] = pixels[..., : pixels.shape[-1] * 2 // 3, :]
        return req

    def text_request() -> Request:
        return h.request(PROMPTS[1], max_tokens=12, logit_bias=NO_EOS)

    alone = [outcome(h, [image_request(1)])[0], outcome(h, [text_request()])[0]]
    assert all(isinstance(ids, list) and len(ids) == 12 for ids in alone)
    together = outcome(h, [image_request(1), image_request(2, cut=True), text_request()])
    assert together[0] == alone[0] and together[2] == alone[1]
    assert isinstance(together[1], StageError), together[1]
    assert outcome(h, [image_request(1)])[0] == alone[0]   # and it serves on
