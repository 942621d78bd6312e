"""GGUF -> an mlx-lm model directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json), converted once into the
model cache and keyed by the file's fingerprint; loader.py then loads it like any checkpoint.

`mx.load` reads the tensors (Q4_0/Q4_1/Q8_0 arrive as MLX affine quantized weight/scales/biases
with group 32, F16/F32 as arrays); the header is scanned here first, so unsupported files are
refused with what was found before any tensor is read. Runs on the engine thread."""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import re
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.model_cache import cache_root, publish

log = logging.getLogger(__name__)

FORMAT_VERSION = 1     # bump when the converted directory's contents change
GROUP_SIZE = 32        # the block size of every GGUF type MLX maps to affine quantization
ARCHS = ("llama",)
TOKENIZER_MODELS = ("gpt2",)
# ggml tensor types by id (ggml.h); only SUPPORTED_TYPES load exactly (MLX dequantizes the
# k-quants to float16 by itself, which is a different model than the file, so they are refused).
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
              22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
              29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")

# Pre-tokenizers (llama.cpp's names in `tokenizer.ggml.pre`); gpt-2's split is ByteLevel's own regex.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "llama-bpe")

# GGUF tensor name -> mlx-lm llama parameter name (blk.N. prefixes handled in _map_name).
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
SUFFIXES = ("weight", "scales", "biases", "bias")


# -- the header ---------------------------------------------------------------------------
@dataclass
class Header:
    metadata: dict[str, Any]        # scalar and string values; arrays only as their length
    tensors: dict[str, tuple[str, tuple[int, ...], int]]  # name -> (type, numpy shape, offset)
    data_offset: int                # where tensor data starts (offsets are relative to it)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


def read_header(path: Path) -> Header:
    """Scan the GGUF header: metadata scalars and strings, tensor names, types and shapes. Arrays
    are skipped (mx.load reads them); a 49k-token vocabulary takes ~50 ms."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ConfigError(f"model.path '{path}' is not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ConfigError(f"model.path '{path}': GGUF version {version}; supported: 2, 3")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if etype == 8:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, pos)
                        pos += 8 + n
                elif etype in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[etype])
                else:
                    raise ConfigError(f"model.path '{path}': nested GGUF arrays are not supported")
                return count
            (v,) = struct.unpack_from(_SCALARS[vtype], buf, pos)
            pos += struct.calcsize(_SCALARS[vtype])
            return v

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            metadata[key] = value(vtype)
        tensors = {}
        for _ in range(n_tensors):
            name = string()
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            tensors[name] = (GGML_TYPES.get(ttype, f"type {ttype}"), tuple(reversed(dims)), offset)
        align = int(metadata.get("general.alignment", 32))
        return Header(metadata, tensors, -(-pos // align) * align)


def fingerprint(path: Path, header: Header) -> str:
    """What names a conversion in the cache: the file's size and mtime and a hash of its header
    (every metadata value, tensor name, type, shape and offset), plus FORMAT_VERSION. Hashing
    the header instead of all the bytes keeps a multi-GB file's launch instant; an edit that kept
    size, mtime and header would go unnoticed."""
    st = path.stat()
    data_offset = header.data_offset
    h = hashlib.sha256(f"v{FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(data_offset))
    return h.hexdigest()[:16]


# -- what is supported --------------------------------------------------------------------
def check_supported(path: Path, header: Header) -> None:
    """Refuse, naming what was found and what is supported, anything the conversion cannot map."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"model.path '{path}': GGUF architecture {arch!r} is not supported; "
                          f"supported: {', '.join(ARCHS)}")
    tok_model = meta.get("tokenizer.ggml.model")
    if tok_model not in TOKENIZER_MODELS:
        raise ConfigError(f"model.path '{path}': GGUF tokenizer model {tok_model!r} is not "
                          f"supported; supported: {', '.join(TOKENIZER_MODELS)} (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"model.path '{path}': GGUF pre-tokenizer {pre!r} is not supported; "
                          f"supported: {', '.join(PRE_TOKENIZERS)}")
    bad = {name: t for name, (t, _, _) in header.tensors.items() if t not in SUPPORTED_TYPES}
    if bad:
        types = Counter(bad.values())
        first = next(iter(bad))
        raise ConfigError(
            f"model.path '{path}': tensor type {', '.join(sorted(types))} is not supported "
            f"({len(bad)} tensors, e.g. {first} is {bad[first]}); supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Use a Q4_0/Q4_1/Q8_0 or F16 file of this model")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(f"model.path '{path}': rope scaling {scaling!r} is not supported; "
                          "supported: none, linear")
    for name in header.tensors:
        if _map_name(name) is None:
            raise ConfigError(f"model.path '{path}': tensor {name!r} has no place in an mlx-lm "
                              f"{arch} model (supported names: token_embd, output_norm, output, "
                              f"blk.N.{{{', '.join(BLOCK_NAMES)}}})")


def _map_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if suffix not in SUFFIXES:
        return None
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{suffix}"
    return None


# -- the model ----------------------------------------------------------------------------
def _int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise ConfigError(f"GGUF metadata lacks {key!r}")
    return int(v.item() if hasattr(v, "item") else v)


def _float(meta: dict[str, Any], key: str, default: float) -> float:
    """GGUF floats are float32: the shortest decimal of that float32 (1e-05, not 9.99999974e-06)."""
    import numpy as np
    v = meta.get(key, default)
    return float(str(np.float32(v.item() if hasattr(v, "item") else v)))


def model_config(meta: dict[str, Any], vocab_rows: int, tied: bool, has_bias: bool) -> dict[str, Any]:
    """config.json of the mlx-lm llama model the `llama.*` keys describe."""
    a = "llama"
    heads = _int(meta, f"{a}.attention.head_count")
    hidden = _int(meta, f"{a}.embedding_length")
    head_dim = _int(meta, f"{a}.attention.key_length", hidden // heads)
    rope_dim = _int(meta, f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError(f"GGUF {a}.rope.dimension_count={rope_dim} is partial rotary (head dim "
                          f"{head_dim}); the llama model supports only full rotary")
    cfg: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": _int(meta, f"{a}.block_count"),
        "intermediate_size": _int(meta, f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(meta, f"{a}.rope.freq_base", 10000.0),
        "max_position_embeddings": _int(meta, f"{a}.context_length", 4096),
        "vocab_size": vocab_rows, "tie_word_embeddings": tied,
        "attention_bias": has_bias, "mlp_bias": False, "hidden_act": "silu",
    }
    if meta.get(f"{a}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear",
                               "factor": _float(meta, f"{a}.rope.scaling.factor", 1.0)}
    return cfg


def _unpermute(x: Any, n_heads: int) -> Any:
    """Undo llama.cpp's HF->GGUF `permute` of q/k rows (each head's rotary halves interleaved).
    Rows only, so it applies alike to float weights and to quantized weight/scales/biases."""
    half = x.shape[0] // n_heads // 2
    return x.reshape(n_heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _weights(path: Path, header: Header, raw: dict[str, Any],
             cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm parameter name -> array, and the mlx-lm `quantization` entry (or {})."""
    import mlx.core as mx
    import numpy as np

    out: dict[str, Any] = {}
    for name, arr in raw.items():
        # mx.load names a quantized tensor's parts `<base>.weight`, `<base>.scales`, `<base>.biases`
        if header.tensors.get(name, ("",))[0] == "BF16":  # mx.load narrows BF16 to float16
            _, shape, offset = header.tensors[name]
            bits = np.fromfile(path, dtype=np.uint16, count=int(np.prod(shape)),
                               offset=header.data_offset + offset).reshape(shape)
            arr = mx.array(bits).view(mx.bfloat16)
        out[_map_name(name)] = arr
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for key in list(out):
        if ".self_attn.q_proj." in key:
            out[key] = _unpermute(out[key], heads)
        elif ".self_attn.k_proj." in key:
            out[key] = _unpermute(out[key], kv_heads)
    bits: dict[str, int] = {}
    for key, scales in out.items():
        if key.endswith(".scales"):
            base = key.removesuffix(".scales")
            bits[base] = out[f"{base}.weight"].shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    if not bits:
        return out, {}
    default = Counter(bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for base, b in sorted(bits.items()):
        if b != default:
            quant[base] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return out, quant


# -- the tokenizer ------------------------------------------------------------------------
def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The byte-level BPE `tokenizers.Tokenizer` of a `gpt2`-model GGUF: vocabulary, merges,
    the pre-tokenizer `tokenizer.ggml.pre` names, control tokens as special added tokens,
    user-defined ones as added tokens, and BOS prepended when `add_bos_token` says so."""
    import numpy as np
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ConfigError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":   # digits one by one, then GPT-2's byte-level split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "llama-bpe":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = np.array(meta["tokenizer.ggml.token_type"]) if "tokenizer.ggml.token_type" in meta \
        else np.ones(len(tokens), np.int32)
    special = [AddedToken(tokens[i], special=True, normalized=False) for i in np.nonzero(types == 3)[0]]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in np.nonzero(types == 4)[0]]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos = _token(meta, "bos")
    if bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token", False)):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1",
            special_tokens=[(bos, tokens.index(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _token(meta: dict[str, Any], which: str) -> str | None:
    key = f"tokenizer.ggml.{which}_token_id"
    return meta["tokenizer.ggml.tokens"][_int(meta, key)] if key in meta else None


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [_int(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    return list(dict.fromkeys(ids))


def _tokenizer_files(meta: dict[str, Any], tok: Any, max_len: int) -> dict[str, dict[str, Any]]:
    names = {w: _token(meta, w) for w in ("bos", "eos", "padding", "unknown")}
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": names["bos"], "eos_token": names["eos"], "pad_token": names["padding"],
        "unk_token": names["unknown"], "clean_up_tokenization_spaces": False,
        "model_max_length": max_len, "split_special_tokens": False,
    }
    if "tokenizer.chat_template" in meta:
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    special_map = {k: v for k, v in (("bos_token", names["bos"]), ("eos_token", names["eos"]),
                                     ("pad_token", names["padding"]), ("unk_token", names["unknown"]))
                   if v is not None}
    gen = {"eos_token_id": _eos_ids(meta)}
    for key, which in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{which}_token_id" in meta:
            gen[key] = _int(meta, f"tokenizer.ggml.{which}_token_id")
    return {"tokenizer_config.json": tok_cfg, "special_tokens_map.json": special_map,
            "generation_config.json": gen}


# -- conversion ---------------------------------------------------------------------------
def convert(src: Path, out: Path) -> None:
    """Write the mlx-lm directory of GGUF `src` into `out` (which exists and is empty)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    header = read_header(src)
    check_supported(src, header)
    if "token_embd.weight" not in header.tensors:
        raise ConfigError(f"model.path '{src}' has no token_embd.weight tensor")
    raw, meta = mx.load(str(src), return_metadata=True)
    rows = header.tensors["token_embd.weight"][1][0]
    if len(meta["tokenizer.ggml.tokens"]) > rows:
        raise ConfigError(f"model.path '{src}': {len(meta['tokenizer.ggml.tokens'])} tokens but "
                          f"token_embd has {rows} rows")
    tied = "output.weight" not in header.tensors
    has_bias = "blk.0.attn_q.bias" in header.tensors
    cfg = model_config(meta, rows, tied, has_bias)
    weights, quant = _weights(src, header, raw, cfg)
    del raw
    if quant:
        cfg["quantization"] = quant
    gen_ids = _eos_ids(meta)
    cfg["eos_token_id"] = gen_ids[0] if len(gen_ids) == 1 else gen_ids
    if "tokenizer.ggml.bos_token_id" in meta:
        cfg["bos_token_id"] = _int(meta, "tokenizer.ggml.bos_token_id")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    widths = sorted({v["bits"] for v in (quant, *quant.values()) if isinstance(v, dict) and v})
    log.info("converting %s: %d tensors written (%s) in %.1f s", src.name, len(weights),
             "/".join(f"{b}-bit" for b in widths) or "float", time.perf_counter() - t0)
    tok = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    files = {"config.json": cfg, **_tokenizer_files(meta, tok, cfg["max_position_embeddings"])}
    for fname, obj in files.items():
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    (out / "source.json").write_text(json.dumps({
        "gguf": str(src), "format_version": FORMAT_VERSION,
        "general.name": meta.get("general.name"), "file_type": header.metadata.get("general.file_type"),
    }, indent=2) + "\n")
    log.info("converting %s: tokenizer (%d tokens) and config written (%.1f s total)", src.name,
             len(meta["tokenizer.ggml.tokens"]), time.perf_counter() - t0)


def ensure_converted(src: Path, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of GGUF `src` in the model cache, converting it on first use."""
    header = read_header(src)
    check_supported(src, header)   # refuse before hashing or converting anything
    final = cache_root(cache_dir) / f"gguf-{src.stem}-{fingerprint(src, header)}"
    if (final / "config.json").is_file():
        log.info("GGUF %s: converted copy in %s", src.name, final)
        return final
    log.info("converting GGUF %s (%.1f MB) into %s", src, src.stat().st_size / 1e6, final)
    return publish(final, lambda tmp: convert(src, tmp))
