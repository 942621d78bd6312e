"""GGUF `qwen35` / `qwen35moe` (Qwen3.5, 3.6): gated-delta linear attention layers between gated
full attention layers, onto mlx-lm's qwen3_5 / qwen3_5_moe classes. llama.cpp's converter stored
A_log as -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed to (channels, kernel), and — when
there are fewer key heads than value heads — the value heads in tiled order (K0, K1, .., K0, K1)
instead of grouped by key head, along the rows of qkv's V part, z, alpha, beta, A, dt and conv1d
and the columns of ssm_out; each is undone here. Its zero-centred norms were stored plus one,
which is how mlx-lm keeps them. Pure data and array reshuffles (called on the engine thread)."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import ConfigError
from pipeserve.model.gguf.meta import common, meta_int

PREFIX = "language_model."   # mlx-lm's qwen3_5 holds the text model under language_model
GROUP = 32                   # quantized columns move in whole groups of this many values
LINEAR = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
          "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
          "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias",
          "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
          "ssm_out": "linear_attn.out_proj"}
BARE = ("ssm_a", "ssm_dt")   # mlx-lm parameters without a .weight / .bias suffix
EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
           "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
           "ffn_down_exps": "mlp.switch_mlp.down_proj",
           "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
           "ffn_up_shexp": "mlp.shared_expert.up_proj",
           "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def config(meta: dict[str, Any], a: str) -> dict[str, Any]:
    """config.json of a `qwen35` / `qwen35moe` file (flat: mlx-lm reads it as the text config)."""
    cfg = common(meta, a, 1e7)
    rope_dim = cfg.pop("_rope_dim")
    if cfg.pop("rope_scaling", None) is not None:
        raise ConfigError(f"GGUF {a} with rope scaling: mlx-lm's qwen3_5 rotates without it")
    theta = cfg.pop("rope_theta")
    v_heads = meta_int(meta, f"{a}.ssm.time_step_rank")
    cfg["num_hidden_layers"] -= int(meta.get(f"{a}.nextn_predict_layers", 0))   # MTP dropped
    out = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"], **cfg,
           "linear_num_key_heads": meta_int(meta, f"{a}.ssm.group_count"),
           "linear_num_value_heads": v_heads,
           "linear_key_head_dim": meta_int(meta, f"{a}.ssm.state_size"),
           "linear_value_head_dim": meta_int(meta, f"{a}.ssm.inner_size") // v_heads,
           "linear_conv_kernel_dim": meta_int(meta, f"{a}.ssm.conv_kernel"),
           "full_attention_interval": meta_int(meta, f"{a}.full_attention_interval", 4),
           "rope_parameters": {"type": "default", "rope_theta": theta,
                               "partial_rotary_factor": rope_dim / cfg["head_dim"]}}
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ConfigError(f"GGUF {a}: {v_heads} value heads are not a multiple of "
                          f"{out['linear_num_key_heads']} key heads")
    if a == "qwen35moe":
        out.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForCausalLM"],
                   num_experts=meta_int(meta, f"{a}.expert_count"),
                   num_experts_per_tok=meta_int(meta, f"{a}.expert_used_count"),
                   moe_intermediate_size=meta_int(meta, f"{a}.expert_feed_forward_length"),
                   shared_expert_intermediate_size=meta_int(
                       meta, f"{a}.expert_shared_feed_forward_length"),
                   norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
                   decoder_sparse_step=1)
    return out


def converted_shape(target: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape mlx-lm holds a tensor in, where it differs from the file's."""
    if target.endswith("linear_attn.conv1d.weight"):
        return (*shape, 1)                  # (channels, kernel) -> mlx-lm's (C, kernel, 1)
    if target.endswith("shared_expert_gate.weight") and len(shape) == 1:
        return (1, *shape)
    return shape


def _grouped(x: Any, axis: int, k: int, r: int) -> Any:
    """The value heads along `axis` from tiled order (r blocks of k heads) back to grouped
    (k blocks of r heads); each head a contiguous run of x.shape[axis] // (k * r) entries."""
    shape = x.shape
    axis %= len(shape)
    d = shape[axis] // (k * r)
    x = x.reshape(*shape[:axis], r, k, d, *shape[axis + 1:])
    return x.swapaxes(axis, axis + 1).reshape(shape)


def undo(target: str, key: str, x: Any, cfg: dict[str, Any]) -> Any:
    """One converted array of `target` (key: weight, scales or biases) as mlx-lm's checkpoint
    holds it: the converter's reorderings and reparametrizations reversed."""
    import mlx.core as mx

    if ".linear_attn." not in target:
        return x.reshape(converted_shape(target, x.shape)) if key == "weight" else x
    k, v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    r = v // k
    part = target.removeprefix(PREFIX).split(".linear_attn.")[1]
    if r > 1:
        x = _reorder(part, x, k, r, cfg, quantized=key != "weight" or x.dtype == mx.uint32)
    if part == "A_log":
        return mx.log(-x.astype(mx.float32))
    if part == "conv1d.weight":
        return x.reshape(*x.shape, 1)
    return x


def _reorder(part: str, x: Any, k: int, r: int, cfg: dict[str, Any], quantized: bool) -> Any:
    """Undo the tiled value-head order of one linear-attention array."""
    import mlx.core as mx

    if part in ("in_proj_qkv.weight", "conv1d.weight"):   # rows: q, k, then the value heads
        qk = 2 * k * cfg["linear_key_head_dim"]
        return mx.concatenate([x[:qk], _grouped(x[qk:], 0, k, r)], axis=0)
    if part in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return _grouped(x, 0, k, r)
    if part == "out_proj.weight":   # columns: whole groups move with their values
        if quantized and cfg["linear_value_head_dim"] % GROUP:
            raise ConfigError(f"a quantized ssm_out with value heads of "
                              f"{cfg['linear_value_head_dim']} values cannot be reordered in "
                              f"{GROUP}-value groups; use a file with ssm_out in F16/BF16/F32")
        return _grouped(x, -1, k, r)
    return x
