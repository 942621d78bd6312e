"""GGUF -> an mlx-lm model directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, source.json), converted once
into the model cache and keyed by the file's fingerprint; loader.py then loads it like any checkpoint.

The header is scanned here first, so unsupported files are refused with what was found before any
tensor is read; tensors are then read straight from the file (numpy memmap) and converted one by one
(gguf_quants.py), names and config mapped per architecture (gguf_arch.py), the tokenizer rebuilt
(gguf_tokenizer.py). Runs on the engine thread."""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.gguf import arch as gguf_arch, gemma4
from pipeserve.model.gguf import quants as gguf_quants
from pipeserve.model.gguf import tokenizer as gguf_tokenizer
from pipeserve.errors import ConfigError
from pipeserve.launch.progress import StepProgress
from pipeserve.model.cache import cache_root, publish

log = logging.getLogger(__name__)

FORMAT_VERSION = 2     # bump when the converted directory's contents change (2: k-quants, archs)
ARCHS = tuple(gguf_arch.ARCHS)
TOKENIZER_MODELS = gguf_tokenizer.TOKENIZER_MODELS
# ggml tensor types by id (ggml.h); SUPPORTED_TYPES convert (gguf_quants.py says into what).
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
              22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
              29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
SUPPORTED_TYPES = gguf_quants.SUPPORTED
# metadata arrays read in full (the rest are kept as their length)
ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
          "tokenizer.ggml.merges", *gemma4.ARRAYS)


# -- the header ---------------------------------------------------------------------------
@dataclass
class Header:
    metadata: dict[str, Any]        # scalars and strings; ARRAYS in full, other arrays as length
    tensors: dict[str, tuple[str, tuple[int, ...], int]]  # name -> (type, numpy shape, offset)
    data_offset: int                # where tensor data starts (offsets are relative to it)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
       11: "<i8", 12: "<f8"}


def read_header(path: Path, arrays: tuple[str, ...] = ()) -> Header:
    """Scan the GGUF header: metadata scalars and strings, the named arrays in full (others as
    their length), tensor names, types and shapes."""
    size = path.stat().st_size
    if size < 24:
        raise ConfigError(f"model.path '{path}' is truncated: {size} bytes, shorter than a GGUF "
                          "header (24 bytes); download the file again")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _scan(path, buf, arrays)
        except struct.error:   # a read past the end
            raise ConfigError(f"model.path '{path}' is truncated at byte {size}, inside its GGUF "
                              "header; download the file again") from None
        except (ValueError, KeyError, IndexError, OverflowError, MemoryError) as e:
            raise ConfigError(f"model.path '{path}' is corrupt: its GGUF header does not parse "
                              f"({e}; the file has {size} bytes); download the file again"
                              ) from None


def _scan(path: Path, buf: mmap.mmap, arrays: tuple[str, ...]) -> Header:
    """read_header's parse; a truncated or corrupt header raises struct.error and friends."""
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
        if pos > len(buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

    def value(vtype: int, full: bool) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype == 8:
                if full:
                    return [string() for _ in range(count)]
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
            elif etype in _SCALARS:
                width = struct.calcsize(_SCALARS[etype])
                if full:
                    out = np.frombuffer(buf, dtype=_NP[etype], count=count, offset=pos).copy()
                    pos += count * width
                    return out
                pos += count * width
            else:
                raise ConfigError(f"model.path '{path}': nested GGUF arrays are not supported")
            return count
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype} at byte {pos - 4}")
        (v,) = struct.unpack_from(_SCALARS[vtype], buf, pos)
        pos += struct.calcsize(_SCALARS[vtype])
        return v

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        metadata[key] = value(vtype, key in arrays)
    tensors = {}
    for _ in range(n_tensors):
        name = string()
        (ndim,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= ndim <= 4:   # ggml tensors have at most 4 dims
            raise ValueError(f"tensor {name!r} has {ndim} dimensions at byte {pos}")
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        tensors[name] = (GGML_TYPES.get(ttype, f"unknown type {ttype}"), tuple(reversed(dims)),
                         offset)
    align = int(metadata.get("general.alignment", 32))
    return Header(metadata, tensors, -(-pos // align) * align)


def check_complete(path: Path, header: Header) -> None:
    """Every tensor's bytes lie inside the file: a download cut short is refused before any
    tensor is read (the types are known to be supported by now)."""
    size = path.stat().st_size
    end, last = header.data_offset, None
    for name, (ttype, shape, offset) in header.tensors.items():
        stop = header.data_offset + offset + gguf_quants.nbytes(ttype, shape)
        if stop > end:
            end, last = stop, name
    if end > size:
        raise ConfigError(f"model.path '{path}' is truncated at byte {size} of {end} (tensor "
                          f"{last!r} ends at byte {end}); download the file again")


def fingerprint(path: Path, header: Header) -> str:
    """What names a conversion in the cache: the file's size and mtime and a hash of its header
    (every metadata value, tensor name, type, shape and offset), plus FORMAT_VERSION. Hashing
    the header instead of all the bytes keeps a multi-GB file's launch instant; an edit that kept
    size, mtime and header would go unnoticed."""
    st = path.stat()
    h = hashlib.sha256(f"v{FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(header.data_offset))
    return h.hexdigest()[:16]


# -- what is supported --------------------------------------------------------------------
def check_supported(path: Path, header: Header) -> None:
    """Refuse, naming what was found and what is supported, anything the conversion cannot map."""
    meta = header.metadata
    name = meta.get("general.architecture")
    arch = gguf_arch.lookup(name)
    if arch is None:
        raise ConfigError(f"model.path '{path}': GGUF architecture {name!r} is not supported; "
                          f"supported: {', '.join(ARCHS)} (and mistral, written as llama)")
    gguf_tokenizer.check(path, meta)
    bad = {n: t for n, (t, _, _) in header.tensors.items() if t not in SUPPORTED_TYPES}
    if bad:
        types = Counter(bad.values())
        first = next(iter(bad))
        raise ConfigError(
            f"model.path '{path}': tensor type {', '.join(sorted(types))} is not supported "
            f"({len(bad)} tensors, e.g. {first} is {bad[first]}); supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Use a file of this model in one of those types"
            + (" (an unknown type id is a newer ggml type or a corrupt file)"
               if any(t.startswith("unknown") for t in types) else ""))
    for n, (t, shape, _) in header.tensors.items():
        per = gguf_quants.BLOCKS.get(t, (1, 0))[0]
        if shape[-1] % per or (t in gguf_quants.BLOCKS and shape[-1] % gguf_quants.GROUP):
            raise ConfigError(f"model.path '{path}': tensor {n!r} ({t}) has rows of {shape[-1]} "
                              f"values, not a multiple of its {per}-value blocks or of 32")
    config_tensors = gguf_arch.CONFIG_TENSORS.get(arch.model_type, ())
    for n in header.tensors:
        if gguf_arch.dropped(arch, meta, n):
            continue
        if gguf_arch.map_name(arch, n) is None and n not in config_tensors:
            raise ConfigError(
                f"model.path '{path}': tensor {n!r} has no place in an mlx-lm {name} model "
                f"(supported names: token_embd, output_norm, output, "
                f"blk.N.{{{', '.join(arch.blocks)}}})")
    if "token_embd.weight" not in header.tensors:
        raise ConfigError(f"model.path '{path}' has no token_embd.weight tensor")
    check_complete(path, header)


# -- the weights --------------------------------------------------------------------------
def _unpermute(x: Any, n_heads: int) -> Any:
    """Undo llama.cpp's HF->GGUF `permute` of q/k rows (each head's rotary halves interleaved).
    Rows only, so it applies alike to float weights and to quantized weight/scales/biases."""
    half = x.shape[0] // n_heads // 2
    return x.reshape(n_heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _weights(path: Path, header: Header, arch_name: str, cfg: dict[str, Any]
             ) -> tuple[dict[str, Any], dict[str, Any], gguf_quants.Report]:
    """mlx-lm parameter name -> array, the mlx-lm `quantization` entry (or {}), and the report."""
    arch = gguf_arch.lookup(arch_name)
    assert arch is not None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_offset)
    report = gguf_quants.Report()
    out: dict[str, Any] = {}
    bits: dict[str, tuple[int, str]] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    todo = {name: (ttype, shape, offset) for name, (ttype, shape, offset) in header.tensors.items()
            if name not in gguf_arch.CONFIG_TENSORS.get(arch.model_type, ())
            and not gguf_arch.dropped(arch, header.metadata, name)}
    progress = StepProgress(log, f"converting {path.name}", sum(
        gguf_quants.nbytes(t, s) for t, s, _ in todo.values()) / 1e6)
    try:
        for name, (ttype, shape, offset) in todo.items():
            size = gguf_quants.nbytes(ttype, shape)
            _convert_one(arch, name, np.asarray(data[offset:offset + size]), ttype, shape,
                         (heads, kv_heads), report, out, bits, cfg)
            progress.advance(size / 1e6)
    finally:
        progress.close()
    return out, quantization(bits), report


def _convert_one(arch: Any, name: str, raw: Any, ttype: int, shape: Any,
                 heads: tuple[int, int | None], report: gguf_quants.Report,
                 out: dict[str, Any], bits: dict[str, tuple[int, str]],
                 cfg: dict[str, Any]) -> None:
    """One GGUF tensor into `out` (its mlx-lm arrays) and `bits` (its quantization)."""
    conv = gguf_quants.convert_tensor(ttype, raw, shape, arch.scale_dtype)
    report.add(ttype, conv, int(np.prod(shape)))
    target = gguf_arch.map_name(arch, name)
    assert target is not None
    arrays = {}
    for suffix, arr in conv.arrays.items():
        if arch.permute_qk and (".self_attn.q_proj." in target or ".self_attn.k_proj." in target):
            arr = _unpermute(arr, heads[0] if ".q_proj." in target else heads[1])
        if arch.norm_shift and "norm." in target and suffix == "weight":
            arr = arr - arch.norm_shift
        if arch.undo is not None:
            arr = arch.undo(target, suffix, arr, cfg)
        arrays[suffix] = arr
    for key, arr in gguf_arch.placed(target, arrays, bool(conv.bits)).items():
        out[key] = arr
        if conv.bits:
            bits[key.rpartition(".")[0]] = (conv.bits, conv.mode)


def quantization(bits: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """mlx-lm's `quantization` entry for layers quantized at (bits, mode) (the commonest as the
    default, the others per layer); {} when nothing is quantized."""
    if not bits:
        return {}
    default = Counter(bits.values()).most_common(1)[0][0]
    group = gguf_quants.GROUP
    quant: dict[str, Any] = {"group_size": group, "bits": default[0], "mode": default[1]}
    for base, (b, mode) in sorted(bits.items()):
        if (b, mode) != default:
            quant[base] = {"group_size": group, "bits": b, "mode": mode}
    return quant


# -- conversion ---------------------------------------------------------------------------
def convert(src: Path, out: Path) -> None:
    """Write the mlx-lm directory of GGUF `src` into `out` (which exists and is empty)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    header = read_header(src, ARRAYS)
    check_supported(src, header)
    meta = header.metadata
    arch_name = meta["general.architecture"]
    rows = header.tensors["token_embd.weight"][1][0]
    if len(meta["tokenizer.ggml.tokens"]) > rows:
        raise ConfigError(f"model.path '{src}': {len(meta['tokenizer.ggml.tokens'])} tokens but "
                          f"token_embd has {rows} rows")
    cfg = model_config(src, header)
    weights, quant, report = _weights(src, header, arch_name, cfg)
    if quant:
        cfg["quantization"] = quant
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for line in report.lines():
        log.info("converting %s: %s", src.name, line)
    log.info("converting %s: %s model, %d tensors written in %.1f s", src.name, arch_name,
             len(weights), time.perf_counter() - t0)
    tok = gguf_tokenizer.build(meta, arch_name)
    tok.save(str(out / "tokenizer.json"))
    files = {"config.json": cfg,
             **gguf_tokenizer.files(meta, tok, cfg["max_position_embeddings"])}
    for fname, obj in files.items():
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    (out / "source.json").write_text(json.dumps({
        "gguf": str(src), "format_version": FORMAT_VERSION, "architecture": arch_name,
        "general.name": meta.get("general.name"), "file_type": meta.get("general.file_type"),
        "tensors": report.summary(),
    }, indent=2) + "\n")
    log.info("converting %s: %s tokenizer (%d tokens) and config written (%.1f s total)",
             src.name, meta["tokenizer.ggml.model"], len(meta["tokenizer.ggml.tokens"]),
             time.perf_counter() - t0)


def model_config(src: Path, header: Header) -> dict[str, Any]:
    """config.json of the converted model, without its `quantization` entry: from the header's
    metadata and the few small tensors some architectures keep config in (Llama 3's rope_freqs)."""
    meta = header.metadata
    arch_name = meta["general.architecture"]
    rows = header.tensors["token_embd.weight"][1][0]
    tied = "output.weight" not in header.tensors
    has_bias = "blk.0.attn_q.bias" in header.tensors
    has_qk_norm = "blk.0.attn_q_norm.weight" in header.tensors
    cfg = gguf_arch.model_config(arch_name, meta, rows, tied, has_bias, has_qk_norm)
    config_tensors = {}
    for name in gguf_arch.CONFIG_TENSORS.get(cfg["model_type"], ()):
        if name in header.tensors:
            ttype, shape, offset = header.tensors[name]
            config_tensors[name] = gguf_quants.reference(ttype, np.fromfile(
                src, np.uint8, gguf_quants.nbytes(ttype, shape), offset=header.data_offset + offset),
                shape)
    if cfg["model_type"] == "gemma4_text":
        gemma4.apply_tensors(cfg, config_tensors.get("rope_freqs.weight"),
                             {n: shape for n, (_, shape, _) in header.tensors.items()})
    else:
        gguf_arch.apply_config_tensors(cfg, config_tensors)
    gen_ids = gguf_tokenizer.eos_ids(meta)
    cfg["eos_token_id"] = gen_ids[0] if len(gen_ids) == 1 else gen_ids
    if "tokenizer.ggml.bos_token_id" in meta:
        cfg["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return cfg


def converted_dir(src: Path, header: Header, cache_dir: str | Path | None = None) -> Path:
    """Where GGUF `src`'s conversion lives in the model cache (whether or not it exists yet)."""
    return cache_root(cache_dir) / f"gguf-{src.stem}-{fingerprint(src, header)}"


def ensure_converted(src: Path, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of GGUF `src` in the model cache, converting it on first use."""
    header = read_header(src)
    check_supported(src, header)   # refuse before hashing or converting anything
    final = converted_dir(src, header, cache_dir)
    if (final / "config.json").is_file():
        log.info("GGUF %s: converted copy in %s", src.name, final)
        log_conversion(final)
        return final
    log.info("converting GGUF %s (%.1f MB) into %s", src, src.stat().st_size / 1e6, final)
    return publish(final, lambda tmp: convert(src, tmp))


def log_conversion(directory: Path) -> None:
    """Repeat, from a cached directory's source.json, what each tensor type became and its error."""
    source = directory / "source.json"
    if not source.is_file():
        return
    for kind, row in json.loads(source.read_text()).get("tensors", {}).items():
        log.info("%s: %s: %d tensors (%.1fM values), max relative RMS error vs gguf's "
                 "dequantization %.1e", directory.name, kind, row["tensors"], row["values"] / 1e6,
                 row["max_rel_rms_error"])
