"""GGUF `deepseek2` (DeepSeek-V3 / R1, Kimi-K2): a random MLA model written as llama.cpp's
converter writes it (q and kv low-rank projections, kv_b split into per-head attn_k_b / attn_v_b,
MLA head sizes as key/value_length_mla, a leading dense layer, sigmoid-routed experts with a
shared expert and correction bias, yarn rope, an MTP block to drop) converts onto mlx-lm's
deepseek_v3 class; its logits equal mlx-lm's deepseek_v3 on llama.cpp's dequantization of the
same file, and the engine decodes greedily the tokens mlx_lm gives on the converted checkpoint."""
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

HIDDEN, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 64, 4, 32, 32, 8, 16, 16
INTER, MOE_INTER, EXPERTS, TOP_K, SCALE = 128, 32, 4, 2, 2.5
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
         "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.embed_q": "attn_k_b",
         "self_attn.unembed_out": "attn_v_b", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
         "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def hf_weights(vocab: int) -> dict[str, np.ndarray]:
    """A random DeepSeek-V3 in mlx-lm's parameter names (kv_b already split, as its sanitize
    and llama.cpp's converter both split it): layer 0 dense, layer 1 MoE."""
    rng = np.random.default_rng(46)

    def lin(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    def norm(n: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": norm(HIDDEN), "lm_head.weight": 2 * lin(vocab, HIDDEN)}
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        a = p + "self_attn."
        w[a + "q_a_proj.weight"] = lin(Q_LORA, HIDDEN)
        w[a + "q_a_layernorm.weight"] = norm(Q_LORA)
        w[a + "q_b_proj.weight"] = lin(HEADS * (NOPE + ROPE), Q_LORA)
        w[a + "kv_a_proj_with_mqa.weight"] = lin(KV_LORA + ROPE, HIDDEN)
        w[a + "kv_a_layernorm.weight"] = norm(KV_LORA)
        w[a + "embed_q.weight"] = lin(HEADS, KV_LORA, NOPE)
        w[a + "unembed_out.weight"] = lin(HEADS, V_HEAD, KV_LORA)
        w[a + "o_proj.weight"] = lin(HIDDEN, HEADS * V_HEAD)
        shapes = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
                  "down_proj": (HIDDEN, INTER)}
        if i == 0:
            for name, shape in shapes.items():
                w[p + f"mlp.{name}.weight"] = lin(*shape)
            continue
        w[p + "mlp.gate.weight"] = lin(EXPERTS, HIDDEN)
        w[p + "mlp.gate.e_score_correction_bias"] = 0.1 * rng.standard_normal(EXPERTS)
        for name, (rows, cols) in shapes.items():
            rows, cols = (MOE_INTER, cols) if rows == INTER else (rows, MOE_INTER)
            w[p + f"mlp.switch_mlp.{name}.weight"] = lin(EXPERTS, rows, cols)
            w[p + f"mlp.shared_experts.{name}.weight"] = lin(rows, cols)
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


def metadata() -> dict[str, Any]:
    a = "deepseek2"
    return {f"{a}.block_count": 3, f"{a}.nextn_predict_layers": 1, f"{a}.context_length": 2048,
            f"{a}.embedding_length": HIDDEN, f"{a}.feed_forward_length": INTER,
            f"{a}.expert_feed_forward_length": MOE_INTER, f"{a}.attention.head_count": HEADS,
            f"{a}.attention.head_count_kv": 1, f"{a}.attention.q_lora_rank": Q_LORA,
            f"{a}.attention.kv_lora_rank": KV_LORA, f"{a}.attention.key_length": KV_LORA + ROPE,
            f"{a}.attention.value_length": KV_LORA, f"{a}.attention.key_length_mla": NOPE + ROPE,
            f"{a}.attention.value_length_mla": V_HEAD, f"{a}.rope.dimension_count": ROPE,
            f"{a}.rope.freq_base": 10000.0, f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{a}.expert_count": EXPERTS, f"{a}.expert_used_count": TOP_K,
            f"{a}.expert_shared_count": 1, f"{a}.leading_dense_block_count": 1,
            f"{a}.expert_weights_scale": SCALE, f"{a}.expert_weights_norm": True,
            f"{a}.expert_gating_func": 2, f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": YARN["factor"],
            f"{a}.rope.scaling.original_context_length": YARN["original_max_position_embeddings"],
            f"{a}.rope.scaling.yarn_log_multiplier": 0.1, "general.name": "tiny-deepseek"}


def reference(weights: dict[str, np.ndarray], vocab: int) -> Any:
    from mlx_lm.models.deepseek_v3 import Model, ModelArgs
    model = Model(ModelArgs(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, n_shared_experts=1, n_routed_experts=EXPERTS,
        routed_scaling_factor=SCALE, kv_lora_rank=KV_LORA, q_lora_rank=Q_LORA,
        qk_rope_head_dim=ROPE, v_head_dim=V_HEAD, qk_nope_head_dim=NOPE,
        num_experts_per_tok=TOP_K, first_k_dense_replace=1, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=YARN))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def test_deepseek2_gguf_serves_like_mlx_lm(tmp_path: Path, engine_factory: Any) -> None:

    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    hf = hf_weights(vocab)
    tensors = {gguf_name(k): (v, T.Q8_0 if "_exps" in gguf_name(k) else T.F32)
               for k, v in hf.items()}
    tensors["blk.2.nextn.eh_proj.weight"] = (np.ones((HIDDEN, 2 * HIDDEN), np.float32), T.F32)
    src = written(tmp_path, tensors, {**metadata(), **tok}, arch="deepseek2")
    deq = dict(hf)
    for t in ggufpy.GGUFReader(str(src)).tensors:
        if t.tensor_type == T.Q8_0:
            name = next(k for k in hf if gguf_name(k) == t.name)
            deq[name] = ggufpy.quants.dequantize(t.data, T.Q8_0).reshape(hf[name].shape)

    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    cfg = json.loads((lm.path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_hidden_layers"] == 2
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["rope_scaling"]) == (NOPE, V_HEAD, YARN)
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
