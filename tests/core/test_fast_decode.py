"""model.fast_decode (on by default): one row's decode step as two compiled calls a layer. It
must be the same computation as mlx-lm's forward: the same greedy tokens as mlx-lm's own loop,
and the same logprobs, bit for bit, as the engine with it off (SPEC §10)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.core.test_fidelity import chat_prompt, reference_ids

CASES = [("tiny", "qwen3", "float32"), ("tiny", "qwen3", "bfloat16"),
         ("llama", "llama", "float32")]


def forward(h: Any) -> Any:
    return h.engine.step.prefill.forward


def run(h: Any, prompt: list[int]) -> tuple[list[int], list[tuple[int, float, Any]]]:
    out = h.generate(prompt, max_tokens=32, logprobs=True, top_logprobs=3)
    return out["ids"], [(lp.token_id, lp.logprob, lp.top) for lp in out["logprobs"]]


@pytest.mark.parametrize("option,arch,dtype", CASES)
def test_fast_decode_is_the_same_computation(option: str, arch: str, dtype: str,
                                             engine_factory: Any, model_cache: Path) -> None:
    # the checkpoint's dtype computes (a bf16 model in bf16, as on a GPU), as mlx-lm loads it
    model = (f"model={option}", f"model.dtype={dtype}", "model.compute_dtype=checkpoint")
    fast = engine_factory(*model)
    plain = engine_factory(*model, "model.fast_decode=false")
    assert forward(plain).fast is None
    path = ensure_model(arch, "tiny", dtype, model_cache)
    for text in ["Hello there, how are you?", "Tell me a story about a café in 日本."]:
        prompt = chat_prompt(fast, text)
        before = forward(fast).fast.calls
        ids, lps = run(fast, prompt)
        # every step after the first (the prompt's) decoded one row through the compiled path
        assert forward(fast).fast.calls - before >= len(ids) - 1 > 4
        assert (ids, lps) == run(plain, prompt)   # tokens, logprobs and top-3, bit for bit
        ref = reference_ids(path, prompt, 32, 2048)
        assert ids[:len(ref)] == ref, f"{arch}/{dtype}: {ids} != mlx-lm {ref}"


def run_many(h: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
    import asyncio
    requests = [h.request(p, max_tokens=24, logprobs=True, top_logprobs=3) for p in prompts]
    outs = asyncio.run(h.generate_many(requests))
    return [(o["ids"], [(lp.token_id, lp.logprob, lp.top) for lp in o["logprobs"]])
            for o in outs]


BATCH_CASES = [(f"model={o}", f"model.dtype={d}", "model.compute_dtype=checkpoint")
               for o, _, d in CASES] + [("model=smollm2",)]   # the default: llama, 4-bit


@pytest.mark.parametrize("model", BATCH_CASES, ids=lambda m: " ".join(m))
def test_a_batch_of_rows_is_the_same_computation(model: tuple[str, ...],
                                                 engine_factory: Any) -> None:
    """Rows of different prompt lengths decode together (a BatchKVCache, left-padded): the
    compiled path takes the batch once its size held for two steps, and every row's tokens,
    logprobs and top-3 equal the engine with it off, bit for bit."""
    fast = engine_factory(*model)
    plain = engine_factory(*model, "model.fast_decode=false")
    prompts = [chat_prompt(fast, t) for t in
               ("Count to three.", "Name a colour, then explain why the sky looks blue.",
                "Hi", "Write one sentence about rivers and the sea.")]
    before = forward(fast).fast.calls
    got = run_many(fast, prompts)
    assert forward(fast).fast.calls - before > 10   # the batch's steps took it
    assert 4 in forward(fast).fast.batches or 3 in forward(fast).fast.batches
    assert got == run_many(plain, prompts)


def test_other_families_run_mlx_lm_forward(engine_factory: Any) -> None:
    assert forward(engine_factory("model=gemma")).fast is None   # gemma3: not a known family


def small_qwen3() -> Any:
    from mlx_lm.models import qwen3
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=100, num_key_value_heads=2, max_position_embeddings=512,
                           rope_theta=1e6, head_dim=16, tie_word_embeddings=True)
    return qwen3.Model(args)


def test_what_it_does_not_replicate_runs_mlx_lm_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapped projection (LoRA), scaled RoPE, or an mlx-lm whose forward code is not the
    one replicated: no fast decode."""
    from mlx_lm.models import qwen3
    from mlx_lm.tuner.lora import LoRALinear

    import pipeserve.model.fast_decode as fd
    assert fd.fast_decode(small_qwen3()) is not None
    wrapped = small_qwen3()
    wrapped.model.layers[1].self_attn.v_proj = LoRALinear.from_base(
        wrapped.model.layers[1].self_attn.v_proj, r=4)
    assert fd.fast_decode(wrapped) is None
    scaled = small_qwen3()
    scaled.model.layers[0].self_attn.rope = object()   # Llama 3 / YaRN scaling: another class
    assert fd.fast_decode(scaled) is None
    block, attention, mlp, _ = fd._FAMILIES[qwen3.Model]
    monkeypatch.setitem(fd._FAMILIES, qwen3.Model, (block, attention, mlp, "0" * 16))
    assert fd.fast_decode(small_qwen3()) is None


def test_a_batch_size_is_traced_before_its_step_and_a_failure_runs_mlx_lm_forward() -> None:
    """A new batch size takes the compiled path on its second step in a row, traced before the
    step touches KV; where tracing raises, that size runs mlx-lm's forward from then on."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    import pipeserve.model.fast_decode as fd
    model = small_qwen3()
    f = fd.fast_decode(model)
    assert f is not None
    tokens = mx.array([[5], [7]], dtype=mx.uint32)
    fast, plain = ([BatchKVCache([0, 2]) for _ in f.layers] for _ in range(2))
    for caches in (fast, plain):   # two rows, the second left-padded by 2
        model(mx.array([[1, 2, 3, 4], [0, 0, 3, 4]], dtype=mx.uint32), cache=caches)
    assert not f.fits(tokens, fast) and f.fits(tokens, fast) and 2 in f.batches
    assert mx.array_equal(f(tokens, fast), model(tokens, cache=plain)).item()

    broken = fd.fast_decode(small_qwen3())
    pre, post, scale = broken._parts[0]

    def cannot_compile(x: Any, offset: Any) -> Any:
        raise RuntimeError("cannot compile")
    broken._parts[0] = (cannot_compile, post, scale)
    untouched = [BatchKVCache([0, 1]) for _ in broken.layers]
    assert not broken.fits(tokens, untouched) and not broken.fits(tokens, untouched)
    assert 2 not in broken.batches and all(c.keys is None for c in untouched)
    broken._parts[0] = (pre, post, scale)
    assert not broken.fits(tokens, untouched)   # not tried again
