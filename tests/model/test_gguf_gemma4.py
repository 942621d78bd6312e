"""GGUF `gemma4` (Gemma 4's text model): a random Gemma 4 in three shapes — E2B's (per-layer
embeddings, KV-shared layers with double-wide MLPs, sliding and global layers with their own
head sizes and a proportional rope on a quarter of the global head), 31B's (no per-layer
inputs, K used as V on the global layers, with their own KV head count) and 26B A4B's (31B's
with routed experts beside the dense MLP) — written as llama.cpp's Gemma4Model writes it (its
tensor names, per-layer arrays for the widths, KV heads and layer types, rope_freqs,
layer_output_scale, the experts' gate and up fused, the router's scale and per-expert scale as
`.scale` tensors, Q8_0 matrices) with a `gemma4` BPE tokenizer, converts onto mlx-lm's
gemma4_text: a float32 file's logits equal mlx-lm's class on the original weights exactly; on
the Q8_0 file the engine decodes greedily the tokens mlx_lm gives on the converted checkpoint,
with the memory `pipeserve fit` reads from the header; the tokenizer encodes as the one it was
written from; per-layer widths and a rope the class cannot express are refused naming them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf as ggufpy
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.errors import ConfigError
from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.model.gguf import convert as gguf
from pipeserve.model.loader import load
from tests.model.gguf_served import converted, served_equals_mlx_lm
from tests.model.test_gguf_quants import written

PROMPT = [5, 17, 260, 3, 99, 300, 12, 7]   # within the tokenizer's 397 ids
SHAPES = {   # gemma4_text configs, as Hugging Face's text_config has them
    "e2b": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
            "num_key_value_heads": 2, "use_double_wide_mlp": True},
    "31b": {"num_hidden_layers": 3, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
            "num_key_value_heads": 2, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "use_double_wide_mlp": False},
    "26b_a4b": {"num_hidden_layers": 3, "num_kv_shared_layers": 0,
                "hidden_size_per_layer_input": 0, "num_key_value_heads": 2,
                "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                "use_double_wide_mlp": False, "enable_moe_block": True, "num_experts": 4,
                "top_k_experts": 2, "moe_intermediate_size": 32},
}
TEXTS = ["Hello world, hello  worlds!", "héllo wörld 日本語 \n\t tabs",
         "<|turn>user\nhi<turn|>", "  leading spaces and trailing  ", "the\n\nlazy\n\n\n dog\n"]


def gemma4_tokenizer() -> tuple[Any, dict[str, Any]]:
    """A Gemma-style BPE (spaces as U+2581, split only at newline runs, merges over raw
    characters, <0xXX> byte tokens, newline runs that are tokens without a merge, as Gemma 4's
    are) trained on a few lines, and its metadata as llama.cpp writes a `gemma4` vocabulary."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, trainers)

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = Tokenizer(models.BPE())
    trainer.normalizer = normalizers.Replace(" ", "\u2581")
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "hello world, hello worlds",
              "a model that serves text and tells stories about trains and weather"] * 4
    trainer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    learned = json.loads(trainer.to_str())["model"]
    tokens = special + byte_tokens + [t for t, _ in sorted(learned["vocab"].items(),
                                                            key=lambda kv: kv[1])] + ["\n", "\n\n"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                               [tuple(m.split(" ")) for m in merges], byte_fallback=True,
                               unk_token="<unk>", fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    types = [3] * len(special) + [6] * 256 + [1] * (len(tokens) - len(special) - 256)
    meta = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}
    return tok, meta


def text_config(shape: str, vocab: int) -> dict[str, Any]:
    layers = SHAPES[shape]["num_hidden_layers"]
    return {"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32, "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab, "sliding_window": 32, "rms_norm_eps": 1e-6,
            "layer_types": (["sliding_attention", "full_attention"] * 2)[:layers - 1]
            + ["full_attention"], "max_position_embeddings": 4096,
            "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                      "rope_type": "default"}},
            **SHAPES[shape]}


def reference(cfg: dict[str, Any], weights: dict[str, np.ndarray] | None = None) -> Any:
    from mlx_lm.models import gemma4_text
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    if weights is not None:
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def random_weights(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every parameter of mlx-lm's class, random: norms and layer scalars near 1."""
    from mlx.utils import tree_flatten
    rng = np.random.default_rng(4)
    out = {}
    for name, p in tree_flatten(reference(cfg).parameters()):
        shape = tuple(p.shape)
        if len(shape) == 1:
            out[name] = 1 + 0.1 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return {k: v.astype(np.float32) for k, v in out.items()}


def metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma4Model.set_gguf_parameters writes for `cfg`."""
    a, layers, shared = "gemma4", cfg["num_hidden_layers"], cfg["num_kv_shared_layers"]
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    meta: dict[str, Any] = {
        f"{a}.context_length": 4096, f"{a}.embedding_length": 64, f"{a}.block_count": layers,
        f"{a}.feed_forward_length": cfg["intermediate_size"], f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": cfg["num_key_value_heads"],
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.attention.key_length": 32,
        f"{a}.attention.value_length": 32, f"{a}.attention.key_length_swa": 16,
        f"{a}.attention.value_length_swa": 16, f"{a}.rope.freq_base": 1000000.0,
        f"{a}.rope.freq_base_swa": 10000.0, f"{a}.final_logit_softcapping": 30.0,
        f"{a}.attention.sliding_window": 32, f"{a}.attention.shared_kv_layers": shared,
        f"{a}.embedding_length_per_layer_input": cfg["hidden_size_per_layer_input"],
        f"{a}.attention.sliding_window_pattern": swa, f"{a}.rope.dimension_count": 32,
        f"{a}.rope.dimension_count_swa": 16, "general.name": "tiny-gemma4"}
    if cfg["use_double_wide_mlp"]:
        n = cfg["intermediate_size"]
        meta[f"{a}.feed_forward_length"] = [n if i < layers - shared else 2 * n
                                            for i in range(layers)]
    if cfg.get("enable_moe_block"):
        meta.update({f"{a}.expert_count": cfg["num_experts"],
                     f"{a}.expert_used_count": cfg["top_k_experts"],
                     f"{a}.expert_feed_forward_length": cfg["moe_intermediate_size"]})
    if "num_global_key_value_heads" in cfg:
        meta[f"{a}.attention.head_count_kv"] = [
            cfg["num_key_value_heads"] if s else cfg["num_global_key_value_heads"] for s in swa]
    return meta


def gguf_tensors(weights: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, T]]:
    """llama.cpp's names (the gguf package's own map) and types: Q8_0 matrices (rows of 32s),
    F32 the rest;
    rope_freqs for the proportional rope on 8 of the global head's 16 rotary pairs."""
    names = ggufpy.get_tensor_name_map(ggufpy.MODEL_ARCH.GEMMA4, 8)
    out = {}
    weights = dict(weights)
    for name in [n for n in weights if n.endswith("experts.switch_glu.gate_proj.weight")]:
        # Hugging Face's fused experts.gate_up_proj (gate rows first), as the converter reads it
        layer = name.removesuffix("switch_glu.gate_proj.weight")
        up = weights.pop(layer + "switch_glu.up_proj.weight")
        weights[layer + "gate_up_proj.weight"] = np.concatenate([weights.pop(name), up], axis=1)
        weights[layer + "down_proj.weight"] = weights.pop(layer + "switch_glu.down_proj.weight")
    for name in [n for n in weights if n.endswith(("router.scale", "router.per_expert_scale"))]:
        i = name.split(".")[2]   # llama.cpp's names for these two
        gname = f"blk.{i}.ffn_gate_inp.scale" if name.endswith("router.scale") \
            else f"blk.{i}.ffn_down_exps.scale"
        out[gname] = (weights.pop(name), T.F32)
    for name, x in weights.items():
        gname = names.get_name(name if name.endswith(".weight") else name + ".weight",
                               try_suffixes=(".weight",))
        assert gname is not None, name
        qtype = (T.Q8_0 if x.ndim == 2 and x.shape[-1] % 32 == 0
                 and "per_layer_token_embd" not in gname else T.F32)
        out[gname] = (x, qtype)
    out["rope_freqs.weight"] = (np.array([1.0] * 4 + [1e30] * 12, np.float32), T.F32)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemma4_gguf_serves_like_mlx_lm(tmp_path: Path, engine_factory: Any, shape: str) -> None:
    tok, tok_meta = gemma4_tokenizer()
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg = text_config(shape, vocab)
    weights = random_weights(cfg)
    meta = {**metadata(cfg), **tok_meta}
    # float32: the mapping alone, logits equal to mlx-lm's class on the original weights
    exact = tmp_path / "f32"
    exact.mkdir()
    src = written(exact, {k: (v, T.F32) for k, (v, _) in gguf_tensors(weights).items()}, meta,
                  arch="gemma4")
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.checkpoint))
    got = json.loads((lm.path / "config.json").read_text())
    for key in ("layer_types", "num_kv_shared_layers", "hidden_size_per_layer_input",
                "num_key_value_heads", "use_double_wide_mlp", "intermediate_size"):
        assert got[key] == cfg[key], key
    assert got["attention_k_eq_v"] == cfg.get("attention_k_eq_v", False)
    assert got["rope_parameters"] == cfg["rope_parameters"]
    ids = [(7 * i + 3) % vocab for i in range(12)] + PROMPT
    np.testing.assert_array_equal(np.array(lm.model(mx.array([ids]))[0]),
                                  np.array(reference(cfg, weights)(mx.array([ids]))[0]))
    # Q8_0 matrices (as llama.cpp's files hold them): served as mlx-lm serves the conversion
    src = written(tmp_path, gguf_tensors(weights), meta, arch="gemma4")
    args, fit, lm = converted(tmp_path, src)   # the header's fit, then the conversion
    assert json.loads((lm.path / "config.json").read_text())["quantization"]["bits"] == 8
    engine, _ = served_equals_mlx_lm(engine_factory, lm.path, PROMPT, *args)
    assert engine.engine.memory == fit.memory
    if shape != "e2b":
        return
    from transformers import PreTrainedTokenizerFast
    rebuilt = PreTrainedTokenizerFast.from_pretrained(str(lm.path))
    for text in TEXTS:   # BOS first (add_bos_token), then the original tokenizer's ids
        assert rebuilt.encode(text) == [2] + tok.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text)[1:]) == text
    # llama.cpp's gemma4 split: a newline run that is a token stays whole (no merge makes it);
    # one that is not falls back to merges, here to single newlines
    nl, nl2 = (tok_meta["tokenizer.ggml.tokens"].index(t) for t in ("\n", "\n\n"))
    ids = rebuilt.encode("the\n\nlazy\n\n\ndog", add_special_tokens=False)
    assert ids.count(nl2) == 1 and ids.count(nl) == 3


def test_gemma4_gguf_refusals(tmp_path: Path) -> None:
    """Per-layer widths mlx-lm's class cannot take and a rope_freqs that is not the
    proportional rope are refused, naming what was found."""
    _, tok_meta = gemma4_tokenizer()
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    cfg = text_config("31b", vocab)
    tensors = gguf_tensors(random_weights(cfg))
    meta = {**metadata(cfg), **tok_meta, "gemma4.feed_forward_length": [128, 256, 128]}
    src = written(tmp_path, tensors, meta, arch="gemma4")
    with pytest.raises(ConfigError, match=r"feed_forward_length is \[128, 256, 128\]: mlx-lm's "
                                          r"gemma4_text takes one width"):
        gguf.model_config(src, gguf.read_header(src, gguf.ARRAYS))
    tensors["rope_freqs.weight"] = (np.array([1.0] * 4 + [2.0] * 12, np.float32), T.F32)
    (tmp_path / "model.gguf").unlink()
    src = written(tmp_path, tensors, {**metadata(cfg), **tok_meta}, arch="gemma4")
    with pytest.raises(ConfigError, match="rope_freqs is not 1 on the rotated pairs"):
        gguf.model_config(src, gguf.read_header(src, gguf.ARRAYS))
