"""Quantized KV on a Gemma 4 with KV-shared layers (the E2B / E4B shape: the last layers attend
over an earlier layer's K/V and have no cache). A shared layer gets its source layer's fetched
K/V, quantized under kv=q8 / q4 / turbo / mixed, and must attend over them as the source does.

Neither mlx-lm nor mlx-vlm can run this (their shared layers pass the quantized K/V to dense
attention), so the reference is mlx-lm's own QuantizedKVCache and quantized attention with the
shared layers given their source cache's bits and group: the same arithmetic the fix claims."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pipeserve  # noqa: F401  (loads OpenBLAS first)
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import base, gemma4_text
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

from pipeserve.kv import attention
from pipeserve.model.tiny.text import _fill, ensure_model
from tests.conftest import EngineHarness
from tests.kv.test_kv_quantized import (_prompts, batched, corpus_ids, late,  # noqa: F401
                                        mlx_lm_tokens, solo)


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The generated Gemma 4 with 4 layers, the last 2 reading layer 1's K/V (head_dim 64,
    which groups of 64 quantize)."""
    path = ensure_model("gemma4", "tiny", "float32", tmp_path_factory.mktemp("g4"))
    config = {**json.loads((path / "config.json").read_text()), "head_dim": 64,
              "global_head_dim": 64, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
              "layer_types": ["full_attention"] * 4}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = [(name, mx.array(_fill(name, tuple(p.shape), "gemma4", config["hidden_size"])))
               for name, p in tree_flatten(model.parameters())]
    model.update(tree_unflatten(weights))
    model.eval()
    attention.install(model)
    assert len(model.make_cache()) == 2 < len(model.layers)
    return model


def _source_bits(bits: int) -> Any:
    """mlx-lm's attention, a shared layer's quantized K/V read at its source cache's bits. The
    reference only is patched: mlx-lm's own quantized cache fails on shared layers (it hands
    them the tuple with no cache), so this is mlx-lm's quantized attention made to run there;
    the side under test is pipeserve's real KV layouts, unpatched."""
    def sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        if cache is None and isinstance(keys, (tuple, list)):
            return quantized_scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                          mask=mask, group_size=64, bits=bits)
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=scale, mask=mask, sinks=sinks)
    return sdpa


@pytest.mark.parametrize("bits", [8, 4])
def test_shared_layers_greedy_equals_mlx_lm_quantized_cache(shared_model, corpus_ids, bits,
                                                            monkeypatch) -> None:
    prompt = corpus_ids[900:1200]
    ours = solo(shared_model, late(0, bits), prompt, 24)
    with monkeypatch.context() as m:
        m.setattr(gemma4_text, "scaled_dot_product_attention", _source_bits(bits))
        theirs = mlx_lm_tokens(shared_model, prompt, 24, kv_bits=bits, kv_group_size=64,
                               quantized_kv_start=0)
    assert ours == theirs
    if bits == 4:   # the comparison has teeth: q4 changes this model's greedy text
        assert ours != solo(shared_model, KVCache, prompt, 24)


def test_shared_layers_batched_rows_equal_alone(shared_model, corpus_ids) -> None:
    """Rows joining, leaving and crossing their conversion boundary (start=280) in one batch."""
    make = late(280, 4)
    prompts = _prompts(corpus_ids, [300, 275, 100])
    quotas = [20, 16, 12]
    got = batched(shared_model, make, prompts, quotas, join_at={2: 3})
    for r, (p, n) in enumerate(zip(prompts, quotas)):
        assert got[r] == solo(shared_model, make, p, n + 4), f"row {r}"


@pytest.mark.parametrize("kv", ["q8", "turbo", "mixed"])
def test_served_gemma4_with_shared_layers(engine_factory, tmp_path: Path, kv: str) -> None:
    """The generated Gemma 4 image/audio model (layers 2 and 3 read layers 0 and 1's K/V; its
    full-attention heads are 32 wide) answers under a quantized layout, batched as alone.
    kv=mixed's group comes from its kv_config.json, which the launch check reads."""
    if kv != "mixed":
        overrides = [f"kv={kv}", "kv.group_size=32"]
    else:
        config = tmp_path / "kv_config.json"
        config.write_text(json.dumps({"group_size": 32, "default": {"k_bits": 8, "v_bits": 4}}))
        overrides = ["kv=mixed", f"kv.config_path={config}"]
    h: EngineHarness = engine_factory("model=tiny_vlm", "model.arch=gemma4", *overrides)
    prompts = [list(range(5, 45)), list(range(60, 80))]
    alone = [h.generate(p, max_tokens=8)["ids"] for p in prompts]
    together = asyncio.run(h.generate_many([h.request(p, max_tokens=8) for p in prompts]))
    assert [r["ids"] for r in together] == alone
    assert all(len(ids) == 8 for ids in alone)
