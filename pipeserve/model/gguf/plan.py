"""A GGUF file's model as the conversion would write it, built lazily from the header alone: each
tensor's converted names, shapes and dtypes as unevaluated MLX arrays (no tensor data read),
loaded into the mlx-lm model class as mlx-lm's loader would. `pipeserve fit` sizes it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeserve.model.gguf import arch as gguf_arch
from pipeserve.model.gguf import convert as gguf_convert
from pipeserve.model.gguf import quants as gguf_quants

FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def planned_arrays(ttype: str, shape: tuple[int, ...], scale_dtype: str
                   ) -> tuple[dict[str, tuple[tuple[int, ...], str]], tuple[int, str] | None]:
    """What convert_tensor makes of one tensor: suffix -> (shape, dtype), and its (bits, mode)
    when quantized. A re-quantized type's width depends on its values; the narrowest candidate
    is assumed."""
    if ttype in FLOAT_DTYPES:
        return {"weight": (shape, FLOAT_DTYPES[ttype])}, None
    lead, cols = tuple(shape[:-1]), shape[-1]
    groups = cols // gguf_quants.GROUP
    if ttype in gguf_quants.EXACT_MODES:   # microscaled: uint8 exponents, no biases
        mode, bits = gguf_quants.EXACT_MODES[ttype]
        return {"weight": ((*lead, cols * bits // 32), "uint32"),
                "scales": ((*lead, groups), "uint8")}, (bits, mode)
    bits = gguf_quants.EXACT_BITS.get(ttype) or gguf_quants.REQUANT_BITS[ttype][0]
    return {"weight": ((*lead, cols * bits // 32), "uint32"),
            "scales": ((*lead, groups), scale_dtype),
            "biases": ((*lead, groups), scale_dtype)}, (bits, "affine")


def lazy_weights(header: gguf_convert.Header) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm parameter name -> an unevaluated array of the converted shape and dtype, and the
    `quantization` entry the conversion would write."""
    import mlx.core as mx

    meta = header.metadata
    arch = gguf_arch.lookup(meta["general.architecture"])
    assert arch is not None
    out: dict[str, Any] = {}
    bits: dict[str, tuple[int, str]] = {}
    for name, (ttype, shape, _) in header.tensors.items():
        if (name in gguf_arch.CONFIG_TENSORS.get(arch.model_type, ())
                or gguf_arch.dropped(arch, meta, name)):
            continue
        target = gguf_arch.map_name(arch, name)
        assert target is not None   # check_supported refused unmapped names
        arrays, b = planned_arrays(ttype, shape, arch.scale_dtype)
        lazy = {}
        for suffix, (shp, dtype) in arrays.items():
            if arch.shape is not None and not b:
                shp = arch.shape(target, shp)
            lazy[suffix] = mx.zeros(shp, getattr(mx, dtype))
        for key, arr in gguf_arch.placed(target, lazy, b is not None).items():
            out[key] = arr
            if b:
                bits[key.rpartition(".")[0]] = b
    return out, gguf_convert.quantization(bits)


def lazy_gguf_model(src: Path, cache_dir: str | None) -> tuple[Any, dict[str, Any], str]:
    """(model, config, what it was built from) of GGUF `src` with no weight read: its converted
    copy when the model cache has one, else the header."""
    from mlx_lm.utils import load_model

    header = gguf_convert.read_header(src, gguf_convert.ARRAYS)   # the eos ids need the vocabulary
    gguf_convert.check_supported(src, header)
    converted = gguf_convert.converted_dir(src, header, cache_dir)
    if (converted / "config.json").is_file():
        return (*load_model(converted, lazy=True), "its converted copy in the model cache")
    config = gguf_convert.model_config(src, header)
    weights, quant = lazy_weights(header)
    if quant:
        config["quantization"] = quant
    return _build(config, weights), config, "its GGUF header"


def _build(config: dict[str, Any], weights: dict[str, Any]) -> Any:
    """mlx-lm's load_model on in-memory weights: the class, sanitize, quantize, load."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant:
        def predicate(path: str, module: Any) -> Any:
            if path in quant:
                return quant[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    mode=quant["mode"], class_predicate=predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model
