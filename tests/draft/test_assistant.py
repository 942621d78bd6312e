"""Gemma 4 assistant drafters (pipeserve/draft/assistant.py) in the layout mlx-vlm reads: the
generated checkpoint loads as mlx-vlm's Gemma4AssistantDraftModel, rows drafting together
(right-padded KV) draft what mlx-vlm's own round gives each alone, greedy output through the
engine equals draft=none serial and batched, and drafters that do not fit are refused at
launch naming why."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.speculative.mtp import _mtp_shared_kv_from_prompt_cache

import pipeserve  # noqa: F401  (loads OpenBLAS before mlx)
from pipeserve.core.events import Flush
from pipeserve.core.rows import RowStore
from pipeserve.draft.assistant import AssistantProposer, load_assistant
from pipeserve.errors import ConfigError
from pipeserve.model.tiny.assistant import ensure_assistant
from pipeserve.model.tiny.dflash import ensure_dflash
from pipeserve.model.tiny.eagle3 import ensure_eagle3
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import make_config, startup_error
from tests.draft.test_speculative import counter, prompts, run, wait_idle

LOGPROB_TOL = 1e-4   # a verify forward is wider than a decode step: the same sums, reordered


def assert_same_logprobs(got: list[dict], want: list[dict]) -> None:
    """The same tokens with the same logprobs (to float rounding) at every position."""
    for g, w in zip(got, want, strict=True):
        assert [t.token_id for t in g["logprobs"]] == [t.token_id for t in w["logprobs"]]
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(g["logprobs"], w["logprobs"]))
        assert diff <= LOGPROB_TOL, diff

GEMMA = ("model=tiny", "model.arch=gemma4")


@pytest.fixture(scope="module")
def pair(model_cache: Path) -> tuple[Path, Path]:
    target = ensure_model("gemma4", "tiny", "float32", model_cache)
    return target, ensure_assistant(target)


def test_generated_checkpoint_has_the_assistant_layout(pair) -> None:
    target, head = pair
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant"
    assert cfg["backbone_hidden_size"] == json.loads((target / "config.json").read_text())[
        "hidden_size"]
    text = cfg["text_config"]
    assert text["num_kv_shared_layers"] == text["num_hidden_layers"]   # every layer borrows KV
    names = set(mx.load(str(head / "model.safetensors")))
    assert {"pre_projection.weight", "post_projection.weight", "model.embed_tokens.weight",
            "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"} <= names
    assert not any(".k_proj" in n or ".v_proj" in n for n in names)   # no K/V of its own
    model, kind = load_drafter(str(head), kind="mtp")
    assert type(model).__name__ == "Gemma4AssistantDraftModel" and kind == "mtp"


def test_rows_drafting_together_draft_what_mlx_vlm_drafts_alone(pair) -> None:
    target_dir, head_dir = pair
    model, tok = mlx_lm.load(str(target_dir))
    texts = ["The morning train left the station at seven, and the",
             "A good server answers every request",
             "Rain fell on the roof all night. By dawn the streets were clean,"]
    proposer = AssistantProposer.__new__(AssistantProposer)
    proposer.head, proposer.layers = load_assistant(head_dir, model)
    proposer.dtype, proposer.rows = mx.float32, {}
    proposer.target_store = RowStore(model.make_cache)
    reqs, contexts, alone = [], [], []
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        prompt, nxt = ids[:-1], ids[-1]   # the KV holds the prompt; `nxt` is the next input
        cache = model.make_cache()
        hidden = model.model(mx.array([prompt]), cache)
        req = type("R", (), {"request_id": f"r{i}"})()
        proposer.target_store.adopt(req.request_id, cache)
        proposer.capture(req, 0, hidden)
        reqs.append(req)
        contexts.append(prompt + [nxt])
        # mlx-vlm's round on this row alone, over the same prompt cache
        ref, _ = load_drafter(str(head_dir), kind="mtp")
        ref.bind(model)
        n = len(prompt)
        ref.set_shared_kv(_mtp_shared_kv_from_prompt_cache(model, cache), n,
                          position=n - 1, kv_valid_len=n)
        greedy = lambda x: mx.argmax(x[:, -1:, :], axis=-1).astype(mx.int32)
        alone.append(ref.draft_block(nxt, hidden[:, -1:], None, 4, greedy).tolist()[0])
    together = proposer.propose(reqs, contexts, [3, 3, 3])
    assert together == alone
    assert proposer.propose(reqs[1:2], contexts[1:2], [2]) == [alone[1][:2]]
    # a row whose hidden state is not the one before its input drafts nothing
    assert proposer.propose(reqs[:1], [contexts[0] + [5]], [3]) == [[]]


@pytest.mark.parametrize("scheduler", ["serial", "continuous"])
def test_greedy_equals_plain_decode(engine_factory, scheduler: str) -> None:
    n = 1 if scheduler == "serial" else 3
    plain = engine_factory(*GEMMA, f"scheduler={scheduler}")
    expected = [g["ids"] for g in run(plain, n, logprobs=True)]
    spec = engine_factory(*GEMMA, f"scheduler={scheduler}", "draft=assistant")
    got = run(spec, n, logprobs=True)
    assert [g["ids"] for g in got] == expected
    assert_same_logprobs(got, run(plain, n, logprobs=True))
    proposed = counter(spec, "spec_proposed", "assistant")
    accepted = counter(spec, "spec_accepted", "assistant")
    assert 0 < accepted < proposed   # the generated assistant is right about half the time
    wait_idle(spec)


def test_drafters_that_do_not_fit_are_refused(pair, tmp_path: Path, model_cache: Path) -> None:
    _, head_dir = pair
    msg = startup_error(model_cache, "model=tiny", "draft=assistant", f"draft.path={head_dir}")
    assert "Gemma 4" in msg and "qwen3" in msg
    msg = startup_error(model_cache, *GEMMA, "draft=assistant", f"draft.path={tmp_path}")
    assert "config.json" in msg
    msg = startup_error(model_cache, *GEMMA, "draft=assistant", "kv=q8")
    assert "kv=q8" in msg and "kv=dense" in msg
    wide = tmp_path / "wide"
    shutil.copytree(head_dir, wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["backbone_hidden_size"] *= 2
    (wide / "config.json").write_text(json.dumps(cfg))
    msg = startup_error(model_cache, *GEMMA, "draft=assistant", f"draft.path={wide}")
    assert "hidden_size" in msg
    with pytest.raises(ConfigError, match="eagle3, dflash and assistant"):
        make_config("draft=ngram", f"draft.path={head_dir}")


def test_prompt_cache_hot_and_ssd_restore_keep_drafted_output(engine_factory,
                                                              tmp_path: Path) -> None:
    """A request served from a hot prompt cache, then from the SSD tier after a restart: the
    assistant reads the restored KV as it reads a computed one, and the output is the plain
    cold run's."""
    plain = engine_factory(*GEMMA, "cache=off")
    prompt = plain.loaded.tokenizer.encode("The morning train left the station at seven, and "
                                           "the passengers settled into their seats.")
    expected = plain.generate(prompt, max_tokens=24)["ids"]
    ssd = ["cache=ssd", f"cache.ssd.dir={tmp_path}", "draft=assistant"]
    first = engine_factory(*GEMMA, *ssd)
    assert first.generate(prompt, max_tokens=24)["ids"] == expected
    hot = first.generate(prompt, max_tokens=24)
    assert hot["cached"] > 0 and hot["ids"] == expected
    assert first.engine.command(Flush()).result(60)
    first.close()
    second = engine_factory(*GEMMA, *ssd)
    restored = second.generate(prompt, max_tokens=24)
    assert restored["cached"] > 0 and restored["ids"] == expected
    assert counter(second, "spec_accepted", "assistant") > 0


WINDOW = 8   # tokens a sliding-window layer keeps: fewer than any prompt, so its buffer wraps


@pytest.fixture(scope="module")
def sliding(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The generated Gemma 4 with a sliding-window layer (window WINDOW) and a full-attention
    one, as the released ones alternate them, and an assistant with one layer of each type
    (both the target's last layer run on the next token, one reading its sliding KV)."""
    root = tmp_path_factory.mktemp("sliding")
    target, head = root / "gemma4-sliding", root / "assistant"
    shutil.copytree(pair[0], target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    (target / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(pair[1], head)
    cfg = json.loads((head / "config.json").read_text())
    text = cfg["text_config"]
    text.update(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                num_kv_shared_layers=2, sliding_window=WINDOW)
    (head / "config.json").write_text(json.dumps(cfg))
    weights = mx.load(str(head / "model.safetensors"))
    weights |= {k.replace("layers.0.", "layers.1."): v for k, v in weights.items()
                if "layers.0." in k}
    mx.save_safetensors(str(head / "model.safetensors"), weights, metadata={"format": "pt"})
    return target, head


def test_sliding_window_layers_roll_back(engine_factory, sliding) -> None:
    """A Gemma 4 with a sliding-window layer whose window is smaller than every prompt: the
    ring buffer wraps before and during the drafted steps. draft=assistant (reading the sliding
    layer's KV too), draft=ngram and the hidden-state drafters (EAGLE-3, DFlash: generated
    heads) give draft=none's greedy tokens, a row alone and three rows batched (the
    assistant's rows accept raggedly; most other drafts are rejected here).
    Before: both were refused at launch."""
    target, head = sliding
    model = (*GEMMA, f"model.path={target}")
    plain = engine_factory(*model)
    alone, batched = run(plain, 1, max_tokens=24), run(plain, 3, max_tokens=24)
    assert all(len(p) > WINDOW for p in prompts(plain, 3))
    drafts = [["draft=assistant", f"draft.path={head}"], ["draft=ngram"],
              ["draft=eagle3", f"draft.path={ensure_eagle3(target)}"],
              ["draft=dflash", f"draft.path={ensure_dflash(target)}"]]
    for draft in drafts:
        spec = engine_factory(*model, *draft)
        assert [g["ids"] for g in run(spec, 1, max_tokens=24)] == [g["ids"] for g in alone]
        assert [g["ids"] for g in run(spec, 3, max_tokens=24)] == [g["ids"] for g in batched]
        name = draft[0].split("=")[1]
        proposed = counter(spec, "spec_proposed", name)
        accepted = counter(spec, "spec_accepted", name)
        assert accepted < proposed   # drafts were rejected: the rollback ran on wrapped buffers
        if name == "assistant":   # it reads the sliding layer's window: right some of the time
            assert accepted > 0
        wait_idle(spec)
