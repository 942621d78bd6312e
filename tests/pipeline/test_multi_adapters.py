"""Several adapters at once (model.adapters), chosen per request (Request.adapter): in one
continuous batch mixing three adapters and the base model, every row's greedy output equals the
same request run alone and mlx-lm's own loop on `adapter_path=`; the prompt cache (RAM and SSD)
and checkpoints never serve one adapter's KV to another; DoRA cannot share a batch."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.adapters import AdapterSet, MultiLoRALinear
from pipeline.prompt_cache.checkpoint import Checkpoints
from pipeline.request import PromptInput, Request
from pipeline.tiny import ensure_model
from tests.conftest import startup_error
from tests.pipeline.test_adapters import EOS_OFF, MAX_TOKENS, PROMPTS, reference, write_adapter

IDS = ["a", "b", "c"]


@pytest.fixture
def adapters(tmp_path: Path, model_cache: Path) -> Path:
    """Three LoRA adapters of different ranks on different layers (padding and gaps in the
    stacks), and a DoRA one."""
    base = ensure_model("qwen3", "tiny", "float32", model_cache)
    root = tmp_path / "adapters"
    write_adapter(root, "a", base, rank=4, num_layers=2, seed=0)
    write_adapter(root, "b", base, rank=8, num_layers=1, seed=2,
                  keys=["self_attn.q_proj", "self_attn.v_proj"])
    write_adapter(root, "c", base, rank=2, num_layers=2, seed=3,
                  keys=["self_attn.o_proj", "mlp.down_proj"])
    write_adapter(root, "dora", base, dora=True, rank=2, num_layers=1, seed=1)
    return root


def _run(h, prompts: list[list[int]], choices: list[str | None]) -> list[dict]:
    reqs = []
    for p, choice in zip(prompts, choices):
        req = h.request(p, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)
        req.adapter = choice
        reqs.append(req)
    return asyncio.run(h.generate_many(reqs))


def _mixed_calls(h) -> list[list[int]]:
    """Record the slots of every model call whose rows had different adapters."""
    seen: list[list[int]] = []
    adapters = h.loaded.adapters
    select = adapters.select

    def spy(slots: list[int]) -> None:
        if len(set(slots)) > 1:
            seen.append(list(slots))
        select(slots)
    adapters.select = spy
    return seen


def test_mixed_batch_rows_equal_alone_and_mlx_lm(engine_factory, adapters: Path) -> None:
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=8", "cache=off",
                       f"model.adapter_dir={adapters}", "model.adapters=[a,b,c]")
    assert isinstance(h.loaded.adapters, AdapterSet) and h.loaded.adapters.ids == IDS
    assert h.loaded.adapter is None   # no model.adapter: requests naming none run the base
    assert any(isinstance(m, MultiLoRALinear) for _, m in h.loaded.model.named_modules())
    prompts = PROMPTS + [[5, 6, 7, 8], [200 + i for i in range(20)], [9, 9, 9]]
    choices: list[str | None] = ["a", "b", "none", "c", None, "c", "b", "a"]
    mixed = _mixed_calls(h)
    together = [g["ids"] for g in _run(h, prompts, choices)]
    assert h.metrics.batch_size._sum.get() > len(prompts) * 2   # really ran batched
    assert any(len(set(s)) >= 3 for s in mixed)   # rows of several adapters in one forward
    alone = [_run(h, [p], [c])[0]["ids"] for p, c in zip(prompts, choices)]
    assert together == alone
    for p, c, got in zip(prompts, choices, together):
        name = None if c in (None, "none") else c
        assert got == reference(h.loaded.path, adapters / name if name else None, p), (c, p)
    base = {tuple(p): reference(h.loaded.path, None, p) for p in prompts}
    assert all(got != base[tuple(p)] for p, c, got in zip(prompts, choices, together)
               if c not in (None, "none"))   # every adapter really applies


def test_serial_each_adapter_equals_mlx_lm(engine_factory, adapters: Path) -> None:
    """model.adapter=b is the default beside model.adapters; "none" runs the base model."""
    h = engine_factory("scheduler=serial", f"model.adapter_dir={adapters}",
                       "model.adapter=b", "model.adapters=[a,c]")
    assert h.loaded.adapter.id == "b" and h.loaded.adapters.ids == ["b", "a", "c"]
    prompt = PROMPTS[1]
    for choice, name in [(None, "b"), ("a", "a"), ("c", "c"), ("b", "b"), ("none", None)]:
        got = _run(h, [prompt], [choice])[0]["ids"]
        assert got == reference(h.loaded.path, adapters / name if name else None, prompt), choice


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_prompt_cache_never_hits_across_adapters(engine_factory, adapters: Path,
                                                 tmp_path: Path, tier: str) -> None:
    cache = ["cache=ram"] if tier == "ram" else ["cache=ssd", f"cache.ssd.dir={tmp_path / 'ssd'}"]
    h = engine_factory(*cache, f"model.adapter_dir={adapters}", "model.adapters=[a,b]")
    prompt = PROMPTS[3]
    first = _run(h, [prompt], ["a"])[0]
    assert first["cached"] == 0
    other = _run(h, [prompt], ["b"])[0]
    assert other["cached"] == 0 and other["ids"] == reference(h.loaded.path, adapters / "b", prompt)
    base = _run(h, [prompt], ["none"])[0]
    assert base["cached"] == 0 and base["ids"] == reference(h.loaded.path, None, prompt)
    again = _run(h, [prompt], ["a"])[0]
    assert again["cached"] > 0 and again["ids"] == first["ids"]
    if tier == "ssd":   # from disk too: a fresh engine on the same directory
        assert h.engine.flush_cache().wait(60)
        h.close()
        h2 = engine_factory(*cache, f"model.adapter_dir={adapters}", "model.adapters=[a,b]")
        got = _run(h2, [prompt], ["b"])[0]
        assert got["cached"] > 0 and h2.metrics.cache_hits.labels("ssd")._value.get() > 0
        assert got["ids"] == other["ids"]


def test_checkpoint_identity_names_the_adapter() -> None:
    cp = Checkpoints(None, 4, {"identity": "x"})   # identity() reads only the request
    reqs = [Request(request_id=str(i), endpoint="test", inputs=PromptInput(token_ids=[1, 2]),
                    prompt_ids=[1, 2], adapter=a) for i, a in enumerate([None, "a", "b", "none"])]
    assert len({cp.identity(r) for r in reqs}) == 4


def test_dora_beside_other_adapters_is_refused(adapters: Path, model_cache: Path) -> None:
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapters=[a,dora]")
    assert "dora is a DoRA adapter; DoRA can be mounted only alone" in msg


def test_dora_alone_still_serves_and_other_choices_are_refused(engine_factory,
                                                               adapters: Path) -> None:
    from pipeline.errors import NotFound

    h = engine_factory("scheduler=serial", f"model.adapter_dir={adapters}", "model.adapter=dora")
    assert h.loaded.adapters.merged and h.loaded.adapters.canonical("dora", "adapter") is None
    with pytest.raises(NotFound, match="merged into every row"):
        h.loaded.adapters.canonical("none", "adapter")
    got = _run(h, [PROMPTS[0]], [None])[0]["ids"]
    assert got == reference(h.loaded.path, adapters / "dora", PROMPTS[0])


def test_adapters_without_dir_and_none_id_are_refused(tmp_path: Path) -> None:
    from pipeline.errors import ConfigError
    from tests.conftest import make_config

    with pytest.raises(ConfigError, match=r"model.adapters=\['a'\] needs model.adapter_dir"):
        make_config("model.adapters=[a]")
    with pytest.raises(ConfigError, match="cannot be called 'none'"):
        make_config(f"model.adapter_dir={tmp_path}", "model.adapters=[none]")
    with pytest.raises(ConfigError, match="is not an adapter id"):
        make_config(f"model.adapter_dir={tmp_path}", "model.adapters=[../x]")
