"""MXFP4 GGUF tensors (gpt-oss's experts, and any tensor llama.cpp writes as MXFP4) served in
MLX's own `mxfp4` mode: the file's E2M1 codes repacked and its E8M0 exponents kept, so the
weights equal the `gguf` package's dequantization exactly and nothing is re-quantized; a model
of them answers greedily as mlx-lm does on the converted checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf as ggufpy
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.model.gguf import quants as gguf_quants
from tests.model.test_gguf import gguf_name, hf_weights, llama_metadata, tokenizer_metadata
from tests.model.test_gguf_quants import written
from tests.model.gguf_served import converted, served_equals_mlx_lm

PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]
HEADS, KV_HEADS = 4, 2


@pytest.mark.parametrize("shape", [(64, 128), (4, 32, 64)], ids=["matrix", "experts"])
def test_mxfp4_tensor_maps_to_mlx_mxfp4_exactly(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    w = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    w.reshape(-1, shape[-1])[0] *= 1e-30   # tiny exponents too
    raw = ggufpy.quants.quantize(w.reshape(-1, shape[-1]), T.MXFP4)
    conv = gguf_quants.convert_tensor("MXFP4", raw.reshape(-1), shape)
    assert (conv.mode, conv.bits, conv.exact, conv.error) == ("mxfp4", 4, True, 0.0)
    assert set(conv.arrays) == {"weight", "scales"}
    scales = conv.arrays["scales"]
    assert scales.dtype == mx.uint8 and scales.shape == (*shape[:-1], shape[-1] // 32)
    # the scales are the file's exponent bytes: nothing was re-quantized
    assert np.array_equal(np.array(scales).reshape(-1), raw.reshape(-1, 17)[:, 0])
    got = mx.dequantize(conv.arrays["weight"], scales, None, group_size=32, bits=4, mode="mxfp4")
    want = ggufpy.quants.dequantize(raw, T.MXFP4).reshape(shape)
    assert np.array_equal(np.array(got.astype(mx.float32)), want)


def mxfp4_llama(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A llama whose every linear layer is MXFP4 (float32 embeddings, head and norms), and the
    Hugging Face-layout weights llama.cpp's dequantization gives for it."""
    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab, tied=False, seed=5)
    tensors: dict[str, tuple[np.ndarray, T]] = {}
    for name, w in hf.items():
        if name.startswith("model.layers.") and "proj" in name:
            if "q_proj" in name or "k_proj" in name:   # as llama.cpp permutes q/k rows
                n = HEADS if "q_proj" in name else KV_HEADS
                w = w.reshape(n, 2, w.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(w.shape)
            tensors[gguf_name(name)] = (w, T.MXFP4)
        else:
            tensors[gguf_name(name)] = (w, T.F32)
    src = written(tmp_path, tensors, {**llama_metadata(vocab), **tok})
    ref = dict(hf)
    for t in ggufpy.GGUFReader(str(src)).tensors:
        if t.tensor_type != T.MXFP4:
            continue
        hf_name = next(k for k in hf if gguf_name(k) == t.name)
        w = ggufpy.quants.dequantize(t.data, T.MXFP4).reshape(hf[hf_name].shape)
        if "q_proj" in hf_name or "k_proj" in hf_name:
            n = HEADS if "q_proj" in hf_name else KV_HEADS
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        ref[hf_name] = w.astype(np.float32)
    return src, ref


def test_mxfp4_llama_serves_in_mxfp4_mode_like_mlx_lm(tmp_path: Path,
                                                      engine_factory: Any) -> None:
    from mlx_lm.models.llama import Model, ModelArgs

    src, ref = mxfp4_llama(tmp_path)
    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    report = json.loads((lm.path / "source.json").read_text())["tensors"]
    values = sum(w.size for k, w in ref.items() if "proj" in k)
    assert report["MXFP4 -> mxfp4 (exact)"] == {"tensors": 14, "values": values,
                                                 "max_rel_rms_error": 0.0}
    shapes = hf_weights(len(tokenizer_metadata()["tokenizer.ggml.tokens"]), tied=False)
    reference = Model(ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16, rms_norm_eps=1e-5,
        vocab_size=shapes["model.embed_tokens.weight"].shape[0], rope_theta=50000.0,
        tie_word_embeddings=False, max_position_embeddings=2048))
    reference.load_weights([(k, mx.array(v)) for k, v in ref.items()])
    np.testing.assert_allclose(np.array(lm.model(mx.array([PROMPT]))[0]),
                               np.array(reference(mx.array([PROMPT]))[0]), rtol=1e-3, atol=1e-3)

    engine, mlx_ids = served_equals_mlx_lm(engine_factory, lm.path, PROMPT, *args)
    assert engine.loaded.compute_dtype == "float32+q4"
    assert engine.engine.memory == fit.memory   # the header estimate is the served figure
