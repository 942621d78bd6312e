"""Several adapters at once (model.adapters), chosen per request (Request.adapter): in one
continuous batch mixing three adapters and the base model, every row's greedy output equals the
same request run alone and mlx-lm's own loop on `adapter_path=`; the prompt cache (RAM and SSD)
and checkpoints never serve one adapter's KV to another; DoRA cannot share a batch."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeserve.adapters.lora import AdapterSet, MultiLoRALinear
from pipeserve.prompt_cache.checkpoint import Checkpoints
from pipeserve.request import PromptInput, Request
from pipeserve.model.tiny.text import ensure_model
from pipeserve.core.events import Flush
from tests.conftest import startup_error
from tests.adapters.test_adapters import EOS_OFF, MAX_TOKENS, PROMPTS, reference, write_adapter
from tests.kv.test_kv_layouts import kv_config, layout_overrides  # noqa: F401 (fixture)

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
        assert h.engine.command(Flush()).result(60)
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
    from pipeserve.errors import NotFound

    h = engine_factory("scheduler=serial", f"model.adapter_dir={adapters}", "model.adapter=dora")
    assert h.loaded.adapters.merged and h.loaded.adapters.canonical("dora", "adapter") is None
    with pytest.raises(NotFound, match="merged into every row"):
        h.loaded.adapters.canonical("none", "adapter")
    got = _run(h, [PROMPTS[0]], [None])[0]["ids"]
    assert got == reference(h.loaded.path, adapters / "dora", PROMPTS[0])


def test_adapters_without_dir_and_none_id_are_refused(tmp_path: Path) -> None:
    from pipeserve.errors import ConfigError
    from tests.conftest import make_config

    with pytest.raises(ConfigError, match=r"model.adapters=\['a'\] needs model.adapter_dir"):
        make_config("model.adapters=[a]")
    with pytest.raises(ConfigError, match="cannot be called 'none'"):
        make_config(f"model.adapter_dir={tmp_path}", "model.adapters=[none]")
    with pytest.raises(ConfigError, match="is not an adapter id"):
        make_config(f"model.adapter_dir={tmp_path}", "model.adapters=[../x]")


# -- stacks: several adapters on one row, their deltas added -------------------------------
def _concatenated(root: Path, name: str, ids: list[str]) -> Path:
    """One mlx-lm adapter equal to the stack of `ids`: each layer's A side by side and B
    stacked (scaled by its adapter's scale; zeros where an adapter does not adapt the layer),
    rank the sum, scale 1 — what stacking computes, in the format mlx-lm loads."""
    import json

    import mlx.core as mx

    configs = [json.loads((root / i / "adapter_config.json").read_text()) for i in ids]
    weights = [mx.load(str(root / i / "adapters.safetensors")) for i in ids]
    ranks = [c["lora_parameters"]["rank"] for c in configs]
    widest = max(range(len(ids)), key=lambda k: (configs[k]["num_layers"],
                                                 "keys" not in configs[k]["lora_parameters"]))
    layers = sorted({n.rsplit(".", 1)[0] for w in weights for n in w})
    out: dict[str, mx.array] = {}
    for layer in layers:
        some = next(w for w in weights if f"{layer}.lora_a" in w)
        n_in, n_out = some[f"{layer}.lora_a"].shape[0], some[f"{layer}.lora_b"].shape[1]
        a_parts, b_parts = [], []
        for c, w, r in zip(configs, weights, ranks):
            if f"{layer}.lora_a" in w:
                a_parts.append(w[f"{layer}.lora_a"])
                b_parts.append(w[f"{layer}.lora_b"] * c["lora_parameters"]["scale"])
            else:
                a_parts.append(mx.zeros((n_in, r)))
                b_parts.append(mx.zeros((r, n_out)))
        out[f"{layer}.lora_a"] = mx.concatenate(a_parts, axis=1)
        out[f"{layer}.lora_b"] = mx.concatenate(b_parts, axis=0)
    config = dict(configs[widest])   # its layers cover every stacked adapter's (fixture)
    config["lora_parameters"] = {**config["lora_parameters"], "rank": sum(ranks), "scale": 1.0}
    dest = root.parent / f"{root.name}-oracle" / name
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), out)
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def test_stacked_rows_equal_the_concatenated_adapter_and_alone(engine_factory,
                                                                adapters: Path) -> None:
    """A row stacking a and b computes both deltas: its greedy output equals mlx-lm's on one
    adapter holding both (ranks concatenated), alone and in a batch beside single-adapter,
    base and other-stack rows, and it differs from a and b each."""
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=8", "cache=off",
                       f"model.adapter_dir={adapters}", "model.adapters=[a,b,c]")
    shared = h.loaded.adapters
    assert shared.canonical(["a", "b"], "adapter") == "a+b"
    assert shared.canonical(["c"], "adapter") == "c"
    assert shared.members("a+b") == ("a", "b") and shared.slots_of("a+b") == (1, 2)
    ab = _concatenated(adapters, "ab", ["a", "b"])
    abc = _concatenated(adapters, "abc", ["a", "b", "c"])
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[4], PROMPTS[2]]
    choices: list[str | None] = ["a+b", "c", "a+b+c", None, "b"]
    mixed = _mixed_calls(h)
    together = [g["ids"] for g in _run(h, prompts, choices)]
    assert any(len(set(s)) >= 3 for s in mixed)
    alone = [_run(h, [p], [c])[0]["ids"] for p, c in zip(prompts, choices)]
    assert together == alone
    assert together[0] == reference(h.loaded.path, ab, prompts[0])
    assert together[2] == reference(h.loaded.path, abc, prompts[2])
    p = prompts[0]
    assert together[0] not in (reference(h.loaded.path, adapters / "a", p),
                               reference(h.loaded.path, adapters / "b", p))


def test_bad_stacks_are_refused_naming_the_field() -> None:
    from pipeserve.adapters.lora import Adapter
    from pipeserve.errors import InvalidRequest, NotFound

    def fake(i: str) -> Adapter:
        return Adapter(id=i, path=Path(i), digest="0" * 16, fine_tune_type="lora", rank=2,
                       scale=1.0, num_layers=1, target_modules=(), nbytes=0)
    shared = AdapterSet([fake("a"), fake("b")], None)
    for bad, error in [([], InvalidRequest), (["a", "a"], InvalidRequest),
                       (["a", "none"], InvalidRequest), (["a", 3], InvalidRequest),
                       (["a"] * 9, InvalidRequest), (["a", "nope"], NotFound)]:
        with pytest.raises(error) as info:
            shared.canonical(bad, "adapter")
        assert info.value.param == "adapter"
    assert shared.identity("b+a") == "b@" + "0" * 16 + "+a@" + "0" * 16
    # a request that finishes after its adapter was unmounted and the slot reused (a remount
    # under way): its record names the id, and settling its stream does not raise
    shared.adapters = {"b": shared.adapters["b"]}
    assert shared.identity("b+a") == "b@" + "0" * 16 + "+a"


# -- adapters compose with every KV layout and with speculative decoding --------------------
@pytest.fixture(scope="module")
def small_adapters(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """Adapters for the small model (head_dim 64: every quantized layout takes it)."""
    base = ensure_model("qwen3", "small", "float32", model_cache)
    root = tmp_path_factory.mktemp("small-adapters")
    write_adapter(root, "a", base, rank=4, num_layers=2, seed=0)
    write_adapter(root, "b", base, rank=8, num_layers=1, seed=2,
                  keys=["self_attn.q_proj", "self_attn.v_proj"])
    write_adapter(root, "c", base, rank=2, num_layers=2, seed=3,
                  keys=["self_attn.o_proj", "mlp.down_proj"])
    return root


@pytest.mark.parametrize("kv", ["q8", "q4", "turbo", "mixed", "paged"])
def test_mixed_adapter_batch_in_every_kv_layout(engine_factory, small_adapters: Path,
                                                kv_config: Path, kv: str) -> None:
    """In each KV layout, rows of different adapters (and a stack) batched together give what
    each gives alone in that layout, and the adapters still change the output."""
    h = engine_factory("model=tiny", "model.size=small", *layout_overrides(kv, kv_config),
                       "scheduler=continuous", "scheduler.max_batch=8", "cache=off",
                       f"model.adapter_dir={small_adapters}", "model.adapters=[a,b,c]")
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0], PROMPTS[4]]
    choices: list[str | None] = ["a", "b+c", None, "c"]
    together = [g["ids"] for g in _run(h, prompts, choices)]
    alone = [_run(h, [p], [c])[0]["ids"] for p, c in zip(prompts, choices)]
    assert together == alone
    base = [_run(h, [p], [None])[0]["ids"] for p in prompts]
    assert together[0] != base[0] and together[1] != base[1]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculation_with_mixed_adapters_is_lossless(engine_factory, adapters: Path,
                                                     model_cache: Path, draft: str) -> None:
    """Speculative decoding beside adapters: verify runs each row with its own adapter (and
    stack), so greedy output equals the plain path row for row."""
    common = ["scheduler=continuous", "scheduler.max_batch=8", "cache=off",
              f"model.adapter_dir={adapters}", "model.adapters=[a,b,c]"]
    plain = engine_factory(*common)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], PROMPTS[3], PROMPTS[1], PROMPTS[4]]
    choices: list[str | None] = ["a", "b+c", None, "c"]
    expected = [g["ids"] for g in _run(plain, prompts, choices)]
    extra = (["draft=ngram"] if draft == "ngram" else   # the base model drafts, unadapted
             ["draft=model", f"draft.path={ensure_model('qwen3', 'tiny', 'float32', model_cache)}"])
    spec = engine_factory(*common, *extra)
    assert [g["ids"] for g in _run(spec, prompts, choices)] == expected
    assert spec.metrics.spec_verifies.labels(draft)._value.get() > 0   # it really drafted
