"""A generated mixture-of-experts checkpoint (mlx-lm's qwen3_moe: every layer routed, stacked
experts in `switch_mlp`) for the expert-offload tests and benchmark: deterministic random
weights, float or quantized as mlx_lm.convert writes them, the tiny models' tokenizer.
Numpy fills the weights; mlx builds the shapes and writes the file (any thread)."""
from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import cache_root, publish
from pipeserve.model.tiny.text import BRANCH_GAIN as GAINS, SEED, ensure_model

BRANCH_GAIN = GAINS["qwen3"]   # strong branches: outputs that depend on the whole context
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@dataclass(frozen=True)
class MoeShape:
    hidden: int = 64
    layers: int = 2
    experts: int = 16
    top_k: int = 2
    expert_inter: int = 64
    bits: int | None = None   # quantized (affine, groups of 32) as mlx_lm.convert writes it

    @property
    def name(self) -> str:
        q = f"-q{self.bits}" if self.bits else ""
        return (f"qwen3_moe-h{self.hidden}-l{self.layers}-e{self.experts}-k{self.top_k}"
                f"-i{self.expert_inter}{q}-v1")


def ensure_moe_model(shape: MoeShape = MoeShape(), cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory of `shape`, generated into the model cache on first use."""
    final = cache_root(cache_dir) / shape.name
    return publish(final, lambda tmp: _write(tmp, shape, cache_dir))


def config_of(shape: MoeShape, base: dict[str, Any]) -> dict[str, Any]:
    heads = max(2, shape.hidden // 32)
    return {**{k: base[k] for k in ("vocab_size", "eos_token_id", "bos_token_id",
                                    "max_position_embeddings", "rms_norm_eps", "rope_theta")
               if k in base},
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
            "intermediate_size": 2 * shape.hidden, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "head_dim": 32,
            "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
            "moe_intermediate_size": shape.expert_inter, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
            "torch_dtype": "float32", "pipeserve_generated": asdict(shape)}


def _write(out: Path, shape: MoeShape, cache_dir: str | Path | None) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_moe import Model, ModelArgs

    base_dir = ensure_model("qwen3", "tiny", "float32", cache_dir)
    config = config_of(shape, json.loads((base_dir / "config.json").read_text()))
    model = Model(ModelArgs.from_dict(config))
    model.update(_filled(model, shape.hidden))
    if shape.bits:
        nn.quantize(model, group_size=32, bits=shape.bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith("gate"))
        config["quantization"] = {"group_size": 32, "bits": shape.bits, "mode": "affine"}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(base_dir / name, out / name)


def _filled(model: Any, hidden: int) -> Any:
    """Seeded values for every parameter: unit norms, fan-in scaled matrices."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    out = []
    for name, p in tree_flatten(model.parameters()):
        rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
        if "norm" in name:
            v = np.ones(p.shape, np.float32)
        else:
            fan_in = hidden if "embed" in name else p.shape[-1]
            v = rng.standard_normal(p.shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))
            if "embed" in name or "lm_head" in name:
                v *= 4
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                v *= BRANCH_GAIN
        out.append((name, mx.array(v)))
    return tree_unflatten(out)
