"""The GGUF architectures pipeserve converts, each onto an mlx-lm model class: llama.cpp's tensor
names -> mlx-lm parameter names, its `<arch>.*` metadata -> config.json, and the conventions its
converter applied that the conversion undoes (llama's q/k row permutation, gemma's stored 1 + w
norms). Pure data and dict building; gguf.py calls it on the engine thread."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeserve.errors import ConfigError
from pipeserve.model.gguf import gemma4, hybrid
from pipeserve.model.gguf.meta import common, full_rotary, meta_float, meta_int

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ATTN = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
SUFFIXES = ("weight", "bias")


@dataclass(frozen=True)
class Arch:
    model_type: str                           # mlx-lm's module name (config.json model_type)
    blocks: dict[str, str]                    # blk.N.<gguf name> -> model.layers.N.<mlx-lm name>
    config: Callable[[dict[str, Any], str], dict[str, Any]]   # (metadata, arch key prefix) -> config
    permute_qk: bool = False                  # llama.cpp's LlamaModel.permute was applied to q/k
    norm_shift: float = 0.0                   # subtracted from every *norm weight (gemma: 1)
    scale_dtype: str = "float16"              # affine scales/biases (gemma: bfloat16, float16 overflows)
    bare: tuple[str, ...] = ()                # blocks whose mlx-lm parameter takes no suffix (sinks)
    mtp_key: str | None = None                # `<arch>.KEY`: MTP blocks appended after the layers
    notes: str = ""
    prefix: str = ""                          # before every mlx-lm name (qwen3_5: language_model.)
    # (mlx-lm name, array key, array, config) -> the array as mlx-lm holds it; and its shape
    undo: Callable[[str, str, Any, dict[str, Any]], Any] | None = None
    shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None
    extra_globals: dict[str, str] = field(default_factory=dict)   # beside GLOBAL_NAMES


def _llama(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a), a)
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **cfg,
            "mlp_bias": False, "hidden_act": "silu"}


def _qwen2(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a, 1e6), a)
    if cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ConfigError(f"GGUF qwen2 head dim {cfg['head_dim']} x {cfg['num_attention_heads']} "
                          f"heads != hidden {cfg['hidden_size']}; mlx-lm's qwen2 derives it")
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **cfg}


def _qwen3(meta: dict[str, Any], a: str) -> dict[str, Any]:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            **full_rotary(common(meta, a, 1e6), a)}


def _qwen3moe(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a, 1e6), a)
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **cfg,
            "num_experts": meta_int(meta, f"{a}.expert_count"),
            "num_experts_per_tok": meta_int(meta, f"{a}.expert_used_count"),
            "moe_intermediate_size": meta_int(meta, f"{a}.expert_feed_forward_length"),
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True}   # llama.cpp's qwen3moe graph always renormalizes the top k


def _gpt_oss(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a, 150000.0), a)
    layers = cfg["num_hidden_layers"]
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **cfg,
            "num_local_experts": meta_int(meta, f"{a}.expert_count"),
            "num_experts_per_tok": meta_int(meta, f"{a}.expert_used_count"),
            "intermediate_size": meta_int(meta, f"{a}.expert_feed_forward_length",
                                      cfg["intermediate_size"]),
            "sliding_window": meta_int(meta, f"{a}.attention.sliding_window", 128),
            # llama.cpp's gpt-oss graph: even layers attend in the window, odd ones globally
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)]}


def _glm4moe(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = common(meta, a)
    rope_dim = cfg.pop("_rope_dim")
    if "rope_scaling" in cfg:
        raise ConfigError(f"GGUF {a} with rope scaling: mlx-lm's glm4_moe rotates without it")
    gating = int(meta.get(f"{a}.expert_gating_func", 2))
    if gating != 2:
        raise ConfigError(f"GGUF {a}.expert_gating_func={gating}: mlx-lm's glm4_moe routes with "
                          "a sigmoid (2)")
    nextn = int(meta.get(f"{a}.nextn_predict_layers", 0))
    cfg["num_hidden_layers"] -= nextn   # the MTP blocks llama.cpp appends; mlx-lm drops them
    shared = meta_int(meta, f"{a}.expert_shared_count", 0)
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **cfg,
            "partial_rotary_factor": rope_dim / cfg["head_dim"],
            "moe_intermediate_size": meta_int(meta, f"{a}.expert_feed_forward_length"),
            "n_routed_experts": meta_int(meta, f"{a}.expert_count"),
            "num_experts_per_tok": meta_int(meta, f"{a}.expert_used_count"),
            "n_shared_experts": shared or None,
            "first_k_dense_replace": meta_int(meta, f"{a}.leading_dense_block_count", 0),
            "routed_scaling_factor": meta_float(meta, f"{a}.expert_weights_scale", 1.0),
            "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", True)),
            "n_group": meta_int(meta, f"{a}.expert_group_count", 1),
            "topk_group": meta_int(meta, f"{a}.expert_group_used_count", 1),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_scaling": None,
            "num_nextn_predict_layers": nextn}


def _deepseek2(meta: dict[str, Any], a: str) -> dict[str, Any]:
    """DeepSeek-V3 / R1 / Kimi-K2 (MLA attention, sigmoid-routed experts): llama.cpp writes the
    MLA head sizes as key/value_length_mla (older files: key/value_length)."""
    heads, rope = meta_int(meta, f"{a}.attention.head_count"), meta_int(meta, f"{a}.rope.dimension_count")
    if int(meta.get(f"{a}.expert_gating_func", 2)) != 2:
        raise ConfigError(f"GGUF {a} with softmax expert gating (DeepSeek-V2): only the sigmoid "
                          "gating of DeepSeek-V3 / R1 / Kimi-K2 converts (mlx-lm's deepseek_v3)")
    key = meta_int(meta, f"{a}.attention.key_length_mla", meta.get(f"{a}.attention.key_length"))
    value = meta_int(meta, f"{a}.attention.value_length_mla", meta.get(f"{a}.attention.value_length"))
    q_lora = meta.get(f"{a}.attention.q_lora_rank")
    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
           "hidden_size": meta_int(meta, f"{a}.embedding_length"),
           "num_hidden_layers": meta_int(meta, f"{a}.block_count") - int(
               meta.get(f"{a}.nextn_predict_layers", 0)),
           "intermediate_size": meta_int(meta, f"{a}.feed_forward_length"),
           "moe_intermediate_size": meta_int(meta, f"{a}.expert_feed_forward_length"),
           "num_attention_heads": heads, "num_key_value_heads": heads,
           "n_routed_experts": meta_int(meta, f"{a}.expert_count"),
           "n_shared_experts": meta_int(meta, f"{a}.expert_shared_count", 0) or None,
           "num_experts_per_tok": meta_int(meta, f"{a}.expert_used_count"),
           "routed_scaling_factor": meta_float(meta, f"{a}.expert_weights_scale", 1.0),
           "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", True)),
           "n_group": meta_int(meta, f"{a}.expert_group_count", 1),
           "topk_group": meta_int(meta, f"{a}.expert_group_used_count", 1),
           "first_k_dense_replace": meta_int(meta, f"{a}.leading_dense_block_count", 0),
           "kv_lora_rank": meta_int(meta, f"{a}.attention.kv_lora_rank"),
           "q_lora_rank": None if q_lora is None else int(q_lora),
           "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value,
           "rms_norm_eps": meta_float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
           "rope_theta": meta_float(meta, f"{a}.rope.freq_base", 10000.0),
           "max_position_embeddings": meta_int(meta, f"{a}.context_length", 4096),
           "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_scaling": None}
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling == "yarn":   # llama.cpp's yarn_log_multiplier is 0.1 * mscale_all_dim
        m = meta_float(meta, f"{a}.rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        cfg["rope_scaling"] = {
            "type": "yarn", "factor": meta_float(meta, f"{a}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": meta_int(
                meta, f"{a}.rope.scaling.original_context_length"),
            "mscale": m, "mscale_all_dim": m, "beta_fast": 32.0, "beta_slow": 1.0}
    elif scaling != "none":
        raise ConfigError(f"GGUF {a}.rope.scaling.type={scaling!r}; supported: none, yarn")
    return cfg


def _gemma2(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a), a)
    return {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **cfg,
            "attn_logit_softcapping": meta_float(meta, f"{a}.attn_logit_softcapping", 50.0),
            "final_logit_softcapping": meta_float(meta, f"{a}.final_logit_softcapping", 30.0),
            "query_pre_attn_scalar": _query_scalar(cfg)}


def _gemma3(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = full_rotary(common(meta, a, 1e6), a)
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **cfg,
            "query_pre_attn_scalar": _query_scalar(cfg),
            "sliding_window": meta_int(meta, f"{a}.attention.sliding_window", 512),
            # llama.cpp hard-codes both for gemma3: every 6th layer global, local rope base 10k
            "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}


def _query_scalar(cfg: dict[str, Any]) -> int:
    """llama.cpp's gemma attention scale: 1/sqrt(hidden/heads) for the 27B shape (62 or 46
    layers, hidden 5376 or 4608), else 1/sqrt(head_dim)."""
    if (cfg["num_hidden_layers"], cfg["hidden_size"]) in ((62, 5376), (46, 4608)):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["head_dim"])


def _phi3(meta: dict[str, Any], a: str) -> dict[str, Any]:
    cfg = common(meta, a)
    rope_dim = cfg.pop("_rope_dim")
    if cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ConfigError("GGUF phi3 head dim does not divide the hidden size as mlx-lm's phi3 needs")
    cfg.pop("head_dim")
    cfg["partial_rotary_factor"] = rope_dim / (cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["original_max_position_embeddings"] = meta_int(
        meta, f"{a}.rope.scaling.original_context_length", cfg["max_position_embeddings"])
    return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **cfg}


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", {**ATTN, **MLP, "ffn_norm": "post_attention_layernorm"}, _llama,
                  permute_qk=True, notes="Llama 1-3, Mistral 7B/Nemo (llama.cpp writes them as llama)"),
    "qwen2": Arch("qwen2", {**ATTN, **MLP, "ffn_norm": "post_attention_layernorm"}, _qwen2),
    "qwen3": Arch("qwen3", {**ATTN, **MLP, **QK_NORM, "ffn_norm": "post_attention_layernorm"},
                  _qwen3),
    "qwen3moe": Arch("qwen3_moe", {**ATTN, **QK_NORM, "ffn_norm": "post_attention_layernorm",
                                   "ffn_gate_inp": "mlp.gate",
                                   "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
                                   "ffn_up_exps": "mlp.switch_mlp.up_proj",
                                   "ffn_down_exps": "mlp.switch_mlp.down_proj"}, _qwen3moe),
    "gemma2": Arch("gemma2", {**ATTN, **MLP, "post_attention_norm": "post_attention_layernorm",
                              "ffn_norm": "pre_feedforward_layernorm",
                              "post_ffw_norm": "post_feedforward_layernorm"}, _gemma2,
                   norm_shift=1.0, scale_dtype="bfloat16", notes="mlx-lm's gemma2 attends globally on every layer "
                                         "(no 4096-token sliding window)"),
    "gemma3": Arch("gemma3_text", {**ATTN, **MLP, **QK_NORM,
                                   "post_attention_norm": "post_attention_layernorm",
                                   "ffn_norm": "pre_feedforward_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"}, _gemma3,
                   norm_shift=1.0, scale_dtype="bfloat16", notes="text only"),
    "phi3": Arch("phi3", {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
                          "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                          "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}, _phi3),
    "gpt-oss": Arch("gpt_oss", {**ATTN, "post_attention_norm": "post_attention_layernorm",
                                "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                                "ffn_gate_exps": "mlp.experts.gate_proj",
                                "ffn_up_exps": "mlp.experts.up_proj",
                                "ffn_down_exps": "mlp.experts.down_proj"}, _gpt_oss,
                    bare=("attn_sinks",), notes="experts usually MXFP4 (served in mxfp4 mode)"),
    "glm4moe": Arch("glm4_moe", {**ATTN, **MLP, **QK_NORM,
                                 "post_attention_norm": "post_attention_layernorm",
                                 "ffn_gate_inp": "mlp.gate",
                                 "exp_probs_b": "mlp.gate.e_score_correction_bias",
                                 "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
                                 "ffn_up_exps": "mlp.switch_mlp.up_proj",
                                 "ffn_down_exps": "mlp.switch_mlp.down_proj",
                                 "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                                 "ffn_up_shexp": "mlp.shared_experts.up_proj",
                                 "ffn_down_shexp": "mlp.shared_experts.down_proj"}, _glm4moe,
                    bare=("exp_probs_b",), mtp_key="nextn_predict_layers",
                    notes="GLM-4.5 / 4.6 / 4.7 (its MTP block is dropped, as mlx-lm does)"),
    "deepseek2": Arch("deepseek_v3", {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.embed_q", "attn_v_b": "self_attn.unembed_out",
        "attn_output": "self_attn.o_proj", **MLP, "ffn_gate_inp": "mlp.gate",
        "exp_probs_b": "mlp.gate.e_score_correction_bias",
        "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
        "ffn_down_exps": "mlp.switch_mlp.down_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj"}, _deepseek2,
        bare=("exp_probs_b",), mtp_key="nextn_predict_layers",
        notes="DeepSeek-V3 / R1, Kimi-K2 (MLA; the MTP block dropped)"),
    "qwen35": Arch("qwen3_5", {**ATTN, **MLP, **QK_NORM, **hybrid.LINEAR,
                               "post_attention_norm": "post_attention_layernorm"}, hybrid.config,
                   bare=hybrid.BARE, mtp_key="nextn_predict_layers", prefix=hybrid.PREFIX,
                   undo=hybrid.undo, shape=hybrid.converted_shape,
                   notes="Qwen3.5 / 3.6 dense: gated-delta linear attention (its MTP block "
                         "dropped)"),
    "qwen35moe": Arch("qwen3_5_moe", {**ATTN, **QK_NORM, **hybrid.LINEAR, **hybrid.EXPERTS,
                                      "post_attention_norm": "post_attention_layernorm"},
                      hybrid.config, bare=hybrid.BARE, mtp_key="nextn_predict_layers",
                      prefix=hybrid.PREFIX, undo=hybrid.undo, shape=hybrid.converted_shape,
                      notes="Qwen3.5 / 3.6 MoE (shared expert; its MTP block dropped)"),
    "gemma4": Arch("gemma4_text", gemma4.BLOCKS, gemma4.config, scale_dtype="bfloat16",
                   bare=gemma4.BARE, extra_globals=gemma4.GLOBALS,
                   notes="Gemma 4 text: E2B / E4B (per-layer embeddings, KV-shared layers), "
                         "26B A4B (experts beside the dense MLP), 31B"),
}
ALIASES = {"mistral": "llama"}   # transformers' name for what llama.cpp writes as llama


def lookup(arch: str | None) -> Arch | None:
    return ARCHS.get(ALIASES.get(arch or "", arch or ""))


def map_name(arch: Arch, name: str) -> str | None:
    """GGUF tensor name -> mlx-lm parameter name, or None when the model has no place for it."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias|scale))?", name)
    if m:
        i, part, suffix = m.groups()
        if suffix == "scale":   # a scale vector beside a matrix (gemma4's router)
            named = arch.blocks.get(f"{part}.scale")
            return f"{arch.prefix}model.layers.{i}.{named}" if named else None
        if part in arch.bare:
            return f"{arch.prefix}model.layers.{i}.{arch.blocks[part]}"
        if suffix and part in arch.blocks:
            return f"{arch.prefix}model.layers.{i}.{arch.blocks[part]}.{suffix}"
        return None
    base, _, suffix = name.rpartition(".")
    names = {**GLOBAL_NAMES, **arch.extra_globals}
    if suffix in SUFFIXES and base in names:
        return f"{arch.prefix}{names[base]}.{suffix}"
    return None


# fused experts split along their rows into two modules, as mlx-lm's sanitize splits them
# (gemma4's gate/up; phi3's dense mlp.gate_up_proj stays fused: mlx-lm's phi3 holds it so)
FUSED = {"switch_glu.gate_up_proj": ("switch_glu.gate_proj", "switch_glu.up_proj")}


def placed(target: str, arrays: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """mlx-lm name -> array for one converted tensor: its arrays (suffix -> array) under the
    target's module when quantized, else the target itself; fused experts split in two."""
    base = target.rpartition(".")[0]
    out = {(f"{base}.{suffix}" if quantized else target): a for suffix, a in arrays.items()}
    fused = next((f for f in FUSED if base.endswith("." + f)), None)
    if fused is None:
        return out
    split = {}
    for name, a in out.items():
        half = a.shape[-2] // 2
        for part, piece in zip(FUSED[fused], (a[..., :half, :], a[..., half:, :])):
            split[name.replace(f".{fused}.", f".{part}.")] = piece
    return split


def dropped(arch: Arch, meta: dict[str, Any], name: str) -> bool:
    """A tensor of an MTP block appended after the model's layers (GLM's nextn): not served."""
    if arch.mtp_key is None:
        return False
    a = meta["general.architecture"]
    m = re.match(r"blk\.(\d+)\.", name)
    first = int(meta[f"{a}.block_count"]) - int(meta.get(f"{a}.{arch.mtp_key}", 0))
    return m is not None and int(m.group(1)) >= first


# Tensors that hold configuration, not weights: read into config.json, not written.
CONFIG_TENSORS = {"llama": ("rope_freqs.weight",), "gemma4_text": ("rope_freqs.weight",),
                  "phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
# Llama 3.x's rope scaling as its config.json states it; llama.cpp stores only the per-frequency
# factors it implies (rope_freqs), so the conversion finds the setting that reproduces them.
LLAMA3_ROPE = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},)


def llama3_factors(base: float, dim: int, factor: float, low: float, high: float,
                   old_len: int) -> Any:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for rope_type llama3."""
    import math

    import numpy as np
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def rope_from_freqs(cfg: dict[str, Any], freqs: Any) -> dict[str, Any]:
    """The llama3 `rope_scaling` whose factors equal the file's rope_freqs, or a refusal."""
    import numpy as np
    factor = float(freqs.max())
    for known in LLAMA3_ROPE:
        want = llama3_factors(cfg["rope_theta"], cfg["head_dim"], factor, known["low_freq_factor"],
                              known["high_freq_factor"], known["original_max_position_embeddings"])
        if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-5, atol=1e-6):
            return {"rope_type": "llama3", "factor": float(np.float32(factor)), **known}
    raise ConfigError(f"GGUF rope_freqs ({freqs.shape[0]} factors, max {factor:g}) match no "
                      "Llama 3 rope scaling (low 1, high 4, original context 8192)")


def apply_config_tensors(cfg: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Fold CONFIG_TENSORS (name -> float32 values) into config.json: Llama 3's rope_freqs as
    its llama3 rope_scaling, Phi-3's long-context rope factors as its longrope one."""
    if "rope_freqs.weight" in tensors:
        cfg["rope_scaling"] = rope_from_freqs(cfg, tensors["rope_freqs.weight"])
    if "rope_factors_long.weight" in tensors:
        long = tensors["rope_factors_long.weight"]
        short = tensors.get("rope_factors_short.weight", long)
        cfg["rope_scaling"] = {"type": "longrope", "long_factor": [float(v) for v in long],
                               "short_factor": [float(v) for v in short]}


def model_config(arch_name: str, meta: dict[str, Any], vocab_rows: int, tied: bool,
                 has_bias: bool, has_qk_norm: bool = False) -> dict[str, Any]:
    arch = lookup(arch_name)
    assert arch is not None
    cfg = arch.config(meta, arch_name)
    cfg.update(vocab_size=vocab_rows, tie_word_embeddings=tied)
    if arch.model_type in ("llama", "glm4_moe"):
        cfg["attention_bias"] = has_bias
    if arch.model_type == "glm4_moe":
        cfg["use_qk_norm"] = has_qk_norm
    return cfg
