"""Every GGUF architecture the conversion maps (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3,
phi3): a random model in Hugging Face layout is written as llama.cpp's converter writes it (its
tensor names, q/k permutation for llama, gemma's stored 1 + w norms, phi3's fused qkv and gate/up,
the `<arch>.*` metadata), converted, and compared with mlx-lm's own class for that architecture
built from the Hugging Face weights: logits equal in float32, and pipeserve's engine on the GGUF
decodes greedily the tokens mlx_lm.generate gives on the converted directory."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from pipeserve.model.gguf import convert as gguf
from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.errors import ConfigError
from pipeserve.model.loader import load
from tests.model.test_gguf import permute, save_mlx_gguf, tokenizer_metadata

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EXPERTS = 64, 4, 2, 16, 128, 4
LAYERS = {"gemma3": 6}   # gemma3: five sliding-window layers, then a global one; others 2
PROMPT = [5, 17, 260, 3, 99, 400, 12, 7]


def _rng(arch: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, arch)))


def hf_model(arch: str, vocab: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(mlx-lm config, Hugging Face-layout weights) of a random `arch` model."""
    rng = _rng(arch)
    gemma = arch.startswith("gemma")
    tied = arch in ("qwen2", "gemma2", "gemma3", "qwen3moe")

    def lin(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) / np.sqrt(cols)

    def norm(n: int) -> np.ndarray:   # gemma's HF norms are w in x * (1 + w)
        return (0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(n)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
                                "model.norm.weight": norm(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = 2 * lin(vocab, HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS.get(arch, 2)):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            w[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
        if arch == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = lin(q + 2 * kv, HIDDEN)
            w[p + "mlp.gate_up_proj.weight"] = lin(2 * INTER, HIDDEN)
        else:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.weight"] = lin(rows, HIDDEN)
                if arch == "qwen2":
                    w[p + f"self_attn.{name}.bias"] = 0.1 * rng.standard_normal(rows)
        w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, q)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if arch == "qwen3moe":
            w[p + "mlp.gate.weight"] = lin(EXPERTS, HIDDEN)
            for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, INTER))):
                w[p + f"mlp.switch_mlp.{name}.weight"] = np.stack(
                    [lin(*shape) for _ in range(EXPERTS)])
        elif arch == "phi3":
            w[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
        else:
            w[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
            w[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
            w[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
    cfg: dict[str, Any] = {
        "model_type": {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}.get(arch, arch),
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS.get(arch, 2), "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": tied}
    if gemma:
        cfg.update(query_pre_attn_scalar=HEAD_DIM)
    if arch == "gemma2":
        cfg.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if arch == "gemma3":
        cfg.update(sliding_window=512, sliding_window_pattern=6, rope_local_base_freq=10000.0)
    if arch == "qwen3moe":
        cfg.update(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=INTER,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return cfg, {k: v.astype(np.float32) for k, v in w.items()}


GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
              "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
              "mlp.switch_mlp.down_proj": "ffn_down_exps",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def llama_cpp_tensors(arch: str, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What convert_hf_to_gguf.py writes for these weights."""
    out = {}
    gemma = arch.startswith("gemma")
    for name, w in hf.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            if module == "post_attention_layernorm":
                module_gguf = "post_attention_norm" if gemma else "ffn_norm"
            else:
                module_gguf = GGUF_BLOCK[module]
            gname = f"blk.{i}.{module_gguf}.{suffix}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = permute(w, HEADS if "q_proj" in name else KV_HEADS)
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0      # Gemma*Model.modify_tensors: the norm weight as ggml multiplies by it
        out[gname] = w
    return out


def gguf_metadata(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": arch, "general.name": f"test-{arch}",
        f"{arch}.block_count": LAYERS.get(arch, 2), f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": HIDDEN, f"{arch}.feed_forward_length": INTER,
        f"{arch}.attention.head_count": HEADS, f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.key_length": HEAD_DIM, f"{arch}.attention.value_length": HEAD_DIM,
        f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.dimension_count": HEAD_DIM}
    if arch == "gemma2":
        meta.update({"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0})
    if arch == "gemma3":
        meta["gemma3.attention.sliding_window"] = 512
    if arch == "qwen3moe":
        meta.update({"qwen3moe.expert_count": EXPERTS, "qwen3moe.expert_used_count": 2,
                     "qwen3moe.expert_feed_forward_length": INTER})
    return meta


def reference_model(cfg: dict[str, Any], hf: dict[str, np.ndarray]) -> Any:
    from mlx_lm.utils import _get_classes
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    weights = {k: mx.array(v) for k, v in hf.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(model(mx.array([out]))[0, -1].argmax().item()))
    return out[len(ids):]


ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def tok_meta() -> dict[str, Any]:
    return tokenizer_metadata()


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_converts_to_its_mlx_lm_class(tmp_path: Path, tok_meta: dict[str, Any],
                                                   engine_factory: Any, arch: str) -> None:
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg, hf = hf_model(arch, vocab)
    src = save_mlx_gguf(tmp_path / f"{arch}.gguf", llama_cpp_tensors(arch, hf),
                        {**gguf_metadata(arch, cfg), **tok_meta})
    ref = reference_model(cfg, hf)
    want = np.array(ref(mx.array([PROMPT]))[0])

    cache = tmp_path / "cache"
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(cache),
                          compute_dtype=ComputeDType.float32))
    assert lm.config["model_type"] == cfg["model_type"]
    got = np.array(lm.model(mx.array([PROMPT]))[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    model, _ = mlx_load(str(lm.path))
    steps = generate_step(mx.array(PROMPT), model, max_tokens=8, sampler=make_sampler(0.0))
    mlx_ids = [int(t) for t, _ in steps]
    assert mlx_ids == greedy(ref, PROMPT, 8)

    engine = engine_factory("model=llama", f"model.path={src}", "model.compute_dtype=float32",
                            "model.use_generation_config=false")
    req = engine.request(PROMPT, max_tokens=8)
    req.stop_token_ids = frozenset()     # random weights: decode all 8, as generate_step does
    served = asyncio.run(engine.generate_many([req]))[0]["ids"]
    assert served == mlx_ids

    # cached: the second launch converts nothing; a changed file converts again
    first = gguf.ensure_converted(src, cache)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf.ensure_converted(src, cache) == first == lm.path
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    assert gguf.ensure_converted(src, cache) != first


def llama3_rope_freqs(base: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3 (low 1,
    high 4, original context 8192), in numpy."""
    import math
    low, high, old = 1.0, 4.0, 8192
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])   # Llama 3.1 and 3.2
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path, tok_meta: dict[str, Any],
                                                          factor: float) -> None:
    """llama.cpp keeps Llama 3.x's rope scaling only as the `rope_freqs` tensor; the conversion
    finds the llama3 setting that reproduces it, so logits at long positions equal mlx-lm's llama
    with that config.json setting; factors matching no Llama 3 setting are refused."""
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg, hf = hf_model("llama", vocab)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg.update(rope_theta=500000.0, rope_scaling=scaling)
    tensors = {**llama_cpp_tensors("llama", hf),
               "rope_freqs.weight": llama3_rope_freqs(500000.0, HEAD_DIM, factor)}
    meta = {**gguf_metadata("llama", cfg), "llama.rope.freq_base": 500000.0, **tok_meta}
    src = save_mlx_gguf(tmp_path / "llama3.gguf", tensors, meta)
    ids = [(7 * i) % vocab for i in range(300)]
    want = np.array(reference_model(cfg, hf)(mx.array([ids]))[0])
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.float32))
    assert lm.config["rope_scaling"] == scaling
    np.testing.assert_allclose(np.array(lm.model(mx.array([ids]))[0]), want, rtol=1e-3, atol=1e-3)
    plain = {**cfg, "rope_scaling": None}
    assert not np.allclose(np.array(reference_model(plain, hf)(mx.array([ids]))[0]), want,
                           atol=1e-3)                  # the scaling matters at these positions

    tensors["rope_freqs.weight"] = np.linspace(1, factor, HEAD_DIM // 2).astype(np.float32)
    odd = save_mlx_gguf(tmp_path / "odd.gguf", tensors, meta)
    with pytest.raises(ConfigError, match="match no Llama 3 rope scaling"):
        load(ModelConfig(name="g", path=str(odd), cache_dir=str(tmp_path / "cache")))


def test_phi3_long_context_rope_factors_become_longrope(tmp_path: Path,
                                                        tok_meta: dict[str, Any]) -> None:
    """Phi-3 128k / Phi-3.5 files carry rope_factors_long/short (llama.cpp's names for
    config.json's long_factor/short_factor): they become mlx-lm's longrope scaling."""
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg, hf = hf_model("phi3", vocab)
    rng = np.random.default_rng(5)
    long, short = (1 + rng.uniform(0, 8, HEAD_DIM // 2)).astype(np.float32), \
        (1 + rng.uniform(0, 1, HEAD_DIM // 2)).astype(np.float32)
    cfg.update(original_max_position_embeddings=1024, rope_scaling={
        "type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()})
    tensors = {**llama_cpp_tensors("phi3", hf), "rope_factors_long.weight": long,
               "rope_factors_short.weight": short}
    meta = {**gguf_metadata("phi3", cfg), "phi3.rope.scaling.original_context_length": 1024,
            **tok_meta}
    src = save_mlx_gguf(tmp_path / "phi3.gguf", tensors, meta)
    want = np.array(reference_model(cfg, hf)(mx.array([PROMPT * 4]))[0])
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.float32))
    assert lm.config["rope_scaling"]["type"] == "longrope"
    assert lm.config["original_max_position_embeddings"] == 1024
    np.testing.assert_allclose(np.array(lm.model(mx.array([PROMPT * 4]))[0]), want,
                               rtol=1e-4, atol=1e-4)


def test_quantized_moe_experts_load_as_quantized_switch_layers(tmp_path: Path,
                                                               tok_meta: dict[str, Any]) -> None:
    """qwen3moe with Q8_0 stacked experts and attention (llama.cpp's own quantizer): mlx-lm
    builds QuantizedSwitchLinear experts from the converted directory, and the logits equal
    mlx-lm's class on llama.cpp's dequantization of the same file."""
    import gguf as ggufpy
    from gguf import GGMLQuantizationType as T
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from tests.model.test_gguf_quants import written

    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg, hf = hf_model("qwen3moe", vocab)
    tensors = {n: (w, T.F32 if w.ndim == 1 or n == "blk.0.ffn_gate_inp.weight" else T.Q8_0)
               for n, w in llama_cpp_tensors("qwen3moe", hf).items()}
    meta = {k: v for k, v in {**gguf_metadata("qwen3moe", cfg), **tok_meta}.items()
            if k != "general.architecture"}
    src = written(tmp_path, tensors, meta, arch="qwen3moe")
    back = {t.name: ggufpy.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in ggufpy.GGUFReader(str(src)).tensors}
    ref_hf = {}
    for name in hf:
        (gname,) = llama_cpp_tensors("qwen3moe", {name: hf[name]})
        ref_hf[name] = back[gname].astype(np.float32)
    want = np.array(reference_model(cfg, ref_hf)(mx.array([PROMPT]))[0])
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.checkpoint))
    assert isinstance(lm.model.model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    got = np.array(lm.model(mx.array([PROMPT]))[0].astype(mx.float32))
    # float16 activations through the quantized matmuls: a tenth of this bound in practice
    assert np.abs(got - want).max() < 5e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
