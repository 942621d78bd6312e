"""Speculative-decoding building blocks: n-gram proposer, greedy and sampling acceptance
(chi-square against the target distribution), and the MTP heads of Qwen3-Next (model=hybrid)
and Qwen3.5 (model=qwen) on the tiny models."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pipeserve  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_next

from pipeserve.draft.accept import PAD_ID, accept_greedy, accept_sampling, emitted_lists
from pipeserve.draft.mtp import MtpBlock, load_mtp, target_forward
from pipeserve.draft.ngram import NgramIndex
from pipeserve.model.tiny.text import VOCAB_SIZE, ensure_model

CHI2_DF7_CRIT = 29.8775  # chi-square, 7 degrees of freedom, upper tail 1e-4


# -- n-gram proposer -----------------------------------------------------------------------------
def _brute_propose(toks: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(min(n_max, len(toks)), n_min - 1, -1):
        suffix = toks[len(toks) - n:]
        for start in range(len(toks) - n - 1, -1, -1):
            if toks[start:start + n] == suffix:
                return toks[start + n:start + n + k]
    return []


def test_ngram_prefers_longest_then_latest_match() -> None:
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    idx = NgramIndex(1, 3)
    idx.extend(toks)
    assert idx.propose(3) == [4, 9, 2]          # trigram (1,2,3) at 0
    short = NgramIndex(1, 2)
    short.extend(toks)
    assert short.propose(3) == [5, 1, 2]        # latest earlier bigram (2,3) at 5
    assert short.propose(0) == []

    tail = NgramIndex(1, 3)
    tail.extend([5, 6, 5])
    assert tail.propose(10) == [6, 5]           # no more tokens exist after the match
    none = NgramIndex(2, 3)
    none.extend([1, 2, 3, 4])
    assert none.propose(4) == []
    with pytest.raises(ValueError, match="n_min=0"):
        NgramIndex(0, 3)


def test_ngram_incremental_matches_brute_force() -> None:
    rng = random.Random(7)
    toks = [rng.randrange(4) for _ in range(400)]
    idx = NgramIndex(1, 3)
    pos = 0
    while pos < len(toks):
        step = rng.randrange(1, 6)               # prompt, then ragged accepted runs
        idx.extend(toks[pos:pos + step])
        pos = min(pos + step, len(toks))
        assert idx.propose(5) == _brute_propose(toks[:pos], 5, 1, 3), pos


# -- greedy acceptance ---------------------------------------------------------------------------
def _onehot_logits(target_ids: list[list[int]], vocab: int = 16) -> mx.array:
    return mx.array(np.eye(vocab, dtype=np.float32)[np.array(target_ids)] * 5.0)


def test_greedy_ragged_rows_accept_0_to_k() -> None:
    t = [[1, 2, 3, 4, 5]] * 6
    drafts = [[9, 2, 3, 4],   # mismatch at 0
              [1, 2, 9, 4],   # mismatch at 2
              [1, 2, 3, 4],   # all 4 + bonus
              [1, 2, 3, 4],   # only 2 drafted: padding matches but is never accepted
              [1, 2, 3, 4],   # none drafted
              [1, 9, 3, 4]]   # accepted 1; a later match does not count
    num_draft = mx.array([4, 4, 4, 2, 0, 3])
    acc, emitted = accept_greedy(_onehot_logits(t), mx.array(drafts), num_draft)
    assert acc.tolist() == [0, 2, 4, 2, 0, 1]
    assert emitted_lists(acc, emitted) == [[1], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3], [1], [1, 2]]
    assert emitted[0, 1:].tolist() == [PAD_ID] * 4

    acc0, emitted0 = accept_greedy(_onehot_logits([[7], [3]]), mx.zeros((2, 0), mx.int32),
                                   mx.array([0, 0]))
    assert emitted_lists(acc0, emitted0) == [[7], [3]]


# -- sampling acceptance -------------------------------------------------------------------------
P = np.array([[0.05, 0.30, 0.10, 0.05, 0.20, 0.10, 0.15, 0.05],
              [0.20, 0.05, 0.05, 0.30, 0.05, 0.15, 0.10, 0.10],
              [0.10, 0.10, 0.25, 0.05, 0.05, 0.05, 0.30, 0.10]])
Q = np.array([[0.30, 0.05, 0.05, 0.30, 0.05, 0.15, 0.05, 0.05],
              [0.05, 0.30, 0.20, 0.05, 0.10, 0.10, 0.10, 0.10]])
N_ROWS = 20000


def _chi2(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _sample_batch(deterministic: bool, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if deterministic:
        drafts = np.tile([1, 3], (N_ROWS, 1))  # p(draft) = 0.3: most are rejected
    else:
        drafts = np.stack([rng.choice(8, size=N_ROWS, p=Q[i]) for i in range(2)], axis=1)
    num_draft = rng.integers(0, 3, size=N_ROWS)  # ragged: 0, 1 or 2 drafts
    p = mx.array(np.broadcast_to(P, (N_ROWS, 3, 8)).astype(np.float32))
    q = None if deterministic else mx.array(np.broadcast_to(Q, (N_ROWS, 2, 8)).astype(np.float32))
    keys = mx.random.split(mx.random.key(seed), N_ROWS)
    acc, emitted, _ = accept_sampling(p, q, mx.array(drafts), mx.array(num_draft), keys)
    return np.array(acc), np.array(emitted), num_draft


@pytest.mark.parametrize("deterministic", [True, False], ids=["ngram_drafts", "sampled_drafts"])
def test_sampling_emits_target_distribution(deterministic: bool) -> None:
    acc, emitted, num_draft = _sample_batch(deterministic, seed=11)
    assert (acc <= num_draft).all()
    assert (emitted[np.arange(N_ROWS), acc] >= 0).all()
    assert (emitted[:, :-1][np.arange(3)[None, :2] > acc[:, None]] == PAD_ID).all()
    # first token ~ p[0] whatever the draft; second token (rows that accepted the first) ~ p[1]
    assert _chi2(emitted[:, 0], P[0]) < CHI2_DF7_CRIT
    second = emitted[acc >= 1, 1]
    assert len(second) > 2000
    assert _chi2(second, P[1]) < CHI2_DF7_CRIT
    third = emitted[acc == 2, 2]                    # the bonus after two accepted drafts
    assert _chi2(third, P[2]) < CHI2_DF7_CRIT
    # the test has power: the draft distribution itself is rejected
    wrong = Q[0] if not deterministic else np.full(8, 1 / 8)
    assert _chi2(emitted[:, 0], wrong) > 10 * CHI2_DF7_CRIT


def test_sampling_streams_are_request_local() -> None:
    p = mx.softmax(mx.random.normal((6, 3, 8), key=mx.random.key(1)), axis=-1)
    drafts = mx.array([[1, 2]] * 6)
    num_draft = mx.array([2, 1, 0, 2, 2, 1])
    keys = mx.random.split(mx.random.key(5), 6)
    acc, emitted, next_keys = accept_sampling(p, None, drafts, num_draft, keys)
    for r in (0, 2, 5):  # the same row alone, with its own key: the same tokens and next key
        a1, e1, k1 = accept_sampling(p[r:r + 1], None, drafts[r:r + 1], num_draft[r:r + 1],
                                     [keys[r]])
        assert emitted_lists(a1, e1) == [emitted_lists(acc, emitted)[r]]
        assert mx.array_equal(k1[0], next_keys[r])
    assert not mx.array_equal(next_keys, keys)


# -- MTP head ------------------------------------------------------------------------------------
REAL_MTP_NAMES = {  # the released Qwen3-Next names (vLLM qwen3_next_mtp), dense MLP as the trunk
    "mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight", "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight", "mtp.layers.0.self_attn.v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.0.mlp.gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.0.mlp.down_proj.weight"}


@pytest.fixture(scope="module")
def hybrid(model_cache: Path) -> tuple[Path, Any, Any]:
    path = ensure_model("qwen3_next", "tiny", "float32", model_cache)
    model, tok = mlx_lm.load(str(path))
    return path, model, tok


def _prompt(tok: Any) -> mx.array:
    return mx.array(tok.encode("The morning train left the station at seven, and the"))[None]


def test_load_mtp_finds_head_only_where_shipped(hybrid: tuple[Path, Any, Any],
                                                model_cache: Path) -> None:
    path, model, _ = hybrid
    tensors = mx.load(str(path / "mtp.safetensors"))
    assert set(tensors) == REAL_MTP_NAMES
    assert tensors["mtp.fc.weight"].shape == (64, 128)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    head = load_mtp(path, model)
    assert head is not None and head.num_layers == 1

    qwen3 = ensure_model("qwen3", "tiny", "float32", model_cache)
    dense, _ = mlx_lm.load(str(qwen3))
    assert load_mtp(qwen3, dense) is None
    with pytest.raises(ValueError, match="model_type 'qwen3'"):
        load_mtp(path, dense)


def test_target_forward_logits_equal_model_call(hybrid: tuple[Path, Any, Any]) -> None:
    _, model, tok = hybrid
    ids = _prompt(tok)
    c1, c2 = model.make_cache(), model.make_cache()
    ref = model(ids, cache=c1)
    logits, hidden = target_forward(model, ids, c2)
    assert hidden.shape == (1, ids.shape[1], 64)
    assert mx.array_equal(logits, ref)
    for _ in range(2):  # decode steps through the caches
        nxt = mx.argmax(ref[:, -1:], axis=-1)
        ref = model(nxt, cache=c1)
        logits, _ = target_forward(model, nxt, c2)
        assert mx.array_equal(logits, ref)


def test_mtp_forward_is_deterministic_and_uses_its_inputs(hybrid: tuple[Path, Any, Any]) -> None:
    path, model, tok = hybrid
    ids = _prompt(tok)
    _, hidden = target_forward(model, ids)
    next_ids = mx.concatenate([ids[:, 1:], mx.array([[7]])], axis=1)
    head = load_mtp(path, model)
    logits, out = head(hidden, next_ids, head.make_cache())
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE) and out.shape == hidden.shape
    assert mx.isfinite(logits).all().item()
    again, _ = load_mtp(path, model)(hidden, next_ids, head.make_cache())
    assert mx.array_equal(logits, again)
    other, _ = head(hidden * 0.5, next_ids, head.make_cache())
    assert not mx.allclose(other[:, -1], logits[:, -1]).item()


def test_mtp_chains_three_drafts_through_its_cache(hybrid: tuple[Path, Any, Any]) -> None:
    path, model, tok = hybrid
    head = load_mtp(path, model)
    ids = _prompt(tok)
    n = ids.shape[1]
    logits, hidden = target_forward(model, ids)
    sampled = mx.argmax(logits[:, -1:], axis=-1)
    cache = head.make_cache()
    step_logits, g = head(hidden, mx.concatenate([ids[:, 1:], sampled], axis=1), cache)
    drafts, gs, chain = [], [], [step_logits[:, -1]]
    for _ in range(2):
        drafts.append(mx.argmax(chain[-1], axis=-1, keepdims=True))
        gs.append(g[:, -1:])
        step_logits, g = head(gs[-1], drafts[-1], cache)
        chain.append(step_logits[:, -1])
    assert cache[0].offset == n + 2

    # one forward over the same inputs gives the same three draft distributions
    fresh = head.make_cache()
    full, _ = head(mx.concatenate([hidden, *gs], axis=1),
                   mx.concatenate([ids[:, 1:], sampled, *drafts], axis=1), fresh)
    assert mx.allclose(full[0, -3:], mx.concatenate(chain), atol=1e-4).item()
    assert mx.argmax(full[0, -3:], axis=-1).tolist() == [
        mx.argmax(c, axis=-1).item() for c in chain]

    # rollback: trimming the last two entries and replaying gives the same logits
    cache[0].trim(2)
    replay, _ = head(gs[0], drafts[0], cache)
    assert mx.allclose(replay[:, -1], chain[1], atol=1e-5).item()


def test_mtp_raw_hugging_face_layout_matches_mlx_layout(tmp_path: Path) -> None:
    """A released (raw) checkpoint stores experts one tensor each and RMSNorm weights
    zero-centred; it loads to the same head as the converted layout."""
    cfg = json.loads((ensure_model("qwen3_next", "tiny", "float32", tmp_path / "m")
                      / "config.json").read_text())
    cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, norm_topk_prob=True)
    args = qwen3_next.ModelArgs.from_dict(cfg)
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    block = MtpBlock(args, num_layers=1, moe=True)
    converted = {}
    for i, (name, value) in enumerate(sorted(tree_flatten(block.parameters()))):
        if value.ndim == 1 and "norm" in name:   # pre_fc_norm_* too
            value = mx.full(value.shape, 1.0 + 0.125 * (i % 5))
        converted[f"mtp.{name}"] = value
    raw = {}
    for name, value in converted.items():
        if ".switch_mlp." in name:
            for e in range(4):
                raw[name.replace("switch_mlp.", f"experts.{e}.")] = value[e]
        else:
            raw[name] = _to_hf_norms(name, value)
    for sub, tensors in (("converted", converted), ("raw", raw)):
        (tmp_path / sub).mkdir()
        mx.save_safetensors(str(tmp_path / sub / "model-00002-of-00002.safetensors"), tensors)
    hidden = mx.random.normal((1, 5, 64), key=mx.random.key(3))
    ids = mx.array([[5, 9, 17, 33, 2]])
    heads = [load_mtp(tmp_path / sub, model) for sub in ("converted", "raw")]
    a, _ = heads[0](hidden, ids, heads[0].make_cache())
    b, _ = heads[1](hidden, ids, heads[1].make_cache())
    assert mx.array_equal(a, b)


# -- Qwen3.5 (model=qwen's stand-in and the released layout) -------------------------------------
@pytest.fixture(scope="module")
def qwen35(model_cache: Path) -> tuple[Path, Any, Any]:
    path = ensure_model("qwen3_5", "tiny", "float32", model_cache)
    model, tok = mlx_lm.load(str(path))
    return path, model, tok


def test_qwen35_stand_in_ships_its_head_beside_the_trunk(qwen35: tuple[Path, Any, Any]) -> None:
    """As in the released Qwen3.5 shards: mtp.* (Qwen3-Next's names) sit in model.safetensors,
    mlx-lm's sanitize drops them, draft=mtp reads them; the depth is text_config's."""
    path, model, tok = qwen35
    assert not (path / "mtp.safetensors").exists()
    tensors = mx.load(str(path / "model.safetensors"))
    assert {k for k in tensors if k.startswith("mtp.")} == REAL_MTP_NAMES
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["text_config"]["head_dim"] == 64   # every KV layout can quantize it
    head = load_mtp(path, model)
    assert head is not None and head.num_layers == 1
    ids = _prompt(tok)
    logits, hidden = target_forward(model, ids)
    assert mx.array_equal(logits, model(ids)) and hidden.shape == (1, ids.shape[1], 64)


def test_qwen35_stand_in_head_is_right_often_but_not_always(qwen35: tuple[Path, Any, Any]) -> None:
    """The head's first draft (from h[t] and token[t+1]) against the target's greedy token[t+2]
    on a greedy continuation: accepted most of the time, rejected some of the time, so verify
    exercises full, partial and no acceptance."""
    path, model, tok = qwen35
    head = load_mtp(path, model)
    ids = _prompt(tok)[0].tolist()
    cache = model.make_cache()
    logits = model(mx.array(ids)[None], cache=cache)
    for _ in range(64):
        ids.append(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([[ids[-1]]]), cache=cache)
    _, hidden = target_forward(model, mx.array(ids)[None])
    drafts, _ = head(hidden[:, :-1], mx.array(ids[1:])[None], head.make_cache())
    guess = mx.argmax(drafts[0], axis=-1).tolist()
    start = len(ids) - 64 - 1
    agree = sum(guess[t] == ids[t + 2] for t in range(start, len(ids) - 2)) / (len(ids) - 2 - start)
    assert 0.5 <= agree < 1.0, agree
    assert len(set(ids[-64:])) > 32   # the target does not loop


def _to_hf_norms(name: str, value: mx.array) -> mx.array:
    """mlx-lm layout -> Hugging Face's: zero-centred RMSNorm weights (not the gated norm)."""
    shifted = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
               ".q_norm.weight", ".k_norm.weight", "pre_fc_norm_embedding.weight",
               "pre_fc_norm_hidden.weight", "mtp.norm.weight")
    return value - 1.0 if value.ndim == 1 and name.endswith(shifted) else value


def test_qwen35_released_layout_loads_the_same_head(qwen35: tuple[Path, Any, Any],
                                                     tmp_path: Path) -> None:
    """A released Qwen3.5 checkpoint (trunk under model.language_model., conv1d (C, 1, K),
    zero-centred norms, sharded with an index, mtp.* in a shard) gives the same trunk and the
    same MTP head as the converted layout; a depth mismatch in text_config is refused."""
    path, _, tok = qwen35
    weights = dict(mx.load(str(path / "model.safetensors")))
    for i, name in enumerate(sorted(k for k in weights if k.startswith("mtp.") and "norm" in k)):
        weights[name] = mx.full(weights[name].shape, 1.0 + 0.125 * (i % 5))   # not all ones
    converted, raw = tmp_path / "converted", tmp_path / "raw"
    for d in (converted, raw):
        shutil.copytree(path, d)
    mx.save_safetensors(str(converted / "model.safetensors"), weights)
    hf = {}
    for name, value in weights.items():
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        value = _to_hf_norms(name, value)
        name = name.replace("language_model.model.", "model.language_model.")
        hf[name.replace("language_model.lm_head.", "lm_head.")] = value
    (raw / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in hf.items() if k.startswith("model.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in hf.items()
                                                   if not k.startswith("model.")}}
    for fname, part in shards.items():
        mx.save_safetensors(str(raw / fname), part)
    (raw / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))

    ids = _prompt(tok)
    outs = []
    for d in (converted, raw):
        model, _ = mlx_lm.load(str(d))
        logits, hidden = target_forward(model, ids)
        head = load_mtp(d, model)
        drafts, _ = head(hidden, mx.concatenate([ids[:, 1:], mx.array([[7]])], axis=1),
                         head.make_cache())
        outs.append((logits, drafts))
    assert mx.allclose(outs[0][0], outs[1][0], atol=1e-5).item()
    assert mx.allclose(outs[0][1], outs[1][1], atol=1e-5).item()

    cfg = json.loads((raw / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 2
    (raw / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="text_config.mtp_num_hidden_layers=2 but the checkpoint has 1"):
        load_mtp(raw, model)


def test_qwen35_moe_fused_experts_match_the_stacked_layout(qwen35: tuple[Path, Any, Any],
                                                            tmp_path: Path) -> None:
    """Qwen3.5-MoE stores the head's experts fused (experts.gate_up_proj (E, 2I, H),
    experts.down_proj (E, H, I)) with zero-centred norms; they load to the same head as
    mlx-lm's switch_mlp layout."""
    from mlx_lm.models import qwen3_5

    from pipeserve.draft.mtp import text_args
    cfg = json.loads((qwen35[0] / "config.json").read_text())
    cfg["model_type"] = "qwen3_5_moe"
    cfg["text_config"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    block = MtpBlock(text_args(model), num_layers=1, moe=True)
    converted = {}
    for i, (name, value) in enumerate(sorted(tree_flatten(block.parameters()))):
        if value.ndim == 1 and "norm" in name:
            value = mx.full(value.shape, 1.0 + 0.125 * (i % 5))
        converted[f"mtp.{name}"] = value
    raw = {k: _to_hf_norms(k, v) for k, v in converted.items() if ".switch_mlp." not in k}
    sw = "mtp.layers.0.mlp.switch_mlp."
    raw["mtp.layers.0.mlp.experts.gate_up_proj"] = mx.concatenate(
        [converted[sw + "gate_proj.weight"], converted[sw + "up_proj.weight"]], axis=-2)
    raw["mtp.layers.0.mlp.experts.down_proj"] = converted[sw + "down_proj.weight"]
    for sub, tensors in (("converted", converted), ("raw", raw)):
        (tmp_path / sub).mkdir()
        mx.save_safetensors(str(tmp_path / sub / "model-00002-of-00002.safetensors"), tensors)
    hidden = mx.random.normal((1, 5, 64), key=mx.random.key(3))
    ids = mx.array([[5, 9, 17, 33, 2]])
    heads = [load_mtp(tmp_path / sub, model) for sub in ("converted", "raw")]
    a, _ = heads[0](hidden, ids, heads[0].make_cache())
    b, _ = heads[1](hidden, ids, heads[1].make_cache())
    assert mx.array_equal(a, b)


# -- the draft model as a second runner ----------------------------------------------------------
def _greedy(model: Any, ctx: list[int], k: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    logits = model(mx.array(ctx, dtype=mx.uint32)[None], cache=cache)
    out: list[int] = []
    tok = mx.argmax(logits[:, -1], axis=-1)
    for _ in range(k):
        out.append(tok.item())
        tok = mx.argmax(model(tok[:, None].astype(mx.uint32), cache=cache)[:, -1], axis=-1)
    return out


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_draft_model_store_drafts_its_greedy_continuation_whatever_the_history(
        engine_factory, model_cache: Path, model: str) -> None:
    """draft=model over many rounds of ragged acceptance, rows that skip rounds, steps that draft
    nothing (rows far behind leave the batch and catch up by prompt chunks) and recurrent layers
    (hybrid: snapshot + replay): each proposal is the draft model's greedy continuation of the
    row's context computed from scratch, and released rows leave the draft store."""
    from tests.draft.test_speculative import ARCH, prompts
    path = ensure_model(ARCH[model], "tiny", "float32", model_cache)
    spec = engine_factory(f"model={model}", "draft=model", f"draft.path={path}",
                          "draft.num_draft_tokens=4", "scheduler.prefill_chunk=16")
    proposer = spec.engine.step.draft.proposer
    rng = random.Random(0)
    reqs = [spec.request(p, max_tokens=500) for p in prompts(spec, 3)]

    def grow(req: Any) -> None:
        req.output_ids += [rng.randrange(50, 200) for _ in range(rng.randrange(1, 12))]

    total = same = 0
    for _ in range(40):
        active = [r for r in reqs if rng.random() < 0.8]
        if rng.random() < 0.25:   # a step that drafts nothing: every row moves on
            active = []
        for r in reqs:
            if r not in active:
                grow(r)
        if not active:
            continue
        ctxs = [r.prompt_ids + r.output_ids for r in active]
        limits = [rng.randrange(1, 5) for _ in active]
        got = proposer.propose(active, ctxs, limits)
        for r, ctx, drafts, k in zip(active, ctxs, got, limits):
            total += 1
            same += drafts == _greedy(proposer.draft.model, ctx, k)
            a = rng.randrange(0, len(drafts) + 1)   # the target keeps a prefix + its own token
            r.output_ids += drafts[:a] + [rng.randrange(50, 200)]
            r.num_computed_tokens = len(ctx) + a
        proposer.settle(active)
    assert total > 50 and same >= 0.95 * total, (same, total)
    for r in reqs:
        proposer.release(r)
    assert proposer.kv.num_rows == 0 and proposer.held == {}
