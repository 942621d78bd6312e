"""kv=turbo: the value codec against its own Gaussian distortion, attention fidelity on the
tiny float32 qwen3 model, greedy decoding solo and batched (merge/extend/filter/extract,
right-padded group prefill, from_dense), serialisation through the prompt-cache codec, the
refusals of check_turbo, and bytes per token."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache

import pipeserve  # noqa: F401  (loads OpenBLAS before mlx does any work)
from pipeserve.kv import attention
from pipeserve.kv.turbo import (K_BITS, V_BITS, BatchTurboKVCache, TurboKVCache, check_turbo,
                               decode_values, encode_values, gaussian_distortion, lloyd_max,
                               pack_bits, rotate, rotation_matrix, turbo_bytes_per_token,
                               unpack_bits, unrotate)
from pipeserve.prompt_cache import codec
from pipeserve.prompt_cache.ram import lend
from pipeserve.model.tiny.text import CORPUS, ensure_model

SETTINGS = [(8, 3), (8, 4), (4, 4), (8, 8), (4, 2)]
# Mean per-(query, head) cosine of layer 0's attention output vs dense over a 2048-token prompt;
# each floor sits just under what this fixed model and seed give (deterministic).
COSINE_FLOOR = {(8, 3): 0.98, (8, 4): 0.995, (4, 4): 0.994, (8, 8): 0.99999, (4, 2): 0.93}
# Group RMS scaling (fp16 scale, 64 samples per group) may cost at most this much over the
# codebook's own Gaussian distortion; it costs less than that (the normalised group has
# lighter tails than a Gaussian).
SCALE_MARGIN = 1.05


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> tuple[Any, Any]:
    model, tok = load(str(ensure_model("qwen3", "tiny", "float32", model_cache)))
    attention.install(model)
    return model, tok


def _cos(a: mx.array, b: mx.array, dim: int) -> mx.array:
    a, b = a.reshape(-1, dim), b.reshape(-1, dim)
    return mx.sum(a * b, -1) / mx.sqrt(mx.sum(a * a, -1) * mx.sum(b * b, -1))


# -- codec -----------------------------------------------------------------------------------
@pytest.mark.parametrize("v_bits", V_BITS)
def test_value_round_trip_error_is_the_codebooks_gaussian_distortion(v_bits: int) -> None:
    x = mx.random.normal((2, 4, 512, 128), key=mx.random.key(v_bits))
    packed, scales = encode_values(x, v_bits, 64)
    back = unrotate(decode_values(packed, scales, v_bits, 128))
    rel_mse = (mx.sum((x - back) ** 2) / mx.sum(x * x)).item()
    bound = gaussian_distortion(v_bits)
    assert rel_mse <= bound * SCALE_MARGIN, (v_bits, rel_mse, bound)
    assert rel_mse >= bound * 0.9, (v_bits, rel_mse, bound)   # really a Lloyd-Max quantizer
    assert packed.nbytes == x.size * v_bits // 8           # exactly v_bits per value
    assert scales.dtype == mx.float16 and scales.shape == (2, 4, 512, 2)


def test_codebooks_match_the_known_lloyd_max_values() -> None:
    # Max (1960): 2 bits ±0.4528 ±1.510; distortion 0.1175 (2 bits), 0.03454 (3), 0.009497 (4)
    assert np.allclose(lloyd_max(2), [-1.510, -0.4528, 0.4528, 1.510], atol=1e-3)
    assert [round(gaussian_distortion(b), 4) for b in (2, 3, 4)] == [0.1175, 0.0345, 0.0095]
    assert 4.0e-5 < gaussian_distortion(8) < 4.2e-5


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotation_is_orthogonal_and_oriented(head_dim: int) -> None:
    r = rotation_matrix(head_dim)
    assert mx.allclose(r @ r.T, mx.eye(head_dim), atol=1e-5).item()
    x = mx.random.normal((3, head_dim), key=mx.random.key(1))
    assert mx.allclose(rotate(x), x @ r, atol=1e-5).item()        # stored as v @ R
    assert mx.allclose(unrotate(x), x @ r.T, atol=1e-5).item()    # output comes back by @ R^T
    assert mx.allclose(unrotate(rotate(x)), x, atol=1e-5).item()
    assert not mx.allclose(rotate(rotate(x)), x, atol=1e-2).item()  # R is not its own inverse


@pytest.mark.parametrize("n", [16, 32, 128])
@pytest.mark.parametrize("bits", V_BITS)
def test_pack_unpack_is_exact(bits: int, n: int) -> None:
    idx = mx.random.randint(0, 1 << bits, (3, 5, n), key=mx.random.key(bits * n)).astype(mx.uint32)
    words = pack_bits(idx, bits)
    assert words.nbytes == idx.size * bits // 8
    assert mx.array_equal(unpack_bits(words, bits, n), idx).item()


# -- fidelity on the tiny model ---------------------------------------------------------------
def test_attention_cosine_vs_dense_over_a_2k_prompt(tiny: tuple[Any, Any]) -> None:
    """Measured on layer 0's attention output (before o_proj), the one place the layout acts
    alone; GQA (4 query heads over 2 KV heads), head_dim 16, causal prefill of 2048 tokens."""
    model, tok = tiny
    ids = mx.array(tok.encode(CORPUS * 2)[:2048])[None]
    layer = model.model.layers[0]
    h = layer.input_layernorm(model.model.embed_tokens(ids))
    attn, o_proj = layer.self_attn, layer.self_attn.o_proj
    attn.o_proj = nn.Identity()
    try:
        dense = attn(h, mask="causal", cache=KVCache())
        outs = {s: attn(h, mask="causal", cache=TurboKVCache(*s)) for s in SETTINGS}
    finally:
        attn.o_proj = o_proj
    print("\n k  v   mean cos   min cos   (layer-0 attention output, 2048 tokens)")
    means = {}
    for (k, v), out in outs.items():
        c = _cos(out, dense, 16)
        means[(k, v)] = c.mean().item()
        print(f" {k}  {v}   {means[(k, v)]:.6f}   {c.min().item():.6f}")
    for s, floor in COSINE_FLOOR.items():
        assert means[s] > floor, (s, means[s], floor)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_attention_at_head_dim_128_with_gqa_matches_dense(dtype: mx.Dtype) -> None:
    """Real head_dim (keys quantized unpadded in groups of 64), 8 query heads over 2 KV heads,
    two rows, a peaked causal attention; against float32 dense SDPA."""
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(2, 8, 3, 128), (2, 2, 300, 128), (2, 2, 300, 128)]))
    dense = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    # just under what these inputs give; bfloat16 (its rounding of q, k) gets a lower 8/8 floor
    floors = {(8, 8): 0.9995 if dtype == mx.float32 else 0.995, (8, 4): 0.99, (8, 3): 0.97}
    for (k_bits, v_bits), floor in floors.items():
        cache = BatchTurboKVCache([0, 0], k_bits, v_bits)
        keys, values = cache.update_and_fetch(k.astype(dtype), v.astype(dtype))
        out = cache.attend(q.astype(dtype), keys, values, scale=0.3, mask="causal")
        assert out.dtype == dtype and out.shape == dense.shape
        cos = _cos(out.astype(mx.float32), dense, 128).mean().item()
        assert cos > floor, (k_bits, v_bits, cos)


# -- greedy decoding ---------------------------------------------------------------------------
def _prefill(model: Any, prompt: list[int], caches: list[Any]) -> mx.array:
    logits = model(mx.array(prompt)[None], cache=caches)
    return mx.argmax(logits[:, -1], axis=-1)


def _decode(model: Any, caches: list[Any], first: mx.array, n: int) -> list[list[int]]:
    """Greedy: n tokens per row starting from `first` (B,), no stopping."""
    tok, out = first, [first]
    for _ in range(n - 1):
        tok = mx.argmax(model(tok[:, None], cache=caches)[:, -1], axis=-1)
        out.append(tok)
    return mx.stack(out, axis=1).tolist()


def _solo(model: Any, prompt: list[int], n: int, **params: int) -> list[int]:
    caches = [TurboKVCache(**params) for _ in model.layers]
    return _decode(model, caches, _prefill(model, prompt, caches), n)[0]


PROMPTS = {"a": [40 + i for i in range(61)], "b": [100 + (i * 7) % 300 for i in range(23)],
           "c": [3, 1, 4, 1, 5, 9, 2, 6], "d": [200 + i for i in range(37)], "e": [11, 12, 13]}


def test_greedy_generation_end_to_end(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    prompt = PROMPTS["a"]
    dense = [KVCache() for _ in model.layers]
    expected = _decode(model, dense, _prefill(model, prompt, dense), 24)[0]
    assert _solo(model, prompt, 24, k_bits=8, v_bits=8) == expected   # k8v8 is dense here
    caches = [TurboKVCache() for _ in model.layers]                     # default k8v3
    first = _prefill(model, prompt, caches)
    got = _decode(model, caches, first, 24)[0]
    assert got == _solo(model, prompt, 24)
    assert all(0 <= t < model.args.vocab_size for t in got)
    assert [c.offset for c in caches] == [len(prompt) + 23] * len(caches)
    assert caches[0].nbytes < dense[0].nbytes / 2
    # Roll back 10 tokens (as verify does) and decode again: the same continuation.
    assert all(c.trim(10) == 10 for c in caches)
    assert _decode(model, caches, mx.array([got[13]]), 11)[0] == got[13:]


def test_batched_rows_equal_each_row_alone(tiny: tuple[Any, Any]) -> None:
    """a and b merge; c joins (extend) after 4 steps; a, the longest, leaves (filter drops the
    padding all survivors share) after 8; b is extracted to decode alone for the last steps."""
    model, _ = tiny
    n = 24
    expected = {r: _solo(model, PROMPTS[r], n) for r in "abc"}
    rows: dict[str, list[Any]] = {}
    firsts = {}
    for r in "abc":
        rows[r] = [TurboKVCache() for _ in model.layers]
        firsts[r] = _prefill(model, PROMPTS[r], rows[r])
    batch = [TurboKVCache.merge([a, b]) for a, b in zip(rows["a"], rows["b"])]
    assert isinstance(batch[0], BatchTurboKVCache)
    got = {"a": [firsts["a"].item()], "b": [firsts["b"].item()]}
    order = ["a", "b"]

    def step() -> None:
        toks = mx.array([got[r][-1] for r in order])
        nxt = mx.argmax(model(toks[:, None], cache=batch)[:, -1], axis=-1).tolist()
        for r, t in zip(order, nxt):
            got[r].append(t)

    for _ in range(4):
        step()
    for mine, theirs in zip(batch, rows["c"]):
        mine.extend(BatchTurboKVCache.merge([theirs]))
    order.append("c")
    got["c"] = [firsts["c"].item()]
    for _ in range(4):
        step()
    padded = batch[0].size()
    for layer in batch:
        layer.filter(mx.array([1, 2]))
    order = ["b", "c"]
    assert batch[0].size() < padded   # a's length was the padding b and c shared
    while len(got["c"]) < 16:
        step()
    assert got["a"] == expected["a"][:9]
    assert got["c"] == expected["c"][:16]
    alone = [layer.extract(0) for layer in batch]
    assert isinstance(alone[0], TurboKVCache) and alone[0].offset == len(PROMPTS["b"]) + 19
    got["b"] += _decode(model, alone, mx.array([got["b"][-1]]), 5)[0][1:]
    assert got["b"] == expected["b"]


def test_right_padded_group_prefill_equals_solo(tiny: tuple[Any, Any]) -> None:
    """The engine's prefill_group path: empty rows merged, prepare(right_padding), one padded
    forward, finalize() rolls the padding left, then batched decode."""
    model, _ = tiny
    names, n = "de", 12
    prompts = [PROMPTS[r] for r in names]
    width = max(map(len, prompts))
    caches = [TurboKVCache.merge([TurboKVCache() for _ in names]) for _ in model.layers]
    for c in caches:
        c.prepare(lengths=list(map(len, prompts)), right_padding=[width - len(p) for p in prompts])
    tokens = mx.array([p[:-1] + [0] * (width - len(p)) for p in prompts])
    model(tokens, cache=caches)
    for c in caches:
        c.finalize()
    last = mx.array([p[-1] for p in prompts])
    got = _decode(model, caches, mx.argmax(model(last[:, None], cache=caches)[:, -1], axis=-1), n)
    assert got == [_solo(model, p, n) for p in prompts]


def test_from_dense_converts_rows_and_batches(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    n = 10
    dense = {r: [KVCache() for _ in model.layers] for r in "bd"}
    firsts = {r: _prefill(model, PROMPTS[r], dense[r]) for r in "bd"}
    solo = {r: _decode(model, [TurboKVCache.from_dense(c, k_bits=4, v_bits=4) for c in dense[r]],
                       firsts[r], n)[0] for r in "bd"}
    stored = TurboKVCache.from_dense(dense["b"][0], k_bits=4, v_bits=4)
    assert stored.offset == len(PROMPTS["b"]) and dense["b"][0].offset == len(PROMPTS["b"])
    merged = [BatchKVCache.merge([b, d]) for b, d in zip(dense["b"], dense["d"])]
    batch = [BatchTurboKVCache.from_dense(c, k_bits=4, v_bits=4) for c in merged]
    assert batch[0].left_padding.tolist() == [len(PROMPTS["d"]) - len(PROMPTS["b"]), 0]
    got = _decode(model, batch, mx.concatenate([firsts["b"], firsts["d"]]), n)
    assert got == [solo["b"], solo["d"]]


def test_prompt_cache_codec_and_lend_keep_a_turbo_cache_usable(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    prompt, n = PROMPTS["b"], 12
    expected = _solo(model, prompt, n)
    caches = [TurboKVCache() for _ in model.layers]
    first = _prefill(model, prompt, caches)
    mx.eval([c.state for c in caches])
    _, restored = codec.decode(codec.encode(prompt, caches), verify=True)
    assert type(restored[0]) is TurboKVCache and isinstance(restored[0].keys, tuple)
    assert _decode(model, restored, first, n)[0] == expected
    borrowed = [lend(c) for c in caches]
    assert _decode(model, borrowed, first, n)[0] == expected
    assert caches[0].offset == len(prompt)                 # the donor is untouched
    assert _decode(model, caches, first, n)[0] == expected


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    ((128, 3, 3), "kv.k_bits=3 is not supported by kv=turbo; allowed: (2, 4, 5, 8)"),
    ((128, 8, 6), "kv.v_bits=6 is not supported by kv=turbo; allowed: (2, 3, 4, 5, 8)"),
    ((96, 8, 3), "head_dim=96 is not supported by kv=turbo: the Hadamard rotation needs a "
                 "power of two"),
    ((8, 8, 3), "head_dim=8 is not supported"),
])
def test_check_turbo_refuses_with_a_clear_message(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_turbo(*args)
    assert message in str(err.value)


def test_a_cache_refuses_bad_bits_and_head_dims() -> None:
    with pytest.raises(ValueError, match="kv.v_bits=7"):
        TurboKVCache(v_bits=7)
    cache = TurboKVCache()
    x = mx.zeros((1, 2, 4, 80))
    with pytest.raises(ValueError, match="head_dim=80"):
        cache.update_and_fetch(x, x)
    assert cache.empty() and cache.offset == 0


# -- bytes ----------------------------------------------------------------------------------------
def test_bytes_per_token_for_4096_tokens() -> None:
    """A Qwen3-8B-shaped layer (8 KV heads, head_dim 128, bf16): nbytes equals the formula and
    k8v3 is (8+3)/32 of dense bf16 plus its scales."""
    heads, dim, tokens = 8, 128, 4096
    dense = heads * dim * 2 * 2 * tokens
    x = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(0)).astype(mx.bfloat16)
    print("\n k  v   bytes/token   ratio vs bf16   (8 KV heads, head_dim 128, 4096 tokens)")
    ratios = {}
    for k_bits in K_BITS:
        for v_bits in V_BITS:
            cache = TurboKVCache(k_bits, v_bits)
            cache.update_and_fetch(x, x)
            per_token = turbo_bytes_per_token(heads, dim, k_bits, v_bits)
            assert cache.nbytes == per_token * tokens
            ratios[(k_bits, v_bits)] = cache.nbytes / dense
            print(f" {k_bits}  {v_bits}   {per_token:5d}         {ratios[(k_bits, v_bits)]:.4f}")
    scales = (2 * 2 * 2 + 2 * 2) / (dim * 2 * 2)   # two key groups (scale + bias), two value groups
    assert ratios[(8, 3)] == pytest.approx(11 / 32 + scales)
    assert 0.36 < ratios[(8, 3)] < 0.37
    # the tiny model's layer: head_dim 16 keys are zero-padded to mx.quantize's 32, float32 scales
    assert turbo_bytes_per_token(2, 16, 8, 3, key_scale_bytes=4) == 2 * (32 + 8 + 6 + 2)
