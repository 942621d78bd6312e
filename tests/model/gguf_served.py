"""The check every converted GGUF ends with: mlx-lm's own greedy decode of the converted
directory, and the engine serving it, give the same tokens."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.model.fit import estimate
from pipeserve.model.loader import load
from tests.conftest import make_config


def served_equals_mlx_lm(engine_factory: Any, converted: Path, prompt: list[int],
                         *overrides: str) -> tuple[Any, list[int]]:
    """8 greedy tokens of `prompt` from mlx-lm on `converted` and from an engine launched with
    `overrides`, asserted equal; returns the engine harness and mlx-lm's tokens for the caller's
    further checks."""
    model, _ = mlx_load(str(converted))
    steps = generate_step(mx.array(prompt), model, max_tokens=8, sampler=make_sampler(0.0))
    mlx_ids = [int(t) for t, _ in steps]
    engine = engine_factory("model=llama", *overrides)
    req = engine.request(prompt, max_tokens=8)
    req.stop_token_ids = frozenset()     # random weights: decode all 8, as generate_step does
    assert asyncio.run(engine.generate_many([req]))[0]["ids"] == mlx_ids
    return engine, mlx_ids


def converted(tmp_path: Path, src: Path) -> tuple[tuple[str, ...], Any, Any]:
    """(the launch overrides serving `src`, `pipeserve fit`'s estimate from its header before
    any conversion, the loader's conversion of it into tmp_path/cache)."""
    cache = tmp_path / "cache"
    args = (f"model.path={src}", f"model.cache_dir={cache}", "model.compute_dtype=checkpoint",
            "model.use_generation_config=false")
    fit = estimate(make_config("model=llama", *args))
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(cache),
                          compute_dtype=ComputeDType.checkpoint))
    return args, fit, lm
