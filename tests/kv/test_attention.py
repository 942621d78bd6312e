"""The composed attention used on CUDA for prompt chunks and verify steps (pipeserve/kv/attention.py)
matches MLX's fused attention, and a batched engine run through it gives the same tokens."""
from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from pipeserve.kv import attention
from tests.core.test_batching import EOS_OFF, PROMPTS


@pytest.mark.parametrize("q_len", [1, 5, 40])   # 40: a whole prompt chunk (T = 40)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded", "additive"])
def test_composed_equals_fused(q_len: int, mask_kind: str) -> None:
    key = mx.random.key(3)
    kq, kk, kv = mx.random.split(key, 3)
    B, Hq, Hkv, T, D = 3, 8, 2, 40, 16
    q = mx.random.normal((B, Hq, q_len, D), key=kq)
    k = mx.random.normal((B, Hkv, T, D), key=kk)
    v = mx.random.normal((B, Hkv, T, D), key=kv)
    mask = {"none": None, "causal": "causal",
            "padded": create_causal_mask(q_len, offset=T - q_len,
                                         left_padding=mx.array([0, 7, 13])),
            "additive": mx.random.normal((q_len, T), key=kq) * 0.5}[mask_kind]
    if mask_kind == "none" and q_len > 1:
        mask = "causal"
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
    mine = attention.composed_attention(q, k, v, D ** -0.5, mask)
    assert mx.allclose(fused, mine, atol=1e-5, rtol=1e-4).item()


def test_composed_only_where_its_scores_fit(monkeypatch) -> None:
    """A prompt chunk of many rows and a verify forward compose; decode (one query per row,
    masked for a padded batch or not) keeps MLX's fused kernel, and with composed_decode only
    the masked one composes; a chunk whose float32 scores exceed the budget keeps the fused
    (flash) kernel."""
    monkeypatch.setattr(attention, "composed", True)
    used: list[str] = []
    monkeypatch.setattr(attention, "composed_attention", lambda *a: used.append("composed"))
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, **k: used.append("fused"))
    rows_q = mx.zeros((128, 32, 75, 8))      # 128 prompts of 75 tokens, 32 heads: 92 MB
    rows_k = mx.zeros((128, 8, 75, 8))
    attention.dense_attention(rows_q, rows_k, rows_k, 1.0, "causal")
    one = mx.zeros((1, 32, 1, 8))
    attention.dense_attention(one, rows_k[:1], rows_k[:1], 1.0, None)
    padded = mx.ones((128, 1, 1, 75), dtype=mx.bool_)   # a padded decode batch's mask
    attention.dense_attention(rows_q[:, :, :1], rows_k, rows_k, 1.0, padded)
    attention.dense_attention(rows_q[:, :, :5], rows_k, rows_k, 1.0, "causal")   # verify: 1 + 4
    long_q, long_k = mx.zeros((1, 32, 2048, 8)), mx.zeros((1, 8, 4096, 8))   # 1 GiB
    attention.dense_attention(long_q, long_k, long_k, 1.0, "causal")
    assert used == ["composed", "fused", "fused", "composed", "fused"]
    used.clear()
    monkeypatch.setattr(attention, "composed_decode", True)   # model.composed_decode=true
    attention.dense_attention(rows_q[:, :, :1], rows_k, rows_k, 1.0, padded)
    attention.dense_attention(one, rows_k[:1], rows_k[:1], 1.0, None)
    assert used == ["composed", "fused"]


def test_one_rows_full_prompt_chunk_stays_fused(monkeypatch) -> None:
    """A long prompt's full chunks (scheduler.prefill_chunk queries, one row) keep the fused
    kernel even where their scores would fit the budget: their shapes recur in every long
    prompt. A shorter chunk of that row (a prompt's last) and a group of rows with the same
    query length still compose."""
    monkeypatch.setattr(attention, "composed", True)
    monkeypatch.setattr(attention, "full_chunk", 64)
    used: list[str] = []
    monkeypatch.setattr(attention, "composed_attention", lambda *a: used.append("composed"))
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, **k: used.append("fused"))
    keys = mx.zeros((1, 2, 128, 8))
    attention.dense_attention(mx.zeros((1, 4, 64, 8)), keys, keys, 1.0, "causal")
    attention.dense_attention(mx.zeros((1, 4, 63, 8)), keys, keys, 1.0, "causal")
    group = mx.zeros((2, 2, 128, 8))
    attention.dense_attention(mx.zeros((2, 4, 64, 8)), group, group, 1.0, "causal")
    assert used == ["fused", "composed", "composed"]


@pytest.mark.parametrize("decode", [False, True])   # model.composed_decode
def test_grouped_prompts_with_cache_hits_through_composed_attention(engine_factory,
                                                                      monkeypatch,
                                                                      decode: bool) -> None:
    """The CUDA path on the CPU, dense KV: prompt groups of different lengths, some rows
    joining with a prompt-cache prefix (left-aligned merged caches, right-padded chunks), all
    composed (with model.composed_decode, the padded batch's decode steps too), give the
    tokens the fused path gives."""
    base = [300 + (i * 11) % 97 for i in range(48)]
    prompts = [base + [5, 6, 7], base[:30] + [9] * 12, [4, 4, 2], base + list(range(60, 90)),
               [17 + i for i in range(70)]]

    def run(h) -> list[list[int]]:
        first = [h.request(p, max_tokens=10, logit_bias=EOS_OFF) for p in prompts[:2]]
        out = [g["ids"] for g in asyncio.run(h.generate_many(first))]   # fills the cache
        rest = [h.request(p, max_tokens=10, logit_bias=EOS_OFF) for p in prompts]
        got = asyncio.run(h.generate_many(rest))
        return out + [g["ids"] for g in got], sum(g["cached"] or 0 for g in got)

    plain, _ = run(engine_factory("model=llama", "scheduler.max_batch=8"))
    import pipeserve.core.step
    monkeypatch.setattr(attention, "on_cuda", lambda: True)   # the CUDA path, on the CPU
    monkeypatch.setattr(pipeserve.core.step, "on_cuda", lambda: True)
    h = engine_factory("model=llama", "scheduler.max_batch=8",
                       f"model.composed_decode={decode}")   # installs dispatch
    assert attention.composed and attention.composed_decode is decode
    calls = {"prompt": 0, "decode": 0}
    composed = attention.composed_attention

    def counting(q, *a):
        calls["prompt" if q.shape[2] > 1 else "decode"] += 1
        return composed(q, *a)
    monkeypatch.setattr(attention, "composed_attention", counting)
    got, cached = run(h)
    assert got == plain and cached > 0 and calls["prompt"] > 0
    assert (calls["decode"] > 0) is decode
    monkeypatch.setattr(attention, "composed", False)
    monkeypatch.setattr(attention, "composed_decode", False)


def test_batched_engine_through_composed_attention_gives_the_same_tokens(
        engine_factory, monkeypatch) -> None:
    plain = engine_factory("model=llama")
    reqs = [plain.request(p, max_tokens=12, logit_bias=EOS_OFF) for p in PROMPTS[:4]]
    expected = [g["ids"] for g in asyncio.run(plain.generate_many(reqs))]
    monkeypatch.setattr(attention, "on_cuda", lambda: True)   # the CUDA path, on the CPU
    h = engine_factory("model=llama", "kv=paged", "kv.block_size=16")   # installs dispatch
    assert attention.composed
    reqs = [h.request(p, max_tokens=12, logit_bias=EOS_OFF) for p in PROMPTS[:4]]
    assert [g["ids"] for g in asyncio.run(h.generate_many(reqs))] == expected
    monkeypatch.setattr(attention, "composed", False)


@pytest.mark.parametrize("q_len,mask_kind", [(1, "none"), (6, "causal"), (1, "padded")])
@pytest.mark.parametrize("layout", ["q8", "q4", "turbo"])
def test_cuda_dequantized_path_equals_the_quantized_arithmetic(monkeypatch, layout: str,
                                                               q_len: int, mask_kind: str) -> None:
    """On CUDA the quantized layouts dequantize once and run the dense attention (MLX has no
    quantized_matmul kernel for these shapes there); forced here on the CPU, the result equals
    the quantized arithmetic the CPU and Metal keep."""
    from pipeserve.kv import quantized, turbo_codec
    B, Hq, Hkv, T, D = 3, 8, 2, 200, 128
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(B, Hq, q_len, D), (B, Hkv, T, D), (B, Hkv, T, D)]))
    mask = {"none": None, "causal": "causal",
            "padded": create_causal_mask(q_len, offset=T - q_len,
                                         left_padding=mx.array([0, 7, 13]))}[mask_kind]
    if layout == "turbo":
        keys, values = turbo_codec.encode_keys(k, 8), turbo_codec.encode_values(v, 3)

        def attend() -> mx.array:
            return turbo_codec.turbo_attention(q, keys, values, scale=D ** -0.5, mask=mask,
                                               k_bits=8, v_bits=3, group_size=64)
    else:
        bits = int(layout[1])
        keys, values = (tuple(mx.quantize(x, group_size=64, bits=bits)) for x in (k, v))

        def attend() -> mx.array:
            return quantized.quantized_attention(q, keys, values, scale=D ** -0.5, mask=mask,
                                                 group_size=64, k_bits=bits, v_bits=bits)
    reference = attend()
    for module in (quantized, turbo_codec):
        monkeypatch.setattr(module, "on_cuda", lambda: True)
    for composed in (False, True):
        monkeypatch.setattr(attention, "composed", composed)
        assert mx.allclose(attend(), reference, atol=1e-4, rtol=1e-3).item(), composed
