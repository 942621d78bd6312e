"""DFlash drafters (pipeserve/draft/dflash.py) in the published layout: the generated
checkpoint carries z-lab's names, one block forward computes the reference formula (context
projected into every layer's KV, the block [last, mask, …] attending non-causally to the
context and itself), the taps read the target layers' outputs without changing its logits,
and bad checkpoints are refused at launch naming what is wrong."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pipeserve  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from pipeserve.draft.dflash import load_dflash
from pipeserve.draft.mtp import target_forward
from pipeserve.model.tiny.dflash import ensure_dflash
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import startup_error


@pytest.fixture(scope="module")
def pair(model_cache: Path) -> tuple[Path, Path]:
    target = ensure_model("qwen3", "tiny", "float32", model_cache)
    return target, ensure_dflash(target)


def _rms(x: mx.array, w: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def test_generated_checkpoint_has_the_published_layout(pair) -> None:
    _, head = pair
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert set(cfg["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    names = set(mx.load(str(head / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)   # the target's are used


def test_one_block_is_the_reference_formula(pair) -> None:
    target_dir, head_dir = pair
    model, _ = mlx_lm.load(str(target_dir))
    head = load_dflash(head_dir, model)
    cfg = json.loads((head_dir / "config.json").read_text())
    w = mx.load(str(head_dir / "model.safetensors"))
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    hidden = mx.random.normal((1, 5, taps * model.args.hidden_size), key=mx.random.key(2))
    cache = head.make_cache()
    head.extend(hidden[:, :3], cache)   # the context may arrive in pieces
    head.extend(hidden[:, 3:], cache)
    got = head.draft(11, 4, cache)

    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = nn.RoPE(hd, base=cfg["rope_theta"])
    g = lambda name: w["layers.0." + name]   # noqa: E731

    def heads(x: mx.array, n: int) -> mx.array:
        return x.reshape(1, x.shape[1], n, hd).transpose(0, 2, 1, 3)

    ctx = _rms(hidden @ w["fc.weight"].T, w["hidden_norm.weight"])
    ids = mx.array([[11] + [cfg["dflash_config"]["mask_token_id"]] * 4], dtype=mx.uint32)
    x = model.model.embed_tokens(ids)
    xn = _rms(x, g("input_layernorm.weight"))
    q = rope(_rms(heads(xn @ g("self_attn.q_proj.weight").T, nh), g("self_attn.q_norm.weight")),
             offset=5)
    k = mx.concatenate([
        rope(_rms(heads(ctx @ g("self_attn.k_proj.weight").T, nkv), g("self_attn.k_norm.weight"))),
        rope(_rms(heads(xn @ g("self_attn.k_proj.weight").T, nkv), g("self_attn.k_norm.weight")),
             offset=5)], axis=2)
    v = mx.concatenate([heads(ctx @ g("self_attn.v_proj.weight").T, nkv),
                        heads(xn @ g("self_attn.v_proj.weight").T, nkv)], axis=2)
    k, v = mx.repeat(k, nh // nkv, axis=1), mx.repeat(v, nh // nkv, axis=1)
    att = mx.softmax((q @ k.transpose(0, 1, 3, 2)) * hd ** -0.5, axis=-1) @ v   # no mask
    h = x + att.transpose(0, 2, 1, 3).reshape(1, 5, -1) @ g("self_attn.o_proj.weight").T
    m = _rms(h, g("post_attention_layernorm.weight"))
    gate = m @ g("mlp.gate_proj.weight").T
    h = h + (gate * mx.sigmoid(gate) * (m @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
    logits = model.model.embed_tokens.as_linear(_rms(h, w["norm.weight"]))[:, 1:]
    assert got.tolist() == mx.argmax(logits, axis=-1)[0].tolist()


def test_taps_read_layer_outputs_and_leave_logits_unchanged(pair) -> None:
    target_dir, head_dir = pair
    model, _ = mlx_lm.load(str(target_dir))
    ids = mx.array([[3, 14, 15, 92, 65]], dtype=mx.uint32)
    before = model(ids)
    load_dflash(head_dir, model)
    logits, fused = target_forward(model, ids)
    assert mx.array_equal(logits, before).item()
    h = model.model.embed_tokens(ids)
    from mlx_lm.models.base import create_attention_mask
    mask = create_attention_mask(h, None)
    outs = []
    for layer in model.model.layers:
        h = layer(h, mask, None)
        outs.append(h)
    layer_ids = json.loads((head_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert mx.allclose(fused, mx.concatenate([outs[i] for i in layer_ids], axis=-1)).item()


def test_bad_checkpoints_are_refused(pair, tmp_path: Path, model_cache: Path) -> None:
    _, head_dir = pair
    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 40]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = startup_error(model_cache, "model=tiny", "draft=dflash", f"draft.path={bad}")
    assert "target_layer_ids [0, 40]" in msg
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = startup_error(model_cache, "model=tiny", "draft=dflash", f"draft.path={bad}")
    assert "not a DFlash drafter" in msg


def test_context_follows_kept_positions_and_restarts_after_a_gap(pair) -> None:
    """The proposer feeds a row's context only up to its input's position, in order, from
    pieces in any order; a gap in the positions starts the context over at the gap."""
    from types import SimpleNamespace

    from pipeserve.core.rows import RowStore
    from pipeserve.draft.dflash import DFlashProposer

    target_dir, head_dir = pair
    model, _ = mlx_lm.load(str(target_dir))
    head = load_dflash(head_dir, model)
    proposer = DFlashProposer.__new__(DFlashProposer)
    proposer.head, proposer.rows, proposer.kv = head, {}, RowStore(head.make_cache)
    req = SimpleNamespace(request_id="r")
    taps = mx.random.normal((1, 12, 2 * model.args.hidden_size), key=mx.random.key(4))

    def fresh(positions: slice, last: int, num: int) -> list[int]:
        cache = head.make_cache()
        head.extend(taps[:, positions], cache)
        return head.draft(last, num, cache).tolist()

    proposer.capture(req, 3, taps[:, 3:7])   # out of order, and past the input
    proposer.capture(req, 0, taps[:, 0:3])
    ctx = list(range(20, 26))   # input at position 5
    assert proposer.propose([req], [ctx], [3]) == [fresh(slice(0, 5), 25, 3)]
    assert proposer.rows["r"].end == 5 and proposer.rows["r"].pending[0][0] == 5
    proposer.capture(req, 9, taps[:, 9:11])   # positions 7 and 8 never came
    ctx = list(range(20, 31))   # input at position 10
    assert proposer.propose([req], [ctx], [2]) == [fresh(slice(9, 10), 30, 2)]
    proposer.release(req)
    assert proposer.kv.num_rows == 0 and "r" not in proposer.rows
