"""GGUF `qwen35` / `qwen35moe` (Qwen3.5, 3.6): a random Qwen3.5 — gated-delta linear attention
layers with fewer key heads than value heads, a gated full-attention layer, dense or MoE with a
shared expert, and the MTP block llama.cpp appends — written as llama.cpp's converter writes it
(-exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed, value heads in tiled order across qkv, z,
alpha, beta, A, dt, conv1d and the columns of ssm_out, quantized or not) converts onto mlx-lm's
qwen3_5 / qwen3_5_moe classes; its logits equal mlx-lm's model on the original weights (at the
file's quantization), and the engine decodes greedily the tokens mlx_lm gives on the converted
checkpoint, with the memory model `pipeserve fit` read from the header."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import gguf as ggufpy
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.model.test_gguf import tokenizer_metadata
from tests.model.test_gguf_quants import written
from tests.model.gguf_served import converted, served_equals_mlx_lm

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM, INTER, LAYERS = 64, 4, 2, 32, 8, 128, 4
K_HEADS, V_HEADS, DK, DV, KERNEL = 2, 4, 16, 32, 4   # two value heads per key head
EXPERTS, TOP_K, MOE_INTER, SHARED_INTER = 4, 2, 32, 64
PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]
LINEAR = {"in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_a": "ssm_alpha",
          "in_proj_b": "ssm_beta", "conv1d": "ssm_conv1d", "norm": "ssm_norm",
          "out_proj": "ssm_out"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
         "mlp.switch_mlp.down_proj": "ffn_down_exps",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp",
         **{f"linear_attn.{k}": v for k, v in LINEAR.items()}}


def hf_weights(vocab: int, moe: bool) -> dict[str, np.ndarray]:
    """A random Qwen3.5 in mlx-lm's parameter names, as its sanitize leaves them (norms already
    1 + w, conv1d as (channels, kernel, 1)); layers 0-2 linear attention, layer 3 full."""
    rng = np.random.default_rng(35)

    def lin(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    def norm(n: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": norm(HIDDEN), "lm_head.weight": 2 * lin(vocab, HIDDEN)}
    conv = 2 * K_HEADS * DK + V_HEADS * DV
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if i < 3:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = lin(conv, HIDDEN)
            w[a + "in_proj_z.weight"] = lin(V_HEADS * DV, HIDDEN)
            w[a + "in_proj_a.weight"] = lin(V_HEADS, HIDDEN)
            w[a + "in_proj_b.weight"] = lin(V_HEADS, HIDDEN)
            w[a + "conv1d.weight"] = 0.5 * rng.standard_normal((conv, KERNEL, 1))
            w[a + "A_log"] = np.log(rng.uniform(0.5, 8, V_HEADS))
            w[a + "dt_bias"] = 0.5 * rng.standard_normal(V_HEADS)
            w[a + "norm.weight"] = norm(DV)
            w[a + "out_proj.weight"] = lin(HIDDEN, V_HEADS * DV)
        else:
            w[p + "self_attn.q_proj.weight"] = lin(2 * HEADS * HEAD_DIM, HIDDEN)
            w[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
            w[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
            w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
            w[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if not moe:
            for name, shape in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
                                "down_proj": (HIDDEN, INTER)}.items():
                w[p + f"mlp.{name}.weight"] = lin(*shape)
            continue
        w[p + "mlp.gate.weight"] = lin(EXPERTS, HIDDEN)
        w[p + "mlp.shared_expert_gate.weight"] = lin(1, HIDDEN)
        for name, (rows, cols) in {"gate_proj": (MOE_INTER, HIDDEN), "up_proj": (MOE_INTER, HIDDEN),
                                   "down_proj": (HIDDEN, MOE_INTER)}.items():
            w[p + f"mlp.switch_mlp.{name}.weight"] = lin(EXPERTS, rows, cols)
        for name, shape in {"gate_proj": (SHARED_INTER, HIDDEN), "up_proj": (SHARED_INTER, HIDDEN),
                            "down_proj": (HIDDEN, SHARED_INTER)}.items():
            w[p + f"mlp.shared_expert.{name}.weight"] = lin(*shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


def tiled(x: np.ndarray, axis: int) -> np.ndarray:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled order."""
    r = V_HEADS // K_HEADS
    shape = x.shape
    d = shape[axis] // V_HEADS
    x = x.reshape(*shape[:axis], K_HEADS, r, d, *shape[axis + 1:])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def llama_cpp_tensor(name: str, x: np.ndarray) -> tuple[str, np.ndarray]:
    """One mlx-lm tensor as llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel writes it."""
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}[name], x
    _, _, i, rest = name.split(".", 3)
    qk = 2 * K_HEADS * DK
    if rest == "linear_attn.A_log":
        return f"blk.{i}.ssm_a", -np.exp(tiled(x, 0))
    if rest == "linear_attn.dt_bias":
        return f"blk.{i}.ssm_dt.bias", tiled(x, 0)
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        x = x.reshape(x.shape[0], -1)   # conv1d squeezed to (channels, kernel)
        x = np.concatenate([x[:qk], tiled(x[qk:], 0)])
    elif rest.startswith(("linear_attn.in_proj_z", "linear_attn.in_proj_a",
                          "linear_attn.in_proj_b")):
        x = tiled(x, 0)
    elif rest == "linear_attn.out_proj.weight":
        x = tiled(x, 1)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{i}.{BLOCK[module]}.{suffix}", x


def metadata(vocab: int, moe: bool) -> dict[str, Any]:
    a = "qwen35moe" if moe else "qwen35"
    meta = {f"{a}.block_count": LAYERS + 1, f"{a}.nextn_predict_layers": 1,
            f"{a}.context_length": 2048, f"{a}.embedding_length": HIDDEN,
            f"{a}.feed_forward_length": INTER, f"{a}.attention.head_count": HEADS,
            f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.key_length": HEAD_DIM,
            f"{a}.attention.value_length": HEAD_DIM, f"{a}.rope.dimension_count": ROPE_DIM,
            f"{a}.rope.freq_base": 10000000.0, f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{a}.ssm.conv_kernel": KERNEL, f"{a}.ssm.state_size": DK,
            f"{a}.ssm.group_count": K_HEADS, f"{a}.ssm.time_step_rank": V_HEADS,
            f"{a}.ssm.inner_size": V_HEADS * DV, f"{a}.full_attention_interval": 4,
            f"{a}.rope.dimension_sections": [3, 3, 2, 0], "general.name": f"tiny-{a}"}
    if moe:
        meta.update({f"{a}.expert_count": EXPERTS, f"{a}.expert_used_count": TOP_K,
                     f"{a}.expert_feed_forward_length": MOE_INTER,
                     f"{a}.expert_shared_feed_forward_length": SHARED_INTER})
    return meta


def quantized_type(gguf_name: str, x: np.ndarray, moe: bool) -> T:
    """Q8_0 for the matrices (the MoE file keeps ssm_out in F32: both column paths run)."""
    if x.ndim == 1 or "token_embd" in gguf_name or "ssm_conv1d" in gguf_name:
        return T.F32
    if moe and "ssm_out" in gguf_name:
        return T.F32
    return T.Q8_0


def reference(weights: dict[str, np.ndarray], vocab: int, moe: bool) -> Any:
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    cfg = {"model_type": "qwen3_5", "vocab_size": vocab, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
           "linear_num_value_heads": V_HEADS, "linear_num_key_heads": K_HEADS,
           "linear_key_head_dim": DK, "linear_value_head_dim": DV,
           "linear_conv_kernel_dim": KERNEL, "full_attention_interval": 4,
           "max_position_embeddings": 2048, "tie_word_embeddings": False,
           "rope_parameters": {"type": "default", "rope_theta": 1e7,
                               "partial_rotary_factor": ROPE_DIM / HEAD_DIM}}
    if moe:
        cfg.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTER,
                   shared_expert_intermediate_size=SHARED_INTER, norm_topk_prob=True)
    module = qwen3_5_moe if moe else qwen3_5
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights([("language_model." + k, mx.array(v)) for k, v in weights.items()])
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_qwen35_gguf_serves_like_mlx_lm(tmp_path: Path, engine_factory: Any, moe: bool) -> None:

    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab, moe)
    tensors, deq = {}, {}
    for name, x in hf.items():
        gname, gx = llama_cpp_tensor(name, x)
        qtype = quantized_type(gname, gx, moe)
        tensors[gname] = (gx, qtype)
        # blockwise quantization commutes with moving whole rows and whole 32-column heads
        deq[name] = x if qtype is T.F32 else ggufpy.quants.dequantize(
            ggufpy.quants.quantize(x, qtype), qtype).reshape(x.shape)
    rng = np.random.default_rng(1)   # the MTP block llama.cpp appends: dropped, as mlx-lm does
    for name, shape in {f"blk.{LAYERS}.attn_norm.weight": (HIDDEN,),
                        f"blk.{LAYERS}.nextn.eh_proj.weight": (HIDDEN, 2 * HIDDEN)}.items():
        tensors[name] = (rng.standard_normal(shape).astype(np.float32), T.F32)
    arch = "qwen35moe" if moe else "qwen35"
    src = written(tmp_path, tensors, {**metadata(vocab, moe), **tok}, arch=arch)

    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    assert cfg["num_hidden_layers"] == LAYERS and cfg["linear_num_value_heads"] == V_HEADS
    ids = [(7 * i + 3) % vocab for i in range(12)] + PROMPT
    np.testing.assert_allclose(np.array(lm.model(mx.array([ids]))[0]),
                               np.array(reference(deq, vocab, moe)(mx.array([ids]))[0]),
                               rtol=1e-3, atol=1e-3)

    engine, mlx_ids = served_equals_mlx_lm(engine_factory, lm.path, PROMPT, *args)
    assert engine.engine.memory == fit.memory
    if not moe:
        return
    # the experts offloaded (mapped from the converted copy, a cache of a few per layer): the same
    offloaded = engine_factory("model=llama", *args, "model.expert_offload=true",
                               "model.expert_cache_mb=0.02")
    req = offloaded.request(PROMPT, max_tokens=8)
    req.stop_token_ids = frozenset()
    assert asyncio.run(offloaded.generate_many([req]))[0]["ids"] == mlx_ids
    assert offloaded.engine.loaded.experts.stats.misses > 0
