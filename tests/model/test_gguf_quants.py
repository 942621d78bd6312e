"""GGUF block types as llama.cpp writes them: each tensor written with the `gguf` package's writer
(its own quantizer where it has one: Q5_0, Q5_1; otherwise random valid blocks, since the package
has no k-quant or IQ quantizer) converts into MLX affine quantization whose values match the
package's reference dequantization — exactly for the types an affine form holds, within
gguf_quants.MAX_ERROR for the re-quantized ones — and a llama written in a mix of those types
gives the logits of mlx-lm's llama on the reference-dequantized weights."""
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
from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.model.loader import load
from tests.model.test_gguf import permute, tokenizer_metadata

# byte offsets of each block's float16 fields (d, dmin, m): all values are linear in them
F16_FIELDS = {T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,),
              T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
              T.IQ3_S: (0,), T.IQ3_XXS: (0,), T.IQ2_S: (0,), T.IQ2_XS: (0,), T.IQ2_XXS: (0,),
              T.IQ1_S: (0,), T.IQ1_M: (), T.TQ2_0: (64,), T.TQ1_0: (52,)}
FORMS = {T.Q5_0: "affine 5-bit", T.Q5_1: "affine 5-bit", T.Q4_K: "affine 4-bit",
         T.Q5_K: "affine 5-bit", T.Q6_K: "affine 8-bit", T.Q2_K: "affine 8-bit",
         T.Q3_K: "affine 8-bit", T.IQ4_NL: "affine 8-bit", T.IQ4_XS: "affine 8-bit",
         T.IQ3_S: "affine 8-bit", T.IQ3_XXS: "affine 8-bit", T.IQ2_S: "affine 8-bit",
         T.IQ2_XS: "affine 8-bit", T.IQ2_XXS: "affine 8-bit", T.IQ1_S: "affine 6-bit",
         T.IQ1_M: "affine 8-bit", T.TQ2_0: "affine 2-bit", T.TQ1_0: "affine 8-bit"}
EXACT = (T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K)


def random_blocks(qtype: T, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid `qtype` blocks for a (rows, cols) tensor whose reference values have about `std`."""
    per, size = ggufpy.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    if qtype is T.IQ1_M:
        return _iq1_m_scaled(blocks, rows, std)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(0.5, 1.0, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    got = ggufpy.quants.dequantize(raw, qtype).std()
    for off in F16_FIELDS[qtype]:
        f = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32) * (std / got)
        blocks[:, off:off + 2] = f.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _iq1_m_scaled(blocks: np.ndarray, rows: int, std: float) -> np.ndarray:
    """IQ1_M keeps its float16 scale in the top nibbles of its four 16-bit sub-scales."""
    def pack(d: np.ndarray) -> None:
        bits = d.astype(np.float16).view(np.uint16).reshape(-1, 1)
        sc = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
        top = (bits >> (4 * np.arange(4, dtype=np.uint16))) & 0xF
        blocks[:, 48:56] = ((sc & 0x0FFF) | (top << 12)).astype(np.uint16).view(np.uint8)
    d = np.random.default_rng(0).uniform(0.5, 1.0, len(blocks)).astype(np.float32)
    pack(d)
    got = ggufpy.quants.dequantize(blocks.reshape(rows, -1), T.IQ1_M).std()
    pack(d * (std / got))
    return blocks.reshape(rows, -1)


def written(tmp_path: Path, tensors: dict[str, tuple[np.ndarray, T]], meta: dict[str, Any],
            arch: str = "llama") -> Path:
    """A GGUF from llama.cpp's writer: float arrays as F32, uint8 block rows as `qtype`, float
    arrays with a quantizing qtype through the package's own quantizer."""
    path = tmp_path / "model.gguf"
    w = ggufpy.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value.tolist() if isinstance(value, np.ndarray) else value))
    for name, (arr, qtype) in tensors.items():
        if arr.dtype != np.uint8 and qtype is not T.F32:
            arr = ggufpy.quants.quantize(arr, qtype)
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_block_type_converts_to_affine_within_its_bound(tmp_path: Path, qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 64, 512
    if qtype in (T.Q5_0, T.Q5_1):   # the package quantizes these itself
        data = rng.standard_normal((rows, cols)).astype(np.float32)
    else:
        data = random_blocks(qtype, rows, cols, 0.05, rng)
    src = written(tmp_path, {"w": (data, qtype)}, {})
    t = ggufpy.GGUFReader(str(src)).tensors[0]
    want = ggufpy.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
    conv = gguf_quants.convert_tensor(qtype.name, np.asarray(t.data).reshape(-1), (rows, cols))
    assert conv.form == FORMS[qtype] and conv.exact is (qtype in EXACT)
    got = np.array(mx.dequantize(conv.arrays["weight"], conv.arrays["scales"].astype(mx.float32),
                                 conv.arrays["biases"].astype(mx.float32),
                                 group_size=32, bits=conv.bits))
    err = gguf_quants.rel_error(got, want)
    assert abs(err - conv.error) < 1e-6        # the logged error is the real one
    if qtype in (T.Q5_0, T.Q5_1):
        assert err == 0.0                      # float16 d and m: the affine form is the block
    elif qtype in EXACT:
        assert err < 1e-3                      # float16 rounding of d*scale and dmin*min
    else:
        assert err <= gguf_quants.MAX_ERROR


def test_requantized_tensor_falls_back_to_bf16_when_no_width_is_close() -> None:
    """With a bound no affine width meets, the tensor is kept as bf16 of the reference values."""
    rng = np.random.default_rng(3)
    rows, cols = 8, 256
    blocks = random_blocks(T.Q6_K, rows, cols, 0.05, rng)
    conv = gguf_quants.convert_tensor("Q6_K", blocks.reshape(-1), (rows, cols), max_error=1e-5)
    want = ggufpy.quants.dequantize(blocks, T.Q6_K).reshape(rows, cols)
    assert conv.form == "bf16" and conv.bits is None and conv.arrays["weight"].dtype == mx.bfloat16
    got = np.array(conv.arrays["weight"].astype(mx.float32))
    assert gguf_quants.rel_error(got, want) == pytest.approx(conv.error) and conv.error < 4e-3


# -- a model in k-quants ---------------------------------------------------------------------
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 2, 256, 4, 2, 64, 512
TYPES = {  # one tensor of every type the conversion handles
    "token_embd.weight": T.Q6_K, "output.weight": T.Q8_0,
    "blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q5_K, "blk.0.attn_v.weight": T.Q6_K,
    "blk.0.attn_output.weight": T.Q3_K, "blk.0.ffn_gate.weight": T.Q2_K,
    "blk.0.ffn_up.weight": T.IQ4_XS, "blk.0.ffn_down.weight": T.IQ4_NL,
    "blk.1.attn_q.weight": T.Q5_0, "blk.1.attn_k.weight": T.Q5_1, "blk.1.attn_v.weight": T.Q4_0,
    "blk.1.attn_output.weight": T.Q4_1, "blk.1.ffn_gate.weight": T.Q4_K,
    "blk.1.ffn_up.weight": T.Q5_K, "blk.1.ffn_down.weight": T.Q6_K,
}
SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
          "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
HF = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
      "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}


def kquant_llama(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The file, and the Hugging Face-layout weights llama.cpp's dequantization gives for it."""
    rng = np.random.default_rng(7)
    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    tensors: dict[str, tuple[np.ndarray, T]] = {
        "output_norm.weight": ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), T.F32)}
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (
                (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), T.F32)
    for name, qtype in TYPES.items():
        kind = name.split(".")[-2]
        rows, cols = (vocab, HIDDEN) if kind in ("token_embd", "output") else SHAPES[kind]
        std = 1.0 if kind == "token_embd" else 1 / np.sqrt(cols) / (8 if kind == "output" else 1)
        if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
            data = (std * rng.standard_normal((rows, cols))).astype(np.float32)
        else:
            data = random_blocks(qtype, rows, cols, std, rng)
        tensors[name] = (data, qtype)
    meta = {"general.name": "kquant-llama", "llama.block_count": LAYERS,
            "llama.context_length": 2048, "llama.embedding_length": HIDDEN,
            "llama.feed_forward_length": INTER, "llama.attention.head_count": HEADS,
            "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": HEAD_DIM,
            **tok}
    src = written(tmp_path, tensors, meta)
    ref: dict[str, np.ndarray] = {}
    for t in ggufpy.GGUFReader(str(src)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        w = ggufpy.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            n = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(parts[2])
            if n:   # undo llama.cpp's permute: the inverse of tests/model/test_gguf.py's
                w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
                assert np.array_equal(permute(w, n), ggufpy.quants.dequantize(
                    t.data, t.tensor_type).reshape(shape))
            ref[f"model.layers.{parts[1]}.{HF[parts[2]]}.weight"] = w
        else:
            ref[{"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight",
                 "output_norm": "model.norm.weight"}[parts[0]]] = w
    return src, ref


def test_kquant_llama_logits_match_mlx_lm_on_the_reference_weights(tmp_path: Path) -> None:
    """Every supported block type in one llama: the converted model's logits (float32 compute,
    mlx-lm's own llama class) are within 3% of the largest logit of mlx-lm's llama on llama.cpp's
    dequantization of the same file, and the conversion says what each type became."""
    from mlx_lm.models.llama import Model, ModelArgs

    src, ref = kquant_llama(tmp_path)
    args = ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                     intermediate_size=INTER, num_attention_heads=HEADS, rms_norm_eps=1e-5,
                     vocab_size=ref["model.embed_tokens.weight"].shape[0], head_dim=HEAD_DIM,
                     num_key_value_heads=KV_HEADS, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=2048)
    model = Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in ref.items()])
    ids = [5, 17, 260, 3, 99, 400, 12, 7, 301, 64, 128, 2]
    want = np.array(model(mx.array([ids]))[0])

    lm = load(ModelConfig(name="k", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.float32))
    got = np.array(lm.model(mx.array([ids]))[0].astype(mx.float32))
    # the seven re-quantized tensors each add up to MAX_ERROR; the bounds leave room above it
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    cfg = json.loads((lm.path / "config.json").read_text())
    quant = cfg["quantization"]
    assert quant["bits"] == 8    # the most common width here (Q8_0 and the re-quantized types)
    assert quant["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert quant["model.layers.0.self_attn.k_proj"] == {"group_size": 32, "bits": 5, "mode": "affine"}
    report = json.loads((lm.path / "source.json").read_text())["tensors"]
    assert report["Q4_K -> affine 4-bit (exact)"]["tensors"] == 2
    assert report["Q6_K -> affine 8-bit"]["tensors"] == 3
    assert all(r["max_rel_rms_error"] <= gguf_quants.MAX_ERROR for r in report.values())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_stacked_expert_tensor_keeps_its_expert_axis(qtype: T) -> None:
    """A MoE file's (experts, rows, cols) tensor converts per row and comes back 3-D, as
    mlx-lm's QuantizedSwitchLinear holds it."""
    rng = np.random.default_rng(11)
    experts, rows, cols = 4, 32, 256
    blocks = random_blocks(qtype, experts * rows, cols, 0.05, rng)
    conv = gguf_quants.convert_tensor(qtype.name, blocks.reshape(-1), (experts, rows, cols))
    assert conv.arrays["weight"].shape[:2] == (experts, rows)
    assert conv.arrays["scales"].shape == (experts, rows, cols // 32)
    got = np.array(mx.dequantize(conv.arrays["weight"], conv.arrays["scales"].astype(mx.float32),
                                 conv.arrays["biases"].astype(mx.float32), group_size=32,
                                 bits=conv.bits))
    want = ggufpy.quants.dequantize(blocks, qtype).reshape(experts, rows, cols)
    assert gguf_quants.rel_error(got, want) <= gguf_quants.MAX_ERROR
