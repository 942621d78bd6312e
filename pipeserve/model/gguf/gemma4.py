"""GGUF `gemma4` (Gemma 4's text model) onto mlx-lm's gemma4_text. llama.cpp's
Gemma4Model writes per-layer arrays where the Hugging Face config has one value and a rule:
the feed-forward width (doubled on the KV-shared layers: use_double_wide_mlp), the KV head
count (the global layers' own: num_global_key_value_heads) and the layer types (a sliding-window
flag per layer); key length and rotary count for the global layers apart from the sliding ones;
and the global layers' proportional rope as a `rope_freqs` tensor (1 on the rotated pairs, 1e30
on the others). Each is read back into the config only where it matches the rule exactly; what
mlx-lm's class cannot express is refused, naming the key. Its norms are stored as used (no
shift), layer_scalar as blk.N.layer_output_scale; the 26B A4B's experts as one fused gate/up
tensor (split in two, arch.FUSED), its router's scale as ffn_gate_inp.scale and the
per-expert scale as ffn_down_exps.scale. Pure data and dict building."""
from __future__ import annotations

from typing import Any

import numpy as np

from pipeserve.errors import ConfigError
from pipeserve.model.gguf.meta import meta_float, meta_int

BLOCKS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
          "post_norm": "post_per_layer_input_norm", "layer_output_scale": "layer_scalar",
          # the 26B A4B: experts beside the dense MLP, each with its own norms
          "ffn_gate_inp": "router.proj", "ffn_gate_inp.scale": "router.scale",
          "ffn_down_exps.scale": "router.per_expert_scale",
          "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",
          "ffn_down_exps": "experts.switch_glu.down_proj",
          "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
          "post_ffw_norm_1": "post_feedforward_layernorm_1",
          "post_ffw_norm_2": "post_feedforward_layernorm_2"}
BARE = ("layer_output_scale",)   # mlx-lm's layer_scalar is a bare array
GLOBALS = {"per_layer_token_embd": "model.embed_tokens_per_layer",
           "per_layer_model_proj": "model.per_layer_model_projection",
           "per_layer_proj_norm": "model.per_layer_projection_norm"}
# per-layer metadata arrays, read in full
ARRAYS = ("gemma4.feed_forward_length", "gemma4.attention.head_count_kv",
          "gemma4.attention.sliding_window_pattern")


def per_layer(meta: dict[str, Any], key: str, layers: int) -> list[int] | None:
    """A metadata value llama.cpp may write per layer: the list, or None for one scalar."""
    v = meta.get(key)
    if v is None:
        raise ConfigError(f"GGUF metadata lacks {key!r}")
    if np.ndim(v) == 0:
        return None
    out = [int(x) for x in np.asarray(v).tolist()]
    if len(out) != layers:
        raise ConfigError(f"GGUF {key} has {len(out)} values for {layers} layers")
    return out


def config(meta: dict[str, Any], a: str) -> dict[str, Any]:
    layers = meta_int(meta, f"{a}.block_count")
    shared = meta_int(meta, f"{a}.attention.shared_kv_layers", 0)
    sliding = per_layer(meta, f"{a}.attention.sliding_window_pattern", layers)
    if sliding is None:
        raise ConfigError(f"GGUF {a}.attention.sliding_window_pattern is one value; llama.cpp "
                          "writes one flag per layer")
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    head_swa = meta_int(meta, f"{a}.attention.key_length_swa")
    head_full = meta_int(meta, f"{a}.attention.key_length")
    for key, want in ((f"{a}.attention.value_length_swa", head_swa),
                      (f"{a}.attention.value_length", head_full)):
        if meta_int(meta, key, want) != want:
            raise ConfigError(f"GGUF {key}={meta[key]} differs from the key length {want}; "
                              "mlx-lm's gemma4_text has one head size per layer type")
    rot_swa = meta_int(meta, f"{a}.rope.dimension_count_swa", head_swa)
    if rot_swa != head_swa:
        raise ConfigError(f"GGUF {a}.rope.dimension_count_swa={rot_swa} is partial rotary on the "
                          f"sliding layers (head {head_swa}); mlx-lm rotates their whole head")
    if meta_int(meta, f"{a}.rope.dimension_count", head_full) != head_full:
        raise ConfigError(f"GGUF {a}.rope.dimension_count differs from the global head size "
                          f"{head_full}: the global layers' rotary is set by rope_freqs")
    cfg: dict[str, Any] = {
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": meta_int(meta, f"{a}.embedding_length"), "num_hidden_layers": layers,
        "num_attention_heads": meta_int(meta, f"{a}.attention.head_count"),
        "head_dim": head_swa, "global_head_dim": head_full, "layer_types": types,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": meta_int(meta, f"{a}.embedding_length_per_layer_input", 0),
        "sliding_window": meta_int(meta, f"{a}.attention.sliding_window"),
        "rms_norm_eps": meta_float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta_int(meta, f"{a}.context_length", 131072),
        "final_logit_softcapping": meta_float(meta, f"{a}.final_logit_softcapping", 30.0),
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "rope_parameters": {   # the global layers' rotary fraction comes from rope_freqs
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                               "rope_theta": meta_float(meta, f"{a}.rope.freq_base", 1e6)},
            "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 1.0,
                                  "rope_theta": meta_float(meta, f"{a}.rope.freq_base_swa",
                                                           10000.0)}}}
    cfg.update(_widths(meta, a, layers, shared), **_kv_heads(meta, a, types))
    if f"{a}.expert_count" in meta:   # the 26B A4B
        cfg.update(enable_moe_block=True, num_experts=meta_int(meta, f"{a}.expert_count"),
                   top_k_experts=meta_int(meta, f"{a}.expert_used_count"),
                   moe_intermediate_size=meta_int(meta, f"{a}.expert_feed_forward_length"))
    return cfg


def _widths(meta: dict[str, Any], a: str, layers: int, shared: int) -> dict[str, Any]:
    """intermediate_size and use_double_wide_mlp from the per-layer widths."""
    key = f"{a}.feed_forward_length"
    widths = per_layer(meta, key, layers)
    if widths is None:
        return {"intermediate_size": meta_int(meta, key), "use_double_wide_mlp": False}
    first = layers - shared
    base = widths[0]
    if widths == [base] * layers:
        return {"intermediate_size": base, "use_double_wide_mlp": False}
    if widths == [base] * first + [2 * base] * shared:
        return {"intermediate_size": base, "use_double_wide_mlp": True}
    raise ConfigError(f"GGUF {key} is {widths}: mlx-lm's gemma4_text takes one width, doubled "
                      f"on the {shared} KV-shared layers at most")


def _kv_heads(meta: dict[str, Any], a: str, types: list[str]) -> dict[str, Any]:
    key = f"{a}.attention.head_count_kv"
    heads = per_layer(meta, key, len(types))
    if heads is None:
        return {"num_key_value_heads": meta_int(meta, key)}
    swa = {h for h, t in zip(heads, types) if t == "sliding_attention"}
    full = {h for h, t in zip(heads, types) if t == "full_attention"}
    if len(swa) > 1 or len(full) > 1:
        raise ConfigError(f"GGUF {key} is {heads}: mlx-lm's gemma4_text takes one KV head count "
                          "per layer type")
    out = {"num_key_value_heads": next(iter(swa or full))}
    if full and full != swa:
        out["num_global_key_value_heads"] = next(iter(full))
    return out


def apply_tensors(cfg: dict[str, Any], freqs: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """What the tensors say of the config: the global layers' rotary fraction (`freqs`, the
    rope_freqs values), K used as V on global layers without attn_v, the per-layer vocabulary
    (`shapes`: every tensor's)."""
    half = cfg["global_head_dim"] // 2
    if freqs is None or freqs.shape != (half,):
        raise ConfigError(f"GGUF gemma4 lacks rope_freqs of {half} values (the global layers' "
                          "proportional rope)")
    rotated = int(np.sum(freqs == 1.0))
    if not (np.all(freqs[:rotated] == 1.0) and np.all(freqs[rotated:] >= 1e29)):
        raise ConfigError("GGUF gemma4 rope_freqs is not 1 on the rotated pairs then 1e30 "
                          "(proportional rope); other rope scalings are not converted")
    cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] = rotated / half
    first_shared = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    full = [i for i, t in enumerate(cfg["layer_types"][:first_shared]) if t == "full_attention"]
    no_v = [i for i in full if f"blk.{i}.attn_v.weight" not in shapes]
    if no_v and no_v != full:
        raise ConfigError(f"GGUF gemma4: global layers {no_v} have no attn_v and the others do; "
                          "mlx-lm's gemma4_text uses K as V on all global layers or none")
    cfg["attention_k_eq_v"] = bool(no_v)
    if "num_global_key_value_heads" in cfg and not no_v:
        raise ConfigError("GGUF gemma4: the global layers' KV head count differs from the "
                          "sliding layers' without K used as V; mlx-lm's gemma4_text takes the "
                          "global count only then")
    if "per_layer_token_embd.weight" in shapes:
        cfg["vocab_size_per_layer_input"] = int(shapes["per_layer_token_embd.weight"][0])
