"""Multi-token-prediction (MTP) head of the Qwen releases that ship one, Qwen3-Next
(`qwen3_next`) and Qwen3.5 (`qwen3_5`, `qwen3_5_moe`): loads the checkpoint's `mtp.*` tensors
(which mlx-lm's loader drops or never sees) and runs them as a drafter. Engine thread.

Layout (the released checkpoints, as vLLM's qwen3_next_mtp / qwen3_5_mtp read them; both
families use the same top-level names, also when Qwen3.5's trunk sits under
`model.language_model.`):
    mtp.pre_fc_norm_embedding.weight (H)   mtp.pre_fc_norm_hidden.weight (H)
    mtp.fc.weight (H, 2H)                  mtp.norm.weight (H)
    mtp.layers.{i}.*   full-attention decoder layers of the family (gated attention + MLP or
                       MoE; Qwen3-Next stores experts one tensor each, Qwen3.5 fused as
                       mlp.experts.gate_up_proj (E, 2I, H) and mlp.experts.down_proj (E, H, I))
Depth: config.json `num_nextn_predict_layers` (Qwen3-Next) or text_config
`mtp_num_hidden_layers` (Qwen3.5). embed_tokens and lm_head are the target's.
One step, at position t:
    x = fc(concat([pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(h[t])]))
    g = norm(layers[step % n](x))          logits = lm_head(g) predict token[t+2]
h[t] is the target trunk's output AFTER its final norm at position t (what `model.model(...)`
returns; `target_forward` gives it with the logits). To chain, the next draft step feeds g and
the drafted token. The head has its own KV cache (one KVCache per MTP layer) with one entry per
target position, rotary offset = position t, so it stays aligned with the target: after a
prefill of L prompt tokens, run the head over h[0:L] with tokens[1:L] + [sampled]; after a
verify, trim its cache back to the last true position and re-feed the target's hidden states
for the accepted positions."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models import qwen3_5
from mlx_lm.models.gemma4_text import logit_softcap
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextDecoderLayer

from pipeserve.draft.taps import taps_of

PREFIX = "mtp."
MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _decoder_layer(args: Any, moe: bool) -> nn.Module:
    """One full-attention decoder layer of the target's family (layer 0 of an interval-1
    model is a full-attention layer), MoE or dense as the weights are."""
    if isinstance(args, qwen3_5.TextModelArgs):
        layer_args = dataclasses.replace(args, full_attention_interval=1,
                                         num_experts=args.num_experts if moe else 0)
        return qwen3_5.DecoderLayer(layer_args, layer_idx=0)
    layer_args = dataclasses.replace(args, full_attention_interval=1, decoder_sparse_step=1,
                                     mlp_only_layers=[] if moe else [0])
    return Qwen3NextDecoderLayer(layer_args, layer_idx=0)


def text_args(model: Any) -> Any:
    """The decoder's arguments: Qwen3.5's mlx-lm Model wraps its text model (`language_model`),
    whose args hold the shapes; Qwen3-Next's Model holds them itself."""
    return getattr(model, "language_model", model).args


class MtpBlock(nn.Module):
    """The `mtp.*` parameters, named as in the checkpoint minus the prefix (mlx-lm layout:
    experts stacked into `mlp.switch_mlp`, RMSNorm weights used as-is). `args`: qwen3_next's
    ModelArgs or qwen3_5's TextModelArgs (`text_args(model)`)."""

    def __init__(self, args: ModelArgs | qwen3_5.TextModelArgs, num_layers: int,
                 moe: bool) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [_decoder_layer(args, moe) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[Any], step: int) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        i = step % len(self.layers)
        x = self.layers[i](x, mask=create_attention_mask(x, cache[i]), cache=cache[i])
        return self.norm(x)


class MtpHead:
    """An MTP drafter bound to its target: shares the target's embedding and output head."""

    def __init__(self, block: MtpBlock, embed: Callable[[mx.array], mx.array],
                 head: Callable[[mx.array], mx.array]) -> None:
        self.block = block
        self.embed = embed
        self.head = head

    @property
    def num_layers(self) -> int:
        return len(self.block.layers)

    def make_cache(self) -> list[Any]:
        """A fresh per-row cache: one mlx-lm KVCache per MTP layer."""
        return [KVCache() for _ in self.block.layers]

    def pick(self, logits: mx.array) -> mx.array:
        """Greedy draft ids from (B, V) logits."""
        return mx.argmax(logits, axis=-1)

    def __call__(self, hidden: mx.array, next_ids: mx.array, cache: list[Any],
                 step: int = 0) -> tuple[mx.array, mx.array]:
        """hidden (B, L, H): target post-norm hidden states (or the previous step's hidden_out)
        at positions t..t+L-1; next_ids (B, L): the tokens at t+1..t+L. Appends L entries to
        `cache` (layer step % num_layers). Returns (logits (B, L, V) for the tokens at
        t+2..t+L+1, hidden_out (B, L, H) to feed the next chained step)."""
        out = self.block(self.embed(next_ids), hidden, cache, step)
        return self.head(out), out


def output_head(model: Any) -> Callable[[mx.array], mx.array]:
    """The target's hidden -> logits map (tied embedding or lm_head, then Gemma's logit
    soft-cap), as its __call__ applies it."""
    text = getattr(model, "language_model", model)
    head = model.model.embed_tokens.as_linear if text.args.tie_word_embeddings else text.lm_head
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is None:
        return head
    return lambda hidden: logit_softcap(cap, head(hidden))


def target_forward(model: Any, inputs: mx.array, cache: list[Any] | None = None,
                   ) -> tuple[mx.array, mx.array]:
    """(logits, hidden) of an mlx-lm qwen3_next or qwen3_5 Model without changing mlx-lm: hidden is
    `model.model(...)`, the trunk output after the final norm (what the MTP head consumes);
    logits are bit-identical to `model(inputs, cache=cache)`. A model with taps (draft=eagle3)
    gives the taps' fused hidden states instead."""
    taps = taps_of(model)
    if taps is None:
        hidden = model.model(inputs, cache)
        return output_head(model)(hidden), hidden
    taps.active = True   # draft=eagle3: the hidden states are the fused taps instead
    try:
        out = model.model(inputs, cache)
    finally:
        taps.active = False
    fused, taps.seen = taps.fused(), {}
    return output_head(model)(out), fused


def _index(model_path: Path) -> dict[str, str] | None:
    index = model_path / "model.safetensors.index.json"
    return json.loads(index.read_text())["weight_map"] if index.is_file() else None


def _weight_files(model_path: Path) -> list[Path]:
    files = sorted(model_path.glob("*.safetensors"))
    weight_map = _index(model_path)
    if weight_map is None:
        return files
    with_mtp = {f for k, f in weight_map.items() if k.startswith(PREFIX)}
    indexed = set(weight_map.values())
    return [f for f in files if f.name in with_mtp or f.name not in indexed]


def read_mtp_tensors(model_path: Path) -> dict[str, mx.array]:
    """Every `mtp.*` tensor in the directory's safetensors files (lazy arrays), prefix kept."""
    found: dict[str, mx.array] = {}
    for f in _weight_files(Path(model_path)):
        found.update((k, v) for k, v in mx.load(str(f)).items() if k.startswith(PREFIX))
    return found


def raw_trunk(model_path: Path) -> bool:
    """Whether the checkpoint's trunk is in Hugging Face's layout rather than mlx-lm's: its
    GatedDeltaNet conv1d weights are (C, 1, K), not (C, K, 1). Both families' sanitize use
    this to shift the zero-centred RMSNorm weights by +1, and a released checkpoint's MTP
    norms are zero-centred the same way. Reads headers only (mx.load is lazy)."""
    model_path = Path(model_path)
    weight_map = _index(model_path)
    if weight_map is not None:
        names = sorted({f for k, f in weight_map.items()
                        if k.endswith("conv1d.weight") and not k.startswith(PREFIX)})
        files = [model_path / n for n in names[:1]]
    else:
        files = sorted(model_path.glob("*.safetensors"))
    for f in files:
        for k, v in mx.load(str(f)).items():
            if k.endswith("conv1d.weight") and not k.startswith(PREFIX):
                return v.ndim == 3 and v.shape[-1] != 1
    return False


def _to_mlx_layout(weights: dict[str, mx.array], raw: bool = False) -> dict[str, mx.array]:
    """Strip the prefix. A raw Hugging Face layout gets its experts stacked into
    `switch_mlp` (Qwen3-Next: one tensor per expert; Qwen3.5: fused gate_up_proj split in
    two) and its zero-centred RMSNorm weights shifted by +1, the rules mlx-lm's qwen3_next /
    qwen3_5(_moe) sanitize apply to the trunk. `raw` (the trunk is in HF layout) forces the
    shift for a dense head; unstacked experts imply it."""
    w = {k[len(PREFIX):]: v for k, v in weights.items()}
    experts: dict[tuple[int, str], dict[int, mx.array]] = {}
    for match in [m for k in w if (m := _EXPERT.match(k))]:
        layer, expert, proj = match.groups()
        experts.setdefault((int(layer), proj), {})[int(expert)] = w.pop(match.string)
    for (layer, proj), by_id in experts.items():
        w[f"layers.{layer}.mlp.switch_mlp.{proj}.weight"] = mx.stack([by_id[e] for e in sorted(by_id)])
    fused = [m for k in w if (m := _FUSED.match(k))]
    for match in fused:
        layer, proj = match.groups()
        value = w.pop(match.string)
        out = f"layers.{layer}.mlp.switch_mlp."
        if proj == "down_proj":
            w[out + "down_proj.weight"] = value
        else:
            mid = value.shape[-2] // 2
            w[out + "gate_proj.weight"] = value[..., :mid, :]
            w[out + "up_proj.weight"] = value[..., mid:, :]
    if raw or experts or fused:   # every RMSNorm of the head, pre_fc_norm_* included
        w = {k: v + 1.0 if _is_norm(k, v) else v for k, v in w.items()}
    return w


def _is_norm(name: str, value: mx.array) -> bool:
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    return value.ndim == 1 and name.endswith(".weight") and "norm" in module


def _num_layers(weights: dict[str, mx.array], model_path: Path) -> int:
    indices = {int(m.group(1)) for k in weights if (m := _LAYER.match(k))}
    n = len(indices)
    if indices != set(range(n)) or n == 0:
        raise ValueError(f"{model_path}: mtp.layers indices {sorted(indices)} are not 0..n-1")
    config_file = model_path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for where, cfg in (("", config), ("text_config.", config.get("text_config") or {})):
        for key in CONFIG_KEYS:
            if cfg.get(key) is not None and int(cfg[key]) != n:
                raise ValueError(f"{model_path}: config.json {where}{key}={cfg[key]} but the "
                                 f"checkpoint has {n} mtp.layers")
    return n


def load_mtp(model_path: Path, model: Any) -> MtpHead | None:
    """The MTP head of the checkpoint at model_path, bound to `model` (its mlx-lm Model, already
    loaded), cast to the target's dtype and evaluated; None when there are no `mtp.*` tensors.
    Raises ValueError for a target outside MODEL_TYPES, quantized MTP tensors, or a layout
    mismatch."""
    model_path = Path(model_path)
    tensors = read_mtp_tensors(model_path)
    if not tensors:
        return None
    model_type = getattr(model, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{model_path} has mtp.* tensors but model_type {model_type!r}; "
                         "draft=mtp supports qwen3_next (Qwen3-Next) and qwen3_5 / "
                         "qwen3_5_moe (Qwen3.5)")
    if any(k.endswith(".scales") for k in tensors):
        raise ValueError(f"{model_path}: quantized mtp.* tensors are not supported; "
                         "use a checkpoint with unquantized MTP weights")
    weights = _to_mlx_layout(tensors, raw_trunk(model_path))
    dtype = model.model.norm.weight.dtype
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    moe = any(".mlp.switch_mlp." in k for k in weights)
    block = MtpBlock(text_args(model), _num_layers(weights, model_path), moe)
    block.load_weights(list(weights.items()), strict=True)
    block.eval()
    mx.eval(block.parameters())
    return MtpHead(block, model.model.embed_tokens, output_head(model))
