"""Fidelity (SPEC §10): at scheduler=serial, greedy output equals mlx-lm's own generate loop
on the same model and prompt, token for token — for every tiny architecture we ship."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from pipeserve.model.tiny.text import ensure_model

ARCHS = ["qwen3", "llama", "gemma3", "qwen3_next", "qwen3_5"]
MODEL_OPTION = {"qwen3": "tiny", "llama": "llama", "gemma3": "gemma", "qwen3_next": "hybrid",
                "qwen3_5": "qwen"}


def reference_ids(path: Path, prompt_ids: list[int], max_tokens: int, prefill_step: int) -> list[int]:
    """mlx-lm's greedy loop, stopped at the first EOS like mlx_lm.generate."""
    model, tokenizer = mlx_load(str(path))
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens,
                                  prefill_step_size=prefill_step):
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


def chat_prompt(engine_harness, text: str) -> list[int]:
    tok = engine_harness.loaded.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_serial_greedy_equals_mlx_lm(arch: str, engine_factory, model_cache: Path) -> None:
    h = engine_factory(f"model={MODEL_OPTION[arch]}", "scheduler=serial")
    path = ensure_model(arch, "tiny", "float32", model_cache)
    assert h.loaded.path == path
    for text in ["Hello there, how are you?", "Tell me a story about a café in 日本."]:
        prompt = chat_prompt(h, text)
        ours = h.generate(prompt, max_tokens=40)["ids"]
        ref = reference_ids(path, prompt, 40, 2048)
        assert ours == ref, f"{arch}: served {ours} != mlx-lm {ref}"
        assert len(ours) > 5


def test_chunked_prefill_equals_mlx_lm_chunked(engine_factory, model_cache: Path) -> None:
    """A prompt spanning several prefill chunks: each chunk is evaluated separately, exactly
    as mlx-lm's prefill_step_size does, so the tokens match."""
    h = engine_factory("scheduler.prefill_chunk=64")
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    prompt = chat_prompt(h, "The quick brown fox jumps over the lazy dog. " * 12)
    assert len(prompt) > 3 * 64
    ours = h.generate(prompt, max_tokens=24)["ids"]
    assert ours == reference_ids(path, prompt, 24, 64)


def test_one_token_prompt_and_max_tokens_one(engine_factory, model_cache: Path) -> None:
    h = engine_factory()
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    result = h.generate([5], max_tokens=1)
    assert result["finish"] in ("length", "stop")
    assert result["ids"] == reference_ids(path, [5], 1, 2048)
