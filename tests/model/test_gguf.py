"""GGUF as a model source: small llama GGUF files written here (mx.save_gguf for float tensors,
llama.cpp's `gguf` writer and quantizers for Q4_0/Q4_1/Q8_0 and the unsupported types) convert
into mlx-lm directories whose logits equal an mlx-lm llama built from the same weights, whose
tokenizer encodes as the original does, and unsupported files are refused with the reason."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf as ggufpy
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.model.gguf import convert as gguf
from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.errors import ConfigError
from pipeserve.model.loader import load
from pipeserve.model.tiny.text import CHAT_TEMPLATE, CORPUS, build_tokenizer
from tests.conftest import startup_error

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 2, 64, 4, 2, 16, 128
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


# -- what llama.cpp's converter would write ---------------------------------------------------
def hf_weights(vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A random llama in Hugging Face layout (the reference the GGUF is made from)."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
                                "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, HIDDEN)) / 8
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return {k: v.astype(np.float32) for k, v in w.items()}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q with n_head, k with n_head_kv)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        return f"blk.{i}.{BLOCK[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def gguf_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, w in hf.items():
        if "q_proj" in name:
            w = permute(w, HEADS)
        elif "k_proj" in name:
            w = permute(w, KV_HEADS)
        out[gguf_name(name)] = w
    return out


def tokenizer_metadata(pre: str = "gpt-2") -> dict[str, Any]:
    """The tiny models' byte-level BPE as llama.cpp writes a `gpt2` tokenizer."""
    tok = build_tokenizer()
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = np.ones(len(tokens), np.int32)
    for added in spec["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
            "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE}


def llama_metadata(vocab: int) -> dict[str, Any]:
    return {"general.architecture": "llama", "general.name": "test-llama",
            "llama.block_count": LAYERS, "llama.context_length": 2048,
            "llama.embedding_length": HIDDEN, "llama.feed_forward_length": INTER,
            "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
            "llama.rope.freq_base": 50000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.rope.dimension_count": HEAD_DIM, "llama.vocab_size": vocab}


def save_mlx_gguf(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write with mx.save_gguf (float tensors; metadata as strings, string lists, arrays)."""
    def md(v: Any) -> Any:
        if isinstance(v, (str, list)):
            return v
        if isinstance(v, np.ndarray):
            return mx.array(v)
        if isinstance(v, bool):
            return mx.array(v)
        return mx.array(v, dtype=mx.uint32 if isinstance(v, int) else mx.float32)
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in tensors.items()},
                 {k: md(v) for k, v in meta.items()})
    return path


def save_ggml_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T]], meta: dict[str, Any],
                   arch: str = "llama") -> Path:
    """Write with llama.cpp's gguf writer; each tensor quantized by its own quantizer."""
    w = ggufpy.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if key == "general.architecture":
            continue
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
        data = arr if qtype is T.F32 else ggufpy.quants.quantize(arr, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the reference ---------------------------------------------------------------------------
def reference_logits(hf: dict[str, np.ndarray], tied: bool, ids: list[int]) -> np.ndarray:
    """mlx-lm's own llama, built from the Hugging Face weights."""
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                     intermediate_size=INTER, num_attention_heads=HEADS, rms_norm_eps=1e-5,
                     vocab_size=hf["model.embed_tokens.weight"].shape[0], head_dim=HEAD_DIM,
                     num_key_value_heads=KV_HEADS, rope_theta=50000.0, tie_word_embeddings=tied,
                     max_position_embeddings=2048)
    model = Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in hf.items()])
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def converted_logits(path: Path, cache: Path, ids: list[int], compute: str) -> tuple[np.ndarray, Any]:
    lm = load(ModelConfig(name="g", path=str(path), cache_dir=str(cache),
                          compute_dtype=ComputeDType(compute)))
    return np.array(lm.model(mx.array([ids]))[0].astype(mx.float32)), lm


IDS = [5, 17, 260, 3, 99, 400, 12, 7, 301, 64, 128, 2]


@pytest.fixture(scope="module")
def tok_meta() -> dict[str, Any]:
    return tokenizer_metadata()


# -- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_float_gguf_logits_equal_mlx_lm_llama(tmp_path: Path, tok_meta: dict[str, Any], tied: bool) -> None:
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab, tied)
    src = save_mlx_gguf(tmp_path / "f32.gguf", gguf_tensors(hf), {**llama_metadata(vocab), **tok_meta})
    got, lm = converted_logits(src, tmp_path / "cache", IDS, "checkpoint")
    want = reference_logits(hf, tied, IDS)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and "quantization" not in cfg
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 50000.0 and cfg["head_dim"] == HEAD_DIM
    assert lm.max_context == 2048 and lm.compute_dtype == "float32"


def test_quantized_gguf_keeps_quantization_and_matches_its_dequantized_weights(
        tmp_path: Path, tok_meta: dict[str, Any]) -> None:
    """Q4_0 / Q4_1 blocks and a Q8_0 embedding stay an mlx-lm `quantization` config (with a
    per-layer 8-bit override); logits equal mlx-lm's llama on the values llama.cpp's own
    dequantizer gives, quantized (checkpoint) and dequantized to float32 (auto on this CPU)."""
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab, tied=True, seed=1)
    kinds = {}
    for name, w in gguf_tensors(hf).items():
        qtype = (T.F32 if w.ndim == 1 else T.Q8_0 if name == "token_embd.weight"
                 else T.Q4_1 if name.startswith("blk.0.") else T.Q4_0)
        kinds[name] = (w, qtype)
    src = save_ggml_gguf(tmp_path / "q.gguf", kinds, {**llama_metadata(vocab), **tok_meta})
    # the reference gets exactly the weights the file holds, un-permuted back to HF order
    deq = {}
    for t in ggufpy.GGUFReader(str(src)).tensors:
        deq[t.name] = ggufpy.quants.dequantize(t.data, t.tensor_type).reshape(kinds[t.name][0].shape)
    ref = {}
    for hf_name in hf:
        w = deq[gguf_name(hf_name)]
        if "q_proj" in hf_name or "k_proj" in hf_name:
            n = HEADS if "q_proj" in hf_name else KV_HEADS
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        ref[hf_name] = w.astype(np.float32)
    want = reference_logits(ref, True, IDS)

    got, lm = converted_logits(src, tmp_path / "cache", IDS, "checkpoint")
    quant = json.loads((lm.path / "config.json").read_text())["quantization"]
    assert quant == {"group_size": 32, "bits": 4, "mode": "affine",
                     "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}}
    assert lm.compute_dtype.endswith("+q4+q8"), lm.compute_dtype
    # quantized matmuls in float16 (the scales' dtype): close, same ranking of the top tokens
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.02 * scale
    assert (got.argmax(-1) == want.argmax(-1)).all()

    got32, lm32 = converted_logits(src, tmp_path / "cache", IDS, "auto")
    assert lm32.path == lm.path                        # one conversion serves both forms
    from pipeserve.model import blas
    if blas.loaded and mx.default_device() == mx.cpu:
        assert lm32.compute_dtype == "float32"         # dequantized for the BLAS path
        np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-4)


def test_bf16_tensors_load_exactly(tmp_path: Path, tok_meta: dict[str, Any]) -> None:
    """mx.load narrows BF16 to float16; the converter reads the raw bits instead."""
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab, tied=True, seed=2)
    hf["model.embed_tokens.weight"] *= 1e5             # past float16's range, fine in bfloat16
    tensors = {n: (w, T.F32 if w.ndim == 1 else T.BF16) for n, w in gguf_tensors(hf).items()}
    src = save_ggml_gguf(tmp_path / "bf16.gguf", tensors, {**llama_metadata(vocab), **tok_meta})
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.checkpoint))
    emb = lm.model.model.embed_tokens.weight
    assert emb.dtype == mx.bfloat16
    want = mx.array(hf["model.embed_tokens.weight"]).astype(mx.bfloat16)
    assert mx.array_equal(emb, want).item() and np.isfinite(np.array(emb.astype(mx.float32))).all()


def test_tokenizer_round_trips(tmp_path: Path, tok_meta: dict[str, Any]) -> None:
    """The gpt2 tokenizer rebuilt from the metadata encodes as the original; special tokens stay
    whole; `smollm` splits digits one by one; bos/eos/pad and the chat template carry over."""
    from tokenizers import Tokenizer

    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    original = build_tokenizer()
    for pre in ("gpt-2", "smollm"):
        meta = {**llama_metadata(vocab), **tokenizer_metadata(pre),
                "tokenizer.ggml.bos_token_id": 1}
        src = save_mlx_gguf(tmp_path / f"{pre}.gguf", gguf_tensors(hf_weights(vocab, True)), meta)
        out = gguf.ensure_converted(src, tmp_path / "cache")
        rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
        text = CORPUS + "<|im_start|>user\nhi<|im_end|>"
        ids = rebuilt.encode(text).ids
        assert rebuilt.decode(ids, skip_special_tokens=False) == text
        if pre == "gpt-2":
            assert ids == original.encode(text).ids
        else:
            digits = rebuilt.encode("65536").ids
            assert [rebuilt.id_to_token(i) for i in digits] == list("65536")
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        assert tok_cfg["chat_template"] == CHAT_TEMPLATE
        assert (tok_cfg["eos_token"], tok_cfg["pad_token"], tok_cfg["bos_token"]) == \
            ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
        assert tok_cfg["added_tokens_decoder"][str(original.token_to_id("<|im_end|>"))]["special"]
        assert not tok_cfg["added_tokens_decoder"][str(original.token_to_id("<tool_call>"))]["special"]


def test_conversion_is_cached_by_fingerprint(tmp_path: Path, tok_meta: dict[str, Any]) -> None:
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    src = save_mlx_gguf(tmp_path / "m.gguf", gguf_tensors(hf_weights(vocab, True)),
                        {**llama_metadata(vocab), **tok_meta})
    first = gguf.ensure_converted(src, tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf.ensure_converted(src, tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp     # not converted again
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))                    # the file changed
    second = gguf.ensure_converted(src, tmp_path / "cache")
    assert second != first and (second / "config.json").is_file()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


# -- refusals --------------------------------------------------------------------------------
def _small(tok_meta: dict[str, Any], **meta: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    return gguf_tensors(hf_weights(vocab, True)), {**llama_metadata(vocab), **tok_meta, **meta}


def test_unsupported_architecture_is_refused_at_launch(tmp_path: Path, model_cache: Path,
                                                      tok_meta: dict[str, Any]) -> None:
    tensors, meta = _small(tok_meta, **{"general.architecture": "falcon"})
    src = save_mlx_gguf(tmp_path / "falcon.gguf", tensors, meta)
    msg = startup_error(model_cache, "model=llama", f"model.path={src}")
    assert "architecture 'falcon' is not supported" in msg
    assert "supported: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, gpt-oss, glm4moe, deepseek2" in msg


def test_unsupported_tokenizer_is_refused(tmp_path: Path, model_cache: Path,
                                          tok_meta: dict[str, Any]) -> None:
    tensors, meta = _small(tok_meta, **{"tokenizer.ggml.model": "t5"})
    src = save_mlx_gguf(tmp_path / "t5.gguf", tensors, meta)
    msg = startup_error(model_cache, "model=llama", f"model.path={src}")
    assert "tokenizer model 't5' is not supported" in msg
    assert "supported: gpt2 (byte-level BPE), llama (SentencePiece)" in msg
    tensors, meta = _small(tok_meta, **{"tokenizer.ggml.pre": "deepseek-coder"})
    with pytest.raises(ConfigError, match="pre-tokenizer 'deepseek-coder' is not supported"):
        gguf.ensure_converted(save_mlx_gguf(tmp_path / "pre.gguf", tensors, meta), tmp_path)


def test_unsupported_quantization_is_refused_naming_the_type(tmp_path: Path, model_cache: Path,
                                                             tok_meta: dict[str, Any]) -> None:
    """Types with no conversion (Q8_1, Q8_K, integer tensors) are refused, naming a tensor and
    the supported types."""
    tensors, meta = _small(tok_meta)
    src = tmp_path / "q8_1.gguf"
    w = ggufpy.GGUFWriter(str(src), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    for name, arr in tensors.items():
        if name == "blk.1.ffn_up.weight":   # two Q8_1 blocks (32 values, 36 bytes) per row
            block = ggufpy.GGML_QUANT_SIZES[T.Q8_1][1]
            w.add_tensor(name, np.zeros((INTER, 2 * block), np.uint8), raw_dtype=T.Q8_1)
        else:
            w.add_tensor(name, arr, raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = startup_error(model_cache, "model=llama", f"model.path={src}")
    assert "tensor type Q8_1 is not supported" in msg and "blk.1.ffn_up.weight is Q8_1" in msg
    assert ("supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, "
            "Q6_K, IQ4_NL, IQ4_XS, IQ3_S") in msg


def test_unknown_tensor_and_not_a_gguf_are_refused(tmp_path: Path, model_cache: Path,
                                                   tok_meta: dict[str, Any]) -> None:
    tensors, meta = _small(tok_meta)
    tensors["rope_factors_long.weight"] = np.ones(HEAD_DIM // 2, np.float32)
    src = save_mlx_gguf(tmp_path / "rope.gguf", tensors, meta)
    msg = startup_error(model_cache, "model=llama", f"model.path={src}")
    assert "tensor 'rope_factors_long.weight' has no place" in msg
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    msg = startup_error(model_cache, "model=llama", f"model.path={junk}")
    assert "is a file but not a GGUF file" in msg
