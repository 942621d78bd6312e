"""Will it fit: `pipeserve fit` works the memory model out of the checkpoint's files without
reading the weights, and its figures are the ones admission uses once the engine has loaded the
model (generated models through the real loader and engine; GGUF files written with `gguf`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.model.fit import estimate
from tests.conftest import ROOT, make_config
from tests.model.test_gguf import (gguf_tensors, hf_weights, llama_metadata, save_ggml_gguf,
                                   tokenizer_metadata)


def _estimate_reading_nothing(*overrides: str) -> Any:
    """The estimate, checked to have read no weights: MLX's peak memory stays far below them."""
    held = mx.get_active_memory()   # a loaded engine's weights and caches
    mx.reset_peak_memory()
    fit = estimate(make_config(*overrides))
    grew = mx.get_peak_memory() - held
    assert grew < fit.memory.weight_bytes / 10, f"the estimate read weights: {grew} B allocated"
    return fit


@pytest.mark.parametrize("overrides", [
    ("model.arch=qwen3",),
    ("model.arch=gemma3", "kv=turbo"),          # sliding layers stay dense, the rest turbo
    ("model.arch=qwen3_next",),                 # recurrent state per row
    ("model.arch=llama", "kv=paged", "kv.block_size=16",
     "admission=budget", "admission.memory_budget_gb=2"),
])
def test_estimate_equals_the_loaded_memory_model(engine_factory: Any, model_cache: Path,
                                                 overrides: tuple[str, ...]) -> None:
    loaded = engine_factory(*overrides).engine.memory
    fit = _estimate_reading_nothing(f"model.cache_dir={model_cache}", *overrides)
    assert fit.memory == loaded
    assert fit.memory.kv_bytes_per_token > 0 and fit.memory.max_safe_context > 0


def test_gguf_estimate_from_the_header_equals_the_converted_model(
        tmp_path: Path, engine_factory: Any) -> None:
    """A Q4_0 / Q8_0 GGUF: sized from its header before any conversion, the same figures as
    the converted, loaded model's (quantized as served: model.compute_dtype=checkpoint)."""
    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    kinds = {name: (w, T.F32 if w.ndim == 1 else T.Q8_0 if name == "token_embd.weight" else T.Q4_0)
             for name, w in gguf_tensors(hf_weights(vocab, tied=True)).items()}
    src = save_ggml_gguf(tmp_path / "q.gguf", kinds, {**llama_metadata(vocab), **tok})
    args = (f"model.path={src}", f"model.cache_dir={tmp_path / 'cache'}",
            "model.compute_dtype=checkpoint")
    fit = _estimate_reading_nothing(*args)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), \
        "the estimate converted the file"
    assert fit.source == "its GGUF header" and fit.compute_dtype.endswith("+q4+q8")
    loaded = engine_factory(*args).engine.memory
    assert fit.memory == loaded
    again = estimate(make_config(*args))   # converted by now: sized from the converted copy
    assert again.source == "its converted copy in the model cache" and again.memory == loaded
    q4_bytes = sum(int(np.prod(w.shape)) for n, (w, t) in kinds.items() if t is T.Q4_0) // 2
    assert fit.memory.weight_bytes < 2 * q4_bytes + vocab * 64 * 2   # quantized, not float


def test_fit_command_prints_the_estimate(model_cache: Path) -> None:
    args = [f"model.cache_dir={model_cache}", "model=tiny", "model.size=small", "kv=q8",
            "admission=budget", "admission.memory_budget_gb=1"]
    fit = estimate(make_config(*args))
    out = subprocess.run([sys.executable, "serve.py", "fit", *args], cwd=ROOT, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = fit.memory
    assert f"KV: {m.kv_bytes_per_token} bytes per token" in out.stdout
    assert f"largest context one request can hold: {m.max_safe_context} tokens" in out.stdout
    assert f"rows of 2048 tokens that fit at once: {fit.rows_at(2048)}" in out.stdout
    assert "(admission.memory_budget_gb)" in out.stdout
    assert fit.rows_at(2048) == (m.device_bytes - m.weight_bytes - m.prefill_temp_bytes) \
        // m.kv_bytes(2048)


def test_fit_command_refuses_what_a_launch_refuses(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    for args, words in ((["kv=q9"], "kv=q9 is not an option of kv"),
                        ([f"model.path={bad}"], "not a GGUF file")):
        out = subprocess.run([sys.executable, "serve.py", "fit", *args], cwd=ROOT, text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 2 and words in out.stderr, out.stderr
