"""GGUF `gpt-oss`: a random gpt-oss written as llama.cpp's converter writes it (experts in MXFP4
through the `gguf` package's quantizer, attention with biases and sinks, alternating sliding and
global layers, yarn rope) converts onto mlx-lm's gpt_oss class with its experts in MLX's mxfp4
mode; its logits equal mlx-lm's gpt_oss on llama.cpp's dequantization of the same file, and the
engine decodes greedily the tokens mlx_lm gives on the converted checkpoint."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import gguf as ggufpy
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.model.test_gguf import tokenizer_metadata
from tests.model.test_gguf_quants import written
from tests.model.gguf_served import converted, served_equals_mlx_lm

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EXPERTS, TOP_K, LAYERS, WINDOW = \
    64, 4, 2, 16, 64, 4, 2, 2, 4
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
         "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
         "mlp.experts.down_proj": "ffn_down_exps"}


def hf_weights(vocab: int) -> dict[str, np.ndarray]:
    """A random gpt-oss in mlx-lm's parameter names (as its sanitize leaves them)."""
    rng = np.random.default_rng(42)

    def lin(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
         "lm_head.weight": 2 * lin(vocab, HIDDEN)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        for name, (rows, cols) in {"q_proj": (q, HIDDEN), "k_proj": (kv, HIDDEN),
                                   "v_proj": (kv, HIDDEN), "o_proj": (HIDDEN, q)}.items():
            w[p + f"self_attn.{name}.weight"] = lin(rows, cols)
            w[p + f"self_attn.{name}.bias"] = 0.1 * rng.standard_normal(rows)
        w[p + "self_attn.sinks"] = rng.standard_normal(HEADS)
        w[p + "mlp.router.weight"] = lin(EXPERTS, HIDDEN)
        w[p + "mlp.router.bias"] = 0.1 * rng.standard_normal(EXPERTS)
        for name, (rows, cols) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
                                   "down_proj": (HIDDEN, INTER)}.items():
            w[p + f"mlp.experts.{name}.weight"] = lin(EXPERTS, rows, cols)
            w[p + f"mlp.experts.{name}.bias"] = 0.1 * rng.standard_normal((EXPERTS, rows))
    return {k: v.astype(np.float32) for k, v in w.items()}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        if rest == "self_attn.sinks":
            return f"blk.{i}.attn_sinks.weight"
        module, _, suffix = rest.rpartition(".")
        return f"blk.{i}.{BLOCK[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
            "model.norm.weight": "output_norm.weight"}[hf]


def metadata(vocab: int) -> dict[str, Any]:
    a = "gpt-oss"
    return {f"{a}.block_count": LAYERS, f"{a}.context_length": 2048,
            f"{a}.embedding_length": HIDDEN, f"{a}.feed_forward_length": INTER,
            f"{a}.expert_feed_forward_length": INTER, f"{a}.attention.head_count": HEADS,
            f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.key_length": HEAD_DIM,
            f"{a}.attention.value_length": HEAD_DIM, f"{a}.rope.freq_base": 150000.0,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.expert_count": EXPERTS,
            f"{a}.expert_used_count": TOP_K, f"{a}.attention.sliding_window": WINDOW,
            f"{a}.rope.dimension_count": HEAD_DIM, f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": YARN["factor"],
            f"{a}.rope.scaling.original_context_length": YARN["original_max_position_embeddings"],
            "general.name": "tiny-gpt-oss", f"{a}.vocab_size": vocab}


def reference(weights: dict[str, np.ndarray], vocab: int) -> Any:
    from mlx_lm.models.gpt_oss import Model, ModelArgs
    model = Model(ModelArgs(
        num_hidden_layers=LAYERS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        vocab_size=vocab, rms_norm_eps=1e-5, hidden_size=HIDDEN, intermediate_size=INTER,
        head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        sliding_window=WINDOW, rope_theta=150000, rope_scaling=YARN,
        layer_types=["sliding_attention", "full_attention"]))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def test_gpt_oss_gguf_with_mxfp4_experts_serves_like_mlx_lm(tmp_path: Path,
                                                            engine_factory: Any) -> None:

    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab)
    tensors = {gguf_name(k): (v, T.MXFP4 if ".experts." in k and k.endswith("weight") else T.F32)
               for k, v in hf.items()}
    src = written(tmp_path, tensors, {**metadata(vocab), **tok}, arch="gpt-oss")
    deq = dict(hf)   # the reference holds exactly what the file holds
    for t in ggufpy.GGUFReader(str(src)).tensors:
        if t.tensor_type == T.MXFP4:
            name = next(k for k in hf if gguf_name(k) == t.name)
            deq[name] = ggufpy.quants.dequantize(t.data, T.MXFP4).reshape(hf[name].shape)

    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["layer_types"] == ["sliding_attention",
                                                                     "full_attention"]
    assert cfg["quantization"]["mode"] == "mxfp4" and cfg["rope_scaling"] == YARN
    ids = [(7 * i + 3) % vocab for i in range(3 * WINDOW)] + PROMPT   # past the window
    np.testing.assert_allclose(np.array(lm.model(mx.array([ids]))[0]),
                               np.array(reference(deq, vocab)(mx.array([ids]))[0]),
                               rtol=1e-3, atol=1e-3)

    engine, mlx_ids = served_equals_mlx_lm(engine_factory, lm.path, PROMPT, *args)
    assert engine.engine.memory == fit.memory
    # the experts offloaded (mapped from the converted copy, a cache of a few per layer): the same
    offloaded = engine_factory("model=llama", *args, "model.expert_offload=true",
                               "model.expert_cache_mb=0.02")
    req = offloaded.request(PROMPT, max_tokens=8)
    req.stop_token_ids = frozenset()
    assert asyncio.run(offloaded.generate_many([req]))[0]["ids"] == mlx_ids
    assert offloaded.engine.loaded.experts.stats.misses > 0
