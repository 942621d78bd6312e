"""EAGLE-3 heads (pipeserve/draft/eagle3.py) in the published checkpoint layout: the generated
checkpoint carries the reference names, a head step computes the published formula from the
raw tensors, SpecForge's `layers.0.` naming loads the same, the target's logits are unchanged
by the taps, and a checkpoint reading layers the target lacks is refused at launch."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pipeserve  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest

from pipeserve.draft.eagle3 import load_eagle3
from pipeserve.draft.mtp import target_forward
from pipeserve.model.tiny.eagle3 import ensure_eagle3
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import startup_error

PUBLISHED = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
             "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
             "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
             "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}


@pytest.fixture(scope="module")
def pair(model_cache: Path) -> tuple[Path, Path]:
    target = ensure_model("qwen3", "tiny", "float32", model_cache)
    return target, ensure_eagle3(target)


def _rms(x: mx.array, w: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def test_generated_checkpoint_has_the_published_layout(pair) -> None:
    _, head = pair
    names = set(mx.load(str(head / "model.safetensors")))
    assert names == PUBLISHED   # no embed_tokens: the target's is shared
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] < cfg["vocab_size"]
    assert len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3


def test_one_step_is_the_published_formula(pair) -> None:
    """Position 0 alone (attention over one entry is its value): logits from the raw tensors
    by the reference formula, draft ids mapped through d2t."""
    target_dir, head_dir = pair
    model, _ = mlx_lm.load(str(target_dir))
    head = load_eagle3(head_dir, model)
    w = mx.load(str(head_dir / "model.safetensors"))
    hidden = model.args.hidden_size
    taps = mx.random.normal((1, 1, 3 * hidden), key=mx.random.key(0))
    token = mx.array([[7]], dtype=mx.uint32)
    logits, out = head(taps, token, head.make_cache())
    g = lambda name: w["midlayer." + name]   # noqa: E731
    h = taps @ w["fc.weight"].T
    x = mx.concatenate([_rms(model.model.embed_tokens(token), g("input_layernorm.weight")),
                        _rms(h, g("hidden_norm.weight"))], axis=-1)
    r = h + (x @ g("self_attn.v_proj.weight").T) @ g("self_attn.o_proj.weight").T
    m = _rms(r, g("post_attention_layernorm.weight"))
    ref_out = r + (mx.sigmoid(m @ g("mlp.gate_proj.weight").T) * (m @ g("mlp.gate_proj.weight").T)
                   * (m @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
    ref_logits = _rms(ref_out, w["norm.weight"]) @ w["lm_head.weight"].T
    assert mx.allclose(out, ref_out, atol=1e-4).item()
    assert mx.allclose(logits, ref_logits, atol=1e-4).item()
    draft_id = int(mx.argmax(ref_logits[0, -1]).item())
    assert int(head.pick(logits[:, -1])[0].item()) == draft_id + int(w["d2t"][draft_id].item())


def test_specforge_naming_loads_the_same(pair, tmp_path: Path) -> None:
    target_dir, head_dir = pair
    renamed = tmp_path / "specforge"
    renamed.mkdir()
    shutil.copy(head_dir / "config.json", renamed / "config.json")
    w = mx.load(str(head_dir / "model.safetensors"))
    mx.save_safetensors(str(renamed / "model.safetensors"),
                        {k.replace("midlayer.", "layers.0."): v for k, v in w.items()})
    model, _ = mlx_lm.load(str(target_dir))
    a, b = load_eagle3(head_dir, model), load_eagle3(renamed, model)
    taps = mx.random.normal((1, 3, 3 * model.args.hidden_size), key=mx.random.key(1))
    ids = mx.array([[5, 9, 11]], dtype=mx.uint32)
    assert mx.array_equal(a(taps, ids, a.make_cache())[0], b(taps, ids, b.make_cache())[0]).item()


def test_taps_leave_the_target_logits_unchanged(pair) -> None:
    target_dir, head_dir = pair
    model, _ = mlx_lm.load(str(target_dir))
    ids = mx.array([[3, 14, 15, 92, 65]], dtype=mx.uint32)
    before = model(ids)
    load_eagle3(head_dir, model)   # installs the taps
    logits, fused = target_forward(model, ids)
    assert mx.array_equal(logits, before).item()
    assert mx.array_equal(model(ids), before).item()
    assert fused.shape == (1, 5, 3 * model.args.hidden_size)


def test_a_head_for_missing_layers_is_refused(pair, tmp_path: Path, model_cache: Path) -> None:
    _, head_dir = pair
    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 31]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = startup_error(model_cache, "model=tiny", "draft=eagle3", f"draft.path={bad}")
    assert "[0, 1, 31]" in msg and "eagle_aux_hidden_state_layer_ids" in msg
    msg = startup_error(model_cache, "model=tiny", "draft=eagle3", f"draft.path={tmp_path}")
    assert "config.json" in msg
