"""KV layouts through the real engine (SPEC §7): q4/q8 equal mlx-lm's quantized KV cache;
every layout decodes batched exactly as it does alone (rows converting at their own
quantized_start boundary included); every layout survives a prompt-cache hit and an SSD
restore with identical tokens; admission bills each layout at its true bytes per token."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from pipeserve.errors import ConfigError
from pipeserve.model.tiny.text import ensure_model
from pipeserve.core.events import Flush
from tests.conftest import EngineHarness, make_config
from tests.conftest import startup_error as engine_startup_error
from tests.core.test_batching import wait_idle

SMALL = ["model=tiny", "model.size=small"]   # head_dim 64: quantizable in groups of 64
TEXT = ("A good server answers every request quickly, streams tokens as soon as they are ready, "
        "and never blocks the event loop. When the queue is full it says so politely. ") * 2
EOS_OFF = {0: -1e9, 2: -1e9}


def prompts(h: EngineHarness, n: int) -> list[list[int]]:
    ids = h.loaded.tokenizer.encode(TEXT)
    return [ids[:len(ids) - 9 * i] for i in range(n)]


def run(h: EngineHarness, n: int, max_tokens: int = 24) -> list[dict]:
    reqs = [h.request(p, max_tokens=max_tokens, logit_bias=EOS_OFF) for p in prompts(h, n)]
    return asyncio.run(h.generate_many(reqs))


@pytest.fixture(scope="module")
def kv_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kvcfg") / "kv_config.json"
    path.write_text(json.dumps({"group_size": 64, "default": {"k_bits": 8, "v_bits": 8},
                                "layers": {"0": "dense", "3": {"k_bits": 8, "v_bits": 4},
                                           "7": {"k_bits": 4, "v_bits": 4}}}))
    return path


def layout_overrides(name: str, kv_config: Path) -> list[str]:
    return {"q8": ["kv=q8"], "q4": ["kv=q4"], "turbo": ["kv=turbo"],
            "turbo-k4v4": ["kv=turbo", "kv.k_bits=4", "kv.v_bits=4"],
            "paged": ["kv=paged", "kv.block_size=16", "kv.pool_blocks=256"],
            "q8-delayed": ["kv=q8", "kv.quantized_start=56"],
            "turbo-delayed": ["kv=turbo", "kv.quantized_start=56"],
            "mixed": ["kv=mixed", f"kv.config_path={kv_config}"],
            "q8+ngram": ["kv=q8", "draft=ngram"]}[name]


LAYOUTS = ["q8", "q4", "turbo", "turbo-k4v4", "paged", "q8-delayed", "turbo-delayed", "mixed"]


@pytest.mark.parametrize("bits", [8, 4])
def test_serial_greedy_equals_mlx_lm_quantized_kv(engine_factory, model_cache: Path,
                                                  bits: int) -> None:
    h = engine_factory(*SMALL, "scheduler=serial", f"kv=q{bits}")
    prompt = prompts(h, 1)[0]
    got = h.generate(prompt, max_tokens=24, logit_bias=EOS_OFF)["ids"]
    model, _ = mlx_load(str(ensure_model("qwen3", "small", "float32", model_cache)))
    from mlx_lm.sample_utils import make_logits_processors
    procs = make_logits_processors(logit_bias=EOS_OFF)
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=24, kv_bits=bits,
                                        kv_group_size=64, quantized_kv_start=0,
                                        logits_processors=procs)]
    assert got == ref
    dense = engine_factory(*SMALL, "scheduler=serial").generate(prompt, max_tokens=24,
                                                                logit_bias=EOS_OFF)["ids"]
    if bits == 4:
        assert got != dense   # the comparison can fail: q4 really changes the arithmetic


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_equals_alone(engine_factory, kv_config: Path, layout: str) -> None:
    """Rows of different lengths (crossing quantized_start at different steps) in one batch
    give each row's own serial output."""
    kv = layout_overrides(layout, kv_config)
    serial = engine_factory(*SMALL, "scheduler=serial", *kv)
    expected = [g["ids"] for g in run(serial, 4)]
    batched = engine_factory(*SMALL, "scheduler=continuous", *kv)
    got = run(batched, 4)
    assert [g["ids"] for g in got] == expected
    assert batched.metrics.batch_size._sum.get() > 4 * 10   # really shared steps
    if "delayed" in layout:   # every row passed 56 tokens: one conversion each
        assert batched.metrics.kv_conversions._value.get() == pytest.approx(4)
    wait_idle(batched)


@pytest.mark.parametrize("layout", ["q8", "turbo", "paged", "q8-delayed", "mixed"])
def test_prompt_cache_hit_and_ssd_restore_give_identical_tokens(
        engine_factory, kv_config: Path, tmp_path: Path, layout: str) -> None:
    kv = layout_overrides(layout, kv_config)
    ssd = ["cache=ssd", f"cache.ssd.dir={tmp_path}"]
    first = engine_factory(*SMALL, *ssd, *kv)
    prompt = prompts(first, 1)[0]
    cold = first.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    hot = first.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    assert hot["cached"] > 0 and hot["ids"] == cold["ids"]
    assert first.engine.command(Flush()).result(60)   # every entry durable, as at shutdown
    first.close()
    second = engine_factory(*SMALL, *ssd, *kv)
    restored = second.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    assert restored["cached"] > 0 and restored["ids"] == cold["ids"]
    assert second.metrics.cache_hits.labels("ssd")._value.get() == 1


def test_each_layout_is_billed_at_its_bytes_per_token(engine_factory, kv_config: Path) -> None:
    """bf16 weights computed in bf16: q8 ≈ 0.53x, q4 ≈ 0.28x, turbo k8v3 ≈ 0.36x of dense."""
    bf16 = [*SMALL, "model.dtype=bfloat16", "model.compute_dtype=checkpoint"]
    per_token = {}
    for name, kv in [("dense", ["kv=dense"]), ("q8", ["kv=q8"]), ("q4", ["kv=q4"]),
                     ("turbo", ["kv=turbo"]), ("paged", ["kv=paged", "kv.pool_blocks=8"])]:
        h = engine_factory(*bf16, "cache=off", *kv)
        per_token[name] = h.engine.memory.kv_bytes_per_token
        h.close()
    ratio = {k: v / per_token["dense"] for k, v in per_token.items()}
    assert ratio["q8"] == pytest.approx(0.53125, abs=0.005)
    assert ratio["q4"] == pytest.approx(0.28125, abs=0.005)
    assert ratio["turbo"] == pytest.approx(0.367, abs=0.01)
    assert ratio["paged"] == 1.0


@pytest.mark.parametrize("layout", ["dense", "q8", "q4", "turbo"])
def test_held_kv_bytes_match_the_arithmetic(engine_factory, kv_config: Path,
                                            layout: str) -> None:
    """The prompt cache holds a 512-token prefix at the layout's true size (bytes from the
    arrays themselves, not from the formula)."""
    kv = ["kv=dense"] if layout == "dense" else layout_overrides(layout, kv_config)
    h = engine_factory(*SMALL, "model.dtype=bfloat16", "model.compute_dtype=checkpoint", *kv)
    ids = (h.loaded.tokenizer.encode(TEXT) * 20)[:513]
    h.generate(ids, max_tokens=1)
    entry = next(iter(h.engine.prompt_cache.entries.values()))
    tokens = len(entry.tokens)
    held = sum(c.nbytes for c in entry.caches) / tokens
    billed = h.engine.memory.kv_bytes_per_token
    # storage grows in steps of 256 tokens: at most one step of slack
    assert billed <= held <= billed * (tokens + 256) / tokens


def test_layout_refusals(model_cache: Path, kv_config: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv is selected twice"):
        make_config("kv=turbo", "kv=paged")
    with pytest.raises(ConfigError, match="kv.v_bits must be one of 2, 3, 4, 5, 8"):
        make_config("kv=turbo", "kv.v_bits=6")
    with pytest.raises(ConfigError, match="kv.k_bits must be one of 2, 4, 5, 8"):
        make_config("kv=turbo", "kv.k_bits=3")

    def startup_error(*overrides: str) -> str:
        return engine_startup_error(model_cache, *overrides)

    # the tiny model's head_dim 16 is smaller than any quantization group
    assert "head_dim 16 is not a multiple" in startup_error("kv=q8")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": {"5": {"k_bits": 8, "v_bits": 7}}}))
    assert "layer 5 v_bits=7" in startup_error(*SMALL, "kv=mixed", f"kv.config_path={bad}")
    bad.write_text(json.dumps({"layers": {"40": "dense"}}))
    assert "layer 40 is not a full-attention layer" in startup_error(
        *SMALL, "kv=mixed", f"kv.config_path={bad}")


def test_paged_rows_and_cache_share_one_pool(engine_factory) -> None:
    """Two requests with one long common prefix: the second is lent the first's cached
    blocks (shared, not copied); when rows need blocks the pool lacks, cached prefixes give
    theirs back; a request larger than the whole pool is refused up front."""
    h = engine_factory(*SMALL, "kv=paged", "kv.block_size=16", "kv.pool_blocks=24")
    layout = h.engine.layout
    ids = h.loaded.tokenizer.encode(TEXT)[:150]
    first = h.generate(ids + [40, 41], max_tokens=8, logit_bias=EOS_OFF)
    shared_before = layout.stats()["shared"]
    second = h.generate(ids + [50, 51], max_tokens=8, logit_bias=EOS_OFF)
    assert second["cached"] >= 144
    stats = layout.stats()
    # 8 layers × (the 9 full 16-token blocks of the common prefix) held by both entries
    assert stats["shared"] - shared_before >= 8 * 9
    assert stats["used"] + stats["free"] == 8 * 24
    cold = engine_factory(*SMALL, "kv=dense", "cache=off")
    assert second["ids"] == cold.generate(ids + [50, 51], max_tokens=8,
                                          logit_bias=EOS_OFF)["ids"]
    assert first["ids"] == cold.generate(ids + [40, 41], max_tokens=8,
                                         logit_bias=EOS_OFF)["ids"]
    # a different long prompt needs more blocks than are free: cached entries give way
    other = list(reversed(h.loaded.tokenizer.encode(TEXT * 2)))[:250]   # 16 blocks; 13 free
    evictions = h.metrics.cache_evictions.labels("ram")._value.get()
    third = h.generate(other, max_tokens=8, logit_bias=EOS_OFF)
    assert third["ids"] == cold.generate(other, max_tokens=8, logit_bias=EOS_OFF)["ids"]
    assert h.metrics.cache_evictions.labels("ram")._value.get() > evictions
    # larger than the whole pool (24 blocks × 16 tokens = 384 tokens): refused, not cut short
    from pipeserve.errors import MemoryAdmissionError
    from pipeserve.request import Requested
    from pipeserve.stages.admission import Admission
    adm = Admission(h.cfg, h.engine.limits, h.engine.load, h.metrics)
    req = h.request(ids * 3, max_tokens=8)
    req.requested = Requested(max_tokens=8)
    with pytest.raises(MemoryAdmissionError, match=r"whole paged pool holds \(384 tokens\)"):
        asyncio.run(adm(req))
    wait_idle(h)


@pytest.mark.parametrize("layout", ["q8", "turbo", "paged", "q8-delayed", "q8+ngram"])
def test_checkpoint_resume_gives_the_cold_run_tokens(engine_factory, kv_config: Path,
                                                     tmp_path: Path, layout: str) -> None:
    """Cancelled mid-generation (the checkpoint stays), restarted, the identical request
    resumes from its checkpoint and ends exactly as an uninterrupted run of that layout."""
    kv = layout_overrides(layout, kv_config)
    ssd = ["cache=ssd", f"cache.ssd.dir={tmp_path}", "cache.checkpoint_every=8"]
    plain = engine_factory(*SMALL, "cache=off", *kv)
    prompt = prompts(plain, 1)[0]
    sampling = dict(max_tokens=48, temperature=0.8, seed=7, logit_bias=EOS_OFF)
    expected = plain.generate(prompt, **sampling)["ids"]
    first = engine_factory(*SMALL, *ssd, *kv)

    async def interrupted() -> dict:
        req = first.request(prompt, **sampling)
        task = asyncio.ensure_future(first.generate_many([req]))
        for _ in range(3000):   # bounded: until two checkpoints were written
            if first.metrics.checkpoint_writes._value.get() >= 2:
                break
            await asyncio.sleep(0.01)
        first.engine.abort(req.request_id)
        return (await task)[0]

    partial = asyncio.run(interrupted())
    assert partial["finish"] == "abort" and len(partial["ids"]) < 48
    assert first.engine.command(Flush()).result(60)
    first.close()
    second = engine_factory(*SMALL, *ssd, *kv)
    resumed = second.generate(prompt, **sampling)
    assert second.metrics.checkpoint_resumes._value.get() == 1
    assert resumed["ids"] == expected


def test_converted_prefixes_are_never_reused_below_their_boundary(engine_factory) -> None:
    """kv.quantized_start: a cached row that converted after its 59-token prompt holds
    quantized KV for all 59; a request sharing only 50 of them must not borrow it (a cold run
    would still be dense there), while one sharing all of them does."""
    h = engine_factory(*SMALL, "kv=q8", "kv.quantized_start=40")
    ids = h.loaded.tokenizer.encode(TEXT)
    donor = ids[:60]
    h.generate(donor, max_tokens=4, logit_bias=EOS_OFF)
    short = ids[:50] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    got = h.generate(short, max_tokens=12, logit_bias=EOS_OFF)
    assert got["cached"] == 0
    cold = engine_factory(*SMALL, "kv=q8", "kv.quantized_start=40", "cache=off")
    assert got["ids"] == cold.generate(short, max_tokens=12, logit_bias=EOS_OFF)["ids"]
    longer = donor + [21, 22, 23]
    assert h.generate(longer, max_tokens=4, logit_bias=EOS_OFF)["cached"] >= 59


def test_sliding_window_layers_stay_dense_with_one_warning(engine_factory, caplog) -> None:
    from mlx_lm.models.cache import RotatingKVCache
    with caplog.at_level("WARNING", logger="pipeserve"):
        h = engine_factory("model=gemma", "kv=turbo")
    warnings = [r for r in caplog.records if "sliding-window layer(s) stay dense" in r.message]
    assert len(warnings) == 1
    caches = h.engine.layout.make_cache(h.loaded.model)
    kinds = {type(c) for c in caches}
    assert RotatingKVCache in kinds
    assert any(getattr(c, "target_layout", "").endswith("TurboKVCache") for c in caches)
    got = h.generate([5, 6, 7, 8, 9], max_tokens=8, logit_bias={0: -1e9, 1: -1e9, 2: -1e9})
    assert len(got["ids"]) == 8 and got["finish"] == "length"


def test_paged_rows_are_billed_in_whole_blocks(engine_factory) -> None:
    """Admission reserves what a paged row really takes: whole blocks, not exact tokens."""
    h = engine_factory("kv=paged", "kv.block_size=16", "kv.pool_blocks=64", "cache=off")
    mem = h.engine.memory
    assert mem.kv_bytes(17) == mem.kv_bytes(32) == 2 * mem.kv_bytes(16)
    dense = engine_factory("kv=dense", "cache=off").engine.memory
    assert dense.kv_bytes(17) < dense.kv_bytes(32)
