"""GGUF tensor data -> what MLX runs: float tensors as stored, llama.cpp's block types as mlx-lm
affine quantization (exactly where an affine form holds the blocks, re-quantized or bf16 where
none does), MXFP4 as MLX's own `mxfp4` mode (the same codes and scales, repacked), each
tensor's error measured against the `gguf` package's reference dequantization (llama.cpp's own,
in Python). Numpy and MLX only; called by gguf.py on the engine thread."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

GROUP = 32           # MLX affine groups: 32 is the smallest MLX has (no 16)
QK_K = 256           # k-quant super-block
MAX_ERROR = 0.01     # a re-quantized tensor may add at most this relative RMS error, else bf16
SAMPLE_ROWS = 1024   # rows per tensor the error is measured on (evenly spaced)
BLOCKS = {           # type -> (values per block, bytes per block): ggml's block layouts
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "IQ3_S": (256, 110),
    "IQ3_XXS": (256, 98), "IQ2_S": (256, 82), "IQ2_XS": (256, 74), "IQ2_XXS": (256, 66),
    "IQ1_M": (256, 56), "IQ1_S": (256, 50), "TQ2_0": (256, 66), "TQ1_0": (256, 54),
    "MXFP4": (32, 17),
}
# Block types MLX has a mode for with the same codes and scales: type -> (mode, bits).
EXACT_MODES = {"MXFP4": ("mxfp4", 4)}
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
# Block types no MLX affine form holds (16-value sub-blocks, non-linear codebooks): re-quantized
# from the reference values at the first of these widths within MAX_ERROR, else bf16.
REQUANT_BITS = {"Q2_K": (3, 4, 5, 6, 8), "Q3_K": (4, 5, 6, 8), "Q6_K": (6, 8),
                "IQ4_NL": (4, 5, 6, 8), "IQ4_XS": (4, 5, 6, 8), "IQ3_S": (3, 4, 5, 6, 8),
                "IQ3_XXS": (3, 4, 5, 6, 8), "IQ2_S": (2, 3, 4, 5, 6, 8),
                "IQ2_XS": (2, 3, 4, 5, 6, 8), "IQ2_XXS": (2, 3, 4, 5, 6, 8),
                "IQ1_M": (2, 3, 4, 5, 6, 8), "IQ1_S": (2, 3, 4, 5, 6, 8),
                "TQ2_0": (2, 3, 4, 5, 6, 8), "TQ1_0": (2, 3, 4, 5, 6, 8)}
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
SUPPORTED = (*FLOATS, *BLOCKS)


def nbytes(ttype: str, shape: tuple[int, ...]) -> int:
    n = int(np.prod(shape))
    if ttype in FLOATS:
        return n * (4 if ttype == "F32" else 2)
    per, size = BLOCKS[ttype]
    return n // per * size


@dataclass
class Converted:
    arrays: dict[str, Any]   # "weight" (+ "scales", "biases" when quantized): mx arrays
    form: str                # what it became: "F32", "bf16", "affine 4-bit", ...
    bits: int | None         # affine width, or None for a float tensor
    error: float             # relative RMS error against the reference dequantization
    exact: bool              # the affine form holds the blocks exactly (up to float16 scales)
    mode: str = "affine"     # MLX quantization mode of a quantized tensor


# -- exact decodings: integer levels q and per-32 scale/bias with value = scale * q + bias ------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32): elements 0..15 in the low nibbles, 16..31 in the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (gguf's get_scale_min)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """k-quant 4-bit lows: each 32 bytes hold two 32-value sub-blocks (low, then high nibbles)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1, 32)


def decode_affine(ttype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, block bytes) -> q (n*groups, 32) uint8, scale and bias (n*groups,) float32."""
    n = blocks.shape[0]
    if ttype in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blocks[:, :2])[:, 0]
        if ttype == "Q8_0":
            q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return q, d, -128 * d
        if ttype == "Q4_0":
            return _nibbles(blocks[:, 2:]), d, -8 * d
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        return _nibbles(blocks[:, 6:]) | high, d, -16 * d
    if ttype in ("Q4_1", "Q5_1"):
        d, m = _f16(blocks[:, :2])[:, 0], _f16(blocks[:, 2:4])[:, 0]
        if ttype == "Q4_1":
            return _nibbles(blocks[:, 4:]), d, m
        qh = np.ascontiguousarray(blocks[:, 4:8]).view(np.uint32)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        return _nibbles(blocks[:, 8:]) | high, d, m
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale, bias = (d * sc).reshape(-1), (-dmin * mn).reshape(-1)
    if ttype == "Q4_K":
        return _k_low(blocks[:, 16:]).reshape(-1, 32), scale, bias
    assert ttype == "Q5_K"
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = ((qh & 1) << 4).reshape(n, 8, 32)
    return (_k_low(blocks[:, 48:]) | high).reshape(-1, 32), scale, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integer levels (rows, cols) -> MLX's packed uint32 words (a little-endian bit stream)."""
    rows, cols = q.shape
    q = q.astype(np.uint8)
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    elif bits == 2:
        packed = q[:, 0::4] | (q[:, 1::4] << 2) | (q[:, 2::4] << 4) | (q[:, 3::4] << 6)
    else:
        bit_planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(bit_planes.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view(np.uint32).reshape(rows, cols * bits // 32)


# -- the reference and the error ------------------------------------------------------------
def reference(ttype: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """llama.cpp's dequantization (the `gguf` package) of `raw` into float32 of `shape`."""
    import gguf
    if ttype in FLOATS:
        return _float_values(ttype, raw).reshape(shape).astype(np.float32)
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[:-1])))
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[ttype]).reshape(shape)


def _float_values(ttype: str, raw: np.ndarray) -> np.ndarray:
    if ttype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(FLOATS[ttype])


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    diff = got.astype(np.float64) - want
    norm = float(np.sqrt(np.mean(np.square(want, dtype=np.float64))))
    return float(np.sqrt(np.mean(np.square(diff)))) / norm if norm else float(np.abs(diff).max())


def _sample(rows: int) -> np.ndarray:
    return np.unique(np.linspace(0, rows - 1, min(rows, SAMPLE_ROWS)).astype(np.int64))


# -- one tensor -----------------------------------------------------------------------------
def convert_tensor(ttype: str, raw: np.ndarray, shape: tuple[int, ...],
                   scale_dtype: str = "float16", max_error: float = MAX_ERROR) -> Converted:
    """The MLX form of one GGUF tensor (`raw`: its bytes as uint8, `shape` in numpy order);
    affine scales and biases stored in `scale_dtype` (float16, or bfloat16 for models whose
    activations overflow float16); a re-quantized tensor may add at most `max_error`."""
    import mlx.core as mx

    sdt = getattr(mx, scale_dtype)
    if ttype in FLOATS:
        if ttype == "BF16":   # the raw bits: numpy has no bfloat16
            arr = mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)
        else:
            arr = mx.array(_float_values(ttype, raw).reshape(shape))
        return Converted({"weight": arr}, ttype, None, 0.0, True)
    cols = shape[-1]
    rows = int(np.prod(shape[:-1]))
    per, size = BLOCKS[ttype]
    blocks = raw.reshape(rows * cols // per, size)
    sample = _sample(rows)
    want = reference(ttype, raw.reshape(rows, -1)[sample], (len(sample), cols))
    if ttype in EXACT_MODES:
        return _microscaled(ttype, blocks, shape, rows, cols, sample, want)
    if ttype in EXACT_BITS:
        bits = EXACT_BITS[ttype]
        q, scale, bias = decode_affine(ttype, blocks)
        w = mx.array(pack(q.reshape(rows, cols), bits))
        s = mx.array(scale.reshape(rows, cols // GROUP)).astype(sdt)
        b = mx.array(bias.reshape(rows, cols // GROUP)).astype(sdt)
        got = _dequant(w, s, b, bits, sample)
        return Converted(_shaped(w, s, b, shape), f"affine {bits}-bit", bits,
                         rel_error(got, want), True)
    return _requantize(ttype, raw, shape, rows, cols, sample, want, sdt, max_error)


def _microscaled(ttype: str, blocks: np.ndarray, shape: tuple[int, ...], rows: int, cols: int,
                 sample: np.ndarray, want: np.ndarray) -> Converted:
    """MXFP4 blocks (an E8M0 scale byte, then 32 E2M1 codes: elements 0-15 in the low nibbles,
    16-31 in the high ones) as MLX's mxfp4 mode: the codes repacked in element order, the scale
    bytes kept; llama.cpp's values (its doubled code table times half the scale) are the same."""
    import mlx.core as mx

    mode, bits = EXACT_MODES[ttype]
    codes = _nibbles(blocks[:, 1:])
    w = mx.array(pack(codes.reshape(rows, cols), bits))
    s = mx.array(np.ascontiguousarray(blocks[:, 0]).reshape(rows, cols // GROUP))
    idx = mx.array(sample)
    got = np.array(mx.dequantize(w[idx], s[idx], None, group_size=GROUP, bits=bits, mode=mode)
                   .astype(mx.float32))
    lead = tuple(shape[:-1])
    return Converted({"weight": w.reshape(*lead, -1), "scales": s.reshape(*lead, -1)}, mode,
                     bits, rel_error(got, want), True, mode)


def _requantize(ttype: str, raw: np.ndarray, shape: tuple[int, ...], rows: int, cols: int,
                sample: np.ndarray, want: np.ndarray, sdt: Any, max_error: float) -> Converted:
    """Re-quantize the reference values at the narrowest width within max_error (measured on the
    sampled rows), else keep them as bf16."""
    import mlx.core as mx

    trial = mx.array(want)
    for bits in REQUANT_BITS[ttype]:
        w, s, b = mx.quantize(trial, group_size=GROUP, bits=bits)
        s, b = s.astype(sdt).astype(mx.float32), b.astype(sdt).astype(mx.float32)
        got = np.array(mx.dequantize(w, s, b, group_size=GROUP, bits=bits))
        if rel_error(got, want) <= max_error:
            full = mx.array(reference(ttype, raw, (rows, cols)))
            w, s, b = mx.quantize(full, group_size=GROUP, bits=bits)
            s, b = s.astype(sdt), b.astype(sdt)
            err = rel_error(_dequant(w, s, b, bits, sample), want)
            return Converted(_shaped(w, s, b, shape), f"affine {bits}-bit", bits, err, False)
    full = mx.array(reference(ttype, raw, (rows, cols))).astype(mx.bfloat16)
    err = rel_error(np.array(full[mx.array(sample)].astype(mx.float32)), want)
    return Converted({"weight": full.reshape(shape)}, "bf16", None, err, False)


def _dequant(w: Any, s: Any, b: Any, bits: int, sample: np.ndarray) -> np.ndarray:
    import mlx.core as mx
    idx = mx.array(sample)   # float32 arithmetic on the stored scales and biases
    out = mx.dequantize(w[idx], s[idx].astype(mx.float32), b[idx].astype(mx.float32),
                        group_size=GROUP, bits=bits)
    return np.array(out)


def _shaped(w: Any, s: Any, b: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    lead = tuple(shape[:-1])
    return {"weight": w.reshape(*lead, -1), "scales": s.reshape(*lead, -1),
            "biases": b.reshape(*lead, -1)}


# -- the startup report ---------------------------------------------------------------------
class Report:
    """Per GGUF type and what it became: tensor count, parameters and the largest error."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def add(self, ttype: str, conv: Converted, numel: int) -> None:
        row = self.rows[(ttype, conv.form + (" (exact)" if conv.exact and conv.bits else ""))]
        row[0] += 1
        row[1] += numel
        row[2] = max(row[2], conv.error)

    def lines(self) -> list[str]:
        out = []
        for (ttype, form), (count, numel, err) in sorted(self.rows.items()):
            verb = ("kept" if ttype == form or ttype in FLOATS
                    else "mapped to MLX's " + form if ttype in EXACT_MODES
                    else "converted to " + form)
            out.append(f"{ttype}: {int(count)} tensors ({numel / 1e6:.1f}M values) {verb}; "
                       f"max relative RMS error vs gguf's dequantization {err:.1e}")
        return out

    def summary(self) -> dict[str, dict[str, Any]]:
        return {f"{t} -> {f}": {"tensors": int(c), "values": int(n), "max_rel_rms_error": e}
                for (t, f), (c, n, e) in sorted(self.rows.items())}
