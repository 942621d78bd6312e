"""Affine-quantized KV (q8/q4, mixed k/v bits) and delayed conversion on real tiny float32
models: greedy tokens equal mlx-lm's quantized KV, batched rows (joining, leaving, in mixed
phases) equal the same rows alone, and the byte counts match the format.

The tiny models use head_dim 16, which mx.quantize cannot group (32/64/128), so these tests build
the same tiny qwen3/llama shapes and deterministic weights with head_dim 64."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipeserve  # noqa: F401  (loads OpenBLAS first)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.utils import _get_classes

from pipeserve.kv import attention
from pipeserve.kv.delayed import DelayedBatchKVCache, DelayedKVCache
from pipeserve.kv.quantized import AffineKVCache, BatchAffineKVCache
from pipeserve.prompt_cache import codec
from pipeserve.prompt_cache.ram import lend
from pipeserve.model.tiny.text import CORPUS, _fill, ensure_model

Caches = list[Any]


def _build(arch: str, models: Path) -> Any:
    path = ensure_model(arch, "tiny", "float32", models)
    config = {**json.loads((path / "config.json").read_text()), "head_dim": 64}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = [(name, mx.array(_fill(name, tuple(p.shape), arch, config["hidden_size"])))
               for name, p in tree_flatten(model.parameters())]
    model.update(tree_unflatten(weights))
    model.eval()
    attention.install(model)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("kvq-models")
    return {arch: _build(arch, root) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def corpus_ids(tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    _, tok = load(str(ensure_model("qwen3", "tiny", "float32", tmp_path_factory.mktemp("tok"))))
    return tok.encode(CORPUS)


# -- a small greedy driver ------------------------------------------------------------------
def _pick(logits: mx.array) -> mx.array:
    logits = logits[:, -1, :]
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def prefill(model: Any, caches: Caches, prompt: list[int]) -> None:
    model(mx.array(prompt[:-1])[None], cache=caches)
    mx.eval([c.state for c in caches])


def decode(model: Any, caches: Caches, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = _pick(model(mx.array([[token]]), cache=caches)).item()
        out.append(token)
    return out


def n_caches(model: Any) -> int:
    """Caches the model takes: one per layer, less a Gemma 4's KV-shared layers."""
    return len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)


def solo(model: Any, make: Callable[[], Any], prompt: list[int], n: int) -> list[int]:
    caches = [make() for _ in range(n_caches(model))]
    prefill(model, caches, prompt)
    return decode(model, caches, prompt[-1], n)


def mlx_lm_tokens(model: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw)]


def batched(model: Any, make: Callable[[], Any], prompts: list[list[int]], quotas: list[int],
            join_at: dict[int, int], extra: int = 4,
            watch: Callable[[list[Any], list[int]], None] | None = None) -> dict[int, list[int]]:
    """Rows not in `join_at` start merged; row j joins (extend) before step join_at[j]; a row
    leaves (filter) once it has its quota, after `extra` more tokens decoded alone from its
    extracted caches (so extract is checked too)."""
    def own(j: int) -> Caches:
        caches = [make() for _ in range(n_caches(model))]
        prefill(model, caches, prompts[j])
        out[j] = []
        return caches

    out: dict[int, list[int]] = {}
    rows = [j for j in range(len(prompts)) if j not in join_at]
    layers = [type(c[0]).merge(list(c)) for c in zip(*(own(j) for j in rows))]
    step = 0
    while rows:
        for j in [j for j, at in join_at.items() if at == step]:
            for mine, c in zip(layers, own(j)):
                mine.extend(type(c).merge([c]))
            rows.append(j)
        nxt = [out[r][-1] if out[r] else prompts[r][-1] for r in rows]
        picked = _pick(model(mx.array(nxt)[:, None], cache=layers)).tolist()
        for r, t in zip(rows, picked):
            out[r].append(t)
        if watch is not None:
            watch(layers, rows)
        done = [i for i, r in enumerate(rows) if len(out[r]) == quotas[r]]
        for i in done:
            alone = [layer.extract(i) for layer in layers]
            out[rows[i]] += decode(model, alone, out[rows[i]][-1], extra)
        if done:
            keep = [i for i in range(len(rows)) if i not in done]
            rows = [rows[i] for i in keep]
            if keep:
                for layer in layers:
                    layer.filter(mx.array(keep, dtype=mx.int32))
        step += 1
    return out


def _prompts(ids: list[int], lengths: list[int]) -> list[list[int]]:
    return [ids[100 * i:100 * i + n] for i, n in enumerate(lengths)]


def affine(k_bits: int, v_bits: int | None = None) -> Callable[[], AffineKVCache]:
    return lambda: AffineKVCache(k_bits, k_bits if v_bits is None else v_bits, 64)


def late(start: int, bits: int,
         on_convert: Callable[[int], None] | None = None) -> Callable[[], DelayedKVCache]:
    return lambda: DelayedKVCache(start, AffineKVCache, on_convert=on_convert, k_bits=bits,
                                  v_bits=bits, group_size=64)


# -- per-row equals mlx-lm ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bits", [8, 4])
def test_per_row_greedy_equals_mlx_lm_quantized_cache(models, corpus_ids, arch, bits) -> None:
    model = models[arch]
    prompt = corpus_ids[900:1200]
    ours = solo(model, affine(bits), prompt, 24)
    theirs = mlx_lm_tokens(model, prompt, 24,
                           prompt_cache=[QuantizedKVCache(64, bits) for _ in model.layers])
    assert ours == theirs
    if bits == 4:   # the comparison has teeth: q4 changes this model's greedy text
        assert ours != solo(model, KVCache, prompt, 24)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bits,start", [(8, 0), (4, 0), (4, 310), (8, 305)])
def test_delayed_equals_mlx_lm_quantized_kv_start(models, corpus_ids, arch, bits, start) -> None:
    model = models[arch]
    prompt = corpus_ids[900:1200]
    conversions: list[int] = []
    ours = solo(model, late(start, bits, conversions.append), prompt, 24)
    assert ours == mlx_lm_tokens(model, prompt, 24, kv_bits=bits, kv_group_size=64,
                                 quantized_kv_start=start)
    assert len(conversions) == len(model.layers)


def test_delayed_row_stays_dense_below_its_start(models, corpus_ids) -> None:
    model = models["qwen3"]
    prompt = corpus_ids[900:1200]
    caches = [late(400, 4)() for _ in model.layers]
    prefill(model, caches, prompt)
    got = decode(model, caches, prompt[-1], 24)
    assert got == solo(model, KVCache, prompt, 24)
    assert all(c.converted_at is None for c in caches)
    assert caches[0].nbytes == 2 * 2 * 512 * 64 * 4   # k+v, 2 heads, 2 steps of 256, f32


def test_conversion_happens_after_the_forward_that_reaches_start(models, corpus_ids) -> None:
    model = models["llama"]
    prompt = corpus_ids[900:1200]
    seen: list[int] = []
    caches = [late(305, 4, seen.append)() for _ in model.layers]
    prefill(model, caches, prompt)            # 299 tokens: still dense
    assert [c.converted_at for c in caches] == [None, None]
    decode(model, caches, prompt[-1], 6)      # offsets 300..305
    assert [c.converted_at for c in caches] == [305, 305]
    assert seen == [305, 305]
    # k+v, 2 heads, 305 tokens: 64 4-bit codes (32 bytes) + f32 scale and bias (8 bytes)
    assert caches[0].nbytes == 2 * 2 * 305 * (32 + 8)


# -- batched equals solo ------------------------------------------------------------------
LENGTHS = [300, 200, 260, 150]
QUOTAS = [24, 10, 20, 16]


@pytest.mark.parametrize("arch,make", [("qwen3", affine(8)), ("llama", affine(4)),
                                       ("qwen3", affine(8, 4))], ids=["q8", "q4", "k8v4"])
def test_affine_batch_equals_solo(models, corpus_ids, arch, make) -> None:
    model = models[arch]
    prompts = _prompts(corpus_ids, LENGTHS)
    got = batched(model, make, prompts, QUOTAS, join_at={3: 4})
    for r, (p, n) in enumerate(zip(prompts, QUOTAS)):
        assert got[r] == solo(model, make, p, n + 4), f"row {r}"


def test_delayed_batch_rows_in_mixed_phases_equal_solo(models, corpus_ids) -> None:
    """start=280: rows 1 and 2 start dense and cross the boundary inside the batch at different
    steps, row 0 joins them already converted, row 3 joins dense and crosses soon after, row 4
    joins once every row has converted (dense storage is rebuilt) and stays dense."""
    model = models["qwen3"]
    make = late(280, 4)
    prompts = _prompts(corpus_ids, [300, 275, 268, 278, 100])
    quotas = [28, 16, 24, 20, 16]
    phases: list[tuple[bool, bool]] = []
    got = batched(model, make, prompts, quotas, join_at={0: 1, 3: 4, 4: 15},
                  watch=lambda layers, rows: phases.append((layers[0].dense is not None,
                                                            layers[0].target is not None)))
    for r, (p, n) in enumerate(zip(prompts, quotas)):
        assert got[r] == solo(model, make, p, n + 4), f"row {r}"
    assert phases[0] == (True, False)      # all dense until row 0 joins
    assert (True, True) in phases          # mixed phases shared one forward
    assert (False, True) in phases         # dense storage dropped once all rows converted
    assert phases[-1] == (True, False)     # only the late dense row is left
    assert solo(model, make, prompts[1], 20) != solo(model, KVCache, prompts[1], 20)


def test_delayed_extract_keeps_phase_and_boundary(models, corpus_ids) -> None:
    model = models["llama"]
    rows = []
    for prompt in _prompts(corpus_ids, [300, 120]):
        caches = [late(250, 8)() for _ in model.layers]
        prefill(model, caches, prompt)
        rows.append(caches)
    batch = [DelayedKVCache.merge(list(layer)) for layer in zip(*rows)]
    assert batch[0].converted_at == [299, None]
    assert batch[0].dense is not None and batch[0].target is not None
    back = [layer.extract(0) for layer in batch], [layer.extract(1) for layer in batch]
    assert [c.converted_at for c in back[0]] == [299, 299] and back[0][0].offset == 299
    assert [c.converted_at for c in back[1]] == [None, None] and back[1][0].offset == 119
    assert back[1][0].nbytes == 2 * 119 * 2 * 64 * 4   # keys+values, 2 heads, f32, no padding


@pytest.mark.parametrize("make", [late(200, 8), affine(4)], ids=["delayed-q8", "q4"])
def test_right_padded_prefill_group_equals_solo(models, corpus_ids, make) -> None:
    """As pipeserve/core/forward.py groups prompts: empty rows merged, one right-padded forward, padding
    rolled left by finalize(); delayed rows cross start=200 in that forward or later."""
    model = models["qwen3"]
    prompts = _prompts(corpus_ids, [260, 150, 199])
    bodies = [p[:-1] for p in prompts]
    width = max(map(len, bodies))
    layers = [type(make()).merge([make() for _ in prompts]) for _ in model.layers]
    for layer in layers:
        layer.prepare(lengths=[len(b) for b in bodies],
                      right_padding=[width - len(b) for b in bodies])
    model(mx.array([b + [0] * (width - len(b)) for b in bodies]), cache=layers)
    for layer in layers:
        layer.finalize()
    is_delayed = isinstance(layers[0], DelayedBatchKVCache)
    assert not is_delayed or layers[0].converted_at == [259, None, None]
    tokens, outs = [p[-1] for p in prompts], [[] for _ in prompts]
    for _ in range(12):
        tokens = _pick(model(mx.array(tokens)[:, None], cache=layers)).tolist()
        for o, t in zip(outs, tokens):
            o.append(t)
    assert not is_delayed or layers[0].converted_at == [259, None, 200]
    assert outs == [solo(model, make, p, 12) for p in prompts]


# -- storage and interchange ----------------------------------------------------------------
def test_converted_row_survives_codec_and_lend(models, corpus_ids) -> None:
    model = models["qwen3"]
    prompt = corpus_ids[900:1200]
    caches = [late(100, 4)() for _ in model.layers]
    prefill(model, caches, prompt)
    expected = solo(model, late(100, 4), prompt, 12)
    _, restored = codec.decode(codec.encode(prompt[:-1], caches), verify=True)
    assert decode(model, restored, prompt[-1], 12) == expected
    borrowed = [lend(c) for c in caches]
    decode(model, borrowed, 7, 5)                        # the borrower writes
    assert decode(model, caches, prompt[-1], 12) == expected   # the donor is intact


def test_mixed_bits_attention_close_to_dense() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s, dtype=np.float32))
               for s in ((1, 8, 4, 128), (1, 2, 300, 128), (1, 2, 300, 128)))
    dense = mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask=None)

    def run(k_bits: int, v_bits: int) -> mx.array:
        cache = AffineKVCache(k_bits, v_bits, 64)
        qk, qv = cache.update_and_fetch(k, v)
        return cache.attend(q, qk, qv, scale=128 ** -0.5, mask=None)

    def cosine(a: mx.array) -> float:
        a, b = np.asarray(a).ravel(), np.asarray(dense).ravel()
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    k8v4, k8v8 = run(8, 4), run(8, 8)
    assert 0.99 < cosine(k8v4) < cosine(k8v8) < 1.0
    assert cosine(run(4, 8)) > 0.99


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_equal_bits_attention_is_mlx_lm_exactly(mask) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s, dtype=np.float32))
               for s in ((2, 8, 3, 64), (2, 2, 40, 64), (2, 2, 40, 64)))
    m: Any = mask
    if mask in ("bool", "additive"):
        m = mx.array(rng.random((2, 1, 3, 40)) > 0.3)
        m = m if mask == "bool" else mx.where(m, 0.0, -1e9)
    for bits in (8, 4):
        cache = BatchAffineKVCache([0, 0], bits, bits, 64)
        qk, qv = cache.update_and_fetch(k, v)
        ours = cache.attend(q, qk, qv, scale=0.125, mask=m)
        theirs = quantized_scaled_dot_product_attention(q, qk, qv, scale=0.125, mask=m,
                                                        group_size=64, bits=bits)
        assert mx.array_equal(ours, theirs)


@pytest.mark.parametrize("bits,ratio", [(8, 0.53125), (4, 0.28125)])
def test_nbytes_against_dense_bf16(bits, ratio) -> None:
    """4096 tokens (a whole number of 256-token steps), 8 kv heads, head_dim 128, group 64:
    per element 8 or 4 bits plus a bf16 scale and bias per 64 elements, vs 16 bits dense."""
    k = mx.zeros((1, 8, 4096, 128), mx.bfloat16)
    dense = KVCache()
    dense.update_and_fetch(k, k)
    row = AffineKVCache(bits, bits, 64)
    row.update_and_fetch(k, k)
    assert row.nbytes / dense.nbytes == pytest.approx(ratio)
    batch = AffineKVCache.merge([row, AffineKVCache.from_dense(dense, bits, bits, 64)])
    assert batch.nbytes == 2 * row.nbytes
    converted = DelayedKVCache(0, AffineKVCache, k_bits=bits, v_bits=bits, group_size=64)
    converted.update_and_fetch(k, k)
    assert converted.nbytes == row.nbytes


def test_merging_different_layouts_is_refused() -> None:
    with pytest.raises(ValueError, match="different bits/group sizes"):
        AffineKVCache.merge([AffineKVCache(8, 8), AffineKVCache(8, 4)])
    with pytest.raises(ValueError, match="k_bits must be one of"):
        AffineKVCache(7, 8)
    with pytest.raises(ValueError, match="different settings"):
        DelayedKVCache.merge([DelayedKVCache(10, AffineKVCache, k_bits=8),
                              DelayedKVCache(20, AffineKVCache, k_bits=8)])
