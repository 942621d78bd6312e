"""GGUF `glm4moe` (GLM-4.5 / 4.6 / 4.7): a random GLM-4-MoE written as llama.cpp's converter
writes it (a leading dense layer, then a MoE layer with a shared expert, sigmoid routing with
its correction bias and scaling, partial rotary, q/k norms, attention biases, and the appended
MTP block) converts onto mlx-lm's glm4_moe class without the MTP block; its logits equal
mlx-lm's glm4_moe on llama.cpp's dequantization of the same file, and the engine decodes
greedily the tokens mlx_lm gives on the converted checkpoint."""
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

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, MOE_INTER, EXPERTS, TOP_K = 64, 4, 2, 16, 128, 32, 4, 2
SCALE = 2.5   # routed_scaling_factor
PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
         "mlp.switch_mlp.down_proj": "ffn_down_exps",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def hf_weights(vocab: int) -> dict[str, np.ndarray]:
    """A random GLM-4-MoE in mlx-lm's parameter names: layer 0 dense, layer 1 MoE."""
    rng = np.random.default_rng(45)

    def lin(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
         "lm_head.weight": 2 * lin(vocab, HIDDEN)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(2):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        for norm in ("q_norm", "k_norm"):
            w[p + f"self_attn.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(HEAD_DIM)
        for name, rows in {"q_proj": q, "k_proj": kv, "v_proj": kv}.items():
            w[p + f"self_attn.{name}.weight"] = lin(rows, HIDDEN)
            w[p + f"self_attn.{name}.bias"] = 0.1 * rng.standard_normal(rows)
        w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, q)
        if i == 0:
            for name, shape in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
                                "down_proj": (HIDDEN, INTER)}.items():
                w[p + f"mlp.{name}.weight"] = lin(*shape)
            continue
        w[p + "mlp.gate.weight"] = lin(EXPERTS, HIDDEN)
        w[p + "mlp.gate.e_score_correction_bias"] = 0.1 * rng.standard_normal(EXPERTS)
        for name, shape in {"gate_proj": (MOE_INTER, HIDDEN), "up_proj": (MOE_INTER, HIDDEN),
                            "down_proj": (HIDDEN, MOE_INTER)}.items():
            w[p + f"mlp.switch_mlp.{name}.weight"] = lin(EXPERTS, *shape)
            w[p + f"mlp.shared_experts.{name}.weight"] = lin(*shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        if rest == "mlp.gate.e_score_correction_bias":
            return f"blk.{i}.exp_probs_b.bias"
        module, _, suffix = rest.rpartition(".")
        return f"blk.{i}.{BLOCK[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
            "model.norm.weight": "output_norm.weight"}[hf]


def metadata(vocab: int) -> dict[str, Any]:
    a = "glm4moe"
    return {f"{a}.block_count": 3, f"{a}.nextn_predict_layers": 1, f"{a}.context_length": 2048,
            f"{a}.embedding_length": HIDDEN, f"{a}.feed_forward_length": INTER,
            f"{a}.expert_feed_forward_length": MOE_INTER, f"{a}.attention.head_count": HEADS,
            f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.key_length": HEAD_DIM,
            f"{a}.attention.value_length": HEAD_DIM, f"{a}.rope.dimension_count": HEAD_DIM // 2,
            f"{a}.rope.freq_base": 1000000.0, f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{a}.expert_count": EXPERTS, f"{a}.expert_used_count": TOP_K,
            f"{a}.expert_shared_count": 1, f"{a}.leading_dense_block_count": 1,
            f"{a}.expert_weights_scale": SCALE, f"{a}.expert_weights_norm": True,
            f"{a}.expert_gating_func": 2, "general.name": "tiny-glm4moe"}


def reference(weights: dict[str, np.ndarray], vocab: int) -> Any:
    from mlx_lm.models.glm4_moe import Model, ModelArgs
    model = Model(ModelArgs(
        model_type="glm4_moe", vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
        max_position_embeddings=2048, moe_intermediate_size=MOE_INTER, norm_topk_prob=True,
        num_attention_heads=HEADS, n_group=1, head_dim=HEAD_DIM, topk_group=1,
        n_shared_experts=1, n_routed_experts=EXPERTS, routed_scaling_factor=SCALE,
        num_experts_per_tok=TOP_K, first_k_dense_replace=1, num_hidden_layers=2,
        num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, rope_theta=1000000.0,
        rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False, attention_bias=True,
        partial_rotary_factor=0.5))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def test_glm4moe_gguf_serves_like_mlx_lm(tmp_path: Path, engine_factory: Any) -> None:

    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab)
    tensors = {gguf_name(k): (v, T.Q8_0 if "_exps" in gguf_name(k) else T.F32)
               for k, v in hf.items()}
    rng = np.random.default_rng(1)   # the MTP block llama.cpp appends: dropped, as mlx-lm does
    for name, shape in {"blk.2.attn_norm.weight": (HIDDEN,),
                        "blk.2.nextn.eh_proj.weight": (HIDDEN, 2 * HIDDEN),
                        "blk.2.nextn.enorm.weight": (HIDDEN,)}.items():
        tensors[name] = (rng.standard_normal(shape).astype(np.float32), T.F32)
    src = written(tmp_path, tensors, {**metadata(vocab), **tok}, arch="glm4moe")
    deq = dict(hf)
    for t in ggufpy.GGUFReader(str(src)).tensors:
        if t.tensor_type == T.Q8_0:
            name = next(k for k in hf if gguf_name(k) == t.name)
            deq[name] = ggufpy.quants.dequantize(t.data, T.Q8_0).reshape(hf[name].shape)

    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["num_hidden_layers"] == 2
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["use_qk_norm"] and cfg["attention_bias"]
    ids = [(7 * i + 3) % vocab for i in range(12)] + PROMPT
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
