"""LoRA/DoRA adapters mounted at launch (model.adapter): greedy output through the engine equals
mlx-lm's own generate loop on the model loaded with `adapter_path=`, serial and batched, and
differs from the base model's; bad adapters fail the launch naming the adapter, the layer and
the shapes; the prompt cache never serves KV across adapters (RAM identity and SSD tier)."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

from pipeserve.adapters.lora import LEAVES
from pipeserve.errors import ConfigError
from pipeserve.core.step import cache_identity
from pipeserve.model.tiny.text import ensure_model
from pipeserve.core.events import Flush
from tests.conftest import make_config, startup_error

PROMPTS = [[11, 12, 13], [40 + i for i in range(37)], [7], [100 + (i * 7) % 300 for i in range(90)],
           [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 24
EOS_OFF = {0: -100.0, 2: -100.0}


def write_adapter(root: Path, adapter_id: str, model_path: Path, *, rank: int = 4,
                  num_layers: int = 2, keys: list[str] | None = None, dora: bool = False,
                  seed: int = 0) -> Path:
    """An adapter directory as `mlx_lm.lora` writes it, with random non-zero A and B (and a
    perturbed DoRA magnitude): the tiny model's layers converted by mlx-lm, then filled."""
    model, _ = load_model(model_path)
    params = {"rank": rank, "scale": 2.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    key = mx.random.key(seed)
    weights = {}
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
        if name.rsplit(".", 1)[-1] not in LEAVES:
            continue
        noise = mx.random.normal(p.shape, key=mx.random.split(key, i + 1)[i])
        weights[name] = p * (1 + 0.2 * noise) if name.endswith(".m") else 0.3 * noise
    out = root / adapter_id
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers,
              "lora_parameters": params, "model": str(model_path)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def reference(model_path: Path, adapter_path: Path | None, prompt: list[int]) -> list[int]:
    """mlx-lm's greedy loop on `mlx_lm.load(path, adapter_path=)`, EOS masked as ours is."""
    model, _ = mlx_load(str(model_path), adapter_path=str(adapter_path) if adapter_path else None)
    bias = mx.zeros((model.args.vocab_size,))
    bias[0] = bias[2] = -100.0

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits + bias
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                        logits_processors=[no_eos])]


@pytest.fixture
def adapters(tmp_path: Path, model_cache: Path) -> Path:
    base = ensure_model("qwen3", "tiny", "float32", model_cache)
    root = tmp_path / "adapters"
    write_adapter(root, "lora", base)
    write_adapter(root, "dora", base, dora=True, rank=2, num_layers=1, seed=1,
                  keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    return root


def _greedy(h, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [h.request(p, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF) for p in prompts]
    return [g["ids"] for g in asyncio.run(h.generate_many(reqs))]


@pytest.mark.parametrize("adapter_id", ["lora", "dora"])
def test_serial_greedy_with_adapter_equals_mlx_lm(engine_factory, adapters: Path,
                                                  model_cache: Path, adapter_id: str) -> None:
    h = engine_factory("scheduler=serial", f"model.adapter_dir={adapters}",
                       f"model.adapter={adapter_id}")
    base_path = h.loaded.path
    assert h.loaded.adapter.id == adapter_id
    for prompt in PROMPTS[:3]:
        ours = h.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)["ids"]
        assert ours == reference(base_path, adapters / adapter_id, prompt)
        assert ours != reference(base_path, None, prompt)   # the adapter really applies


def test_batched_greedy_with_adapter_equals_mlx_lm(engine_factory, adapters: Path) -> None:
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=8",
                       f"model.adapter_dir={adapters}", "model.adapter=lora")
    got = _greedy(h, PROMPTS)
    assert h.metrics.batch_size._sum.get() > len(PROMPTS) * 2   # really ran batched
    expected = [reference(h.loaded.path, adapters / "lora", p) for p in PROMPTS]
    assert got == expected
    base = [reference(h.loaded.path, None, p) for p in PROMPTS]
    assert all(g != b for g, b in zip(got, base))


def test_draft_model_runs_without_the_adapter_and_output_stays_the_adapted(
        engine_factory, adapters: Path, model_cache: Path) -> None:
    """draft=model: the draft (here the base model itself) drafts without the adapter and the
    adapted target verifies, so the output is the adapted model's, token for token."""
    h = engine_factory("scheduler=serial", f"model.adapter_dir={adapters}",
                       "model.adapter=lora", "draft=model", f"draft.path={ensure_model('qwen3', 'tiny', 'float32', model_cache)}")
    assert h.engine.step.draft.proposer.draft.adapter is None
    for prompt in PROMPTS[:2]:
        ours = h.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)["ids"]
        assert ours == reference(h.loaded.path, adapters / "lora", prompt)
    assert h.metrics.spec_verifies.labels("model")._value.get() > 0   # it really drafted


def test_adapter_describes_itself(engine_factory, adapters: Path) -> None:
    h = engine_factory(f"model.adapter_dir={adapters}", "model.adapter=dora", "cache=off")
    d = h.loaded.adapter.describe()
    assert d["id"] == "dora" and d["rank"] == 2 and d["fine_tune_type"] == "dora"
    assert d["target_modules"] == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    size = (adapters / "dora" / "adapters.safetensors").stat().st_size
    assert 0 < d["bytes"] <= size and len(d["digest"]) == 16


# -- launch refusals ---------------------------------------------------------------------
def test_adapter_without_dir_is_refused_at_config_load() -> None:
    with pytest.raises(ConfigError, match="model.adapter=x needs model.adapter_dir"):
        make_config("model.adapter=x")


@pytest.mark.parametrize("adapter_id", ["../x", "a/b", "..", "x/../../y"])
def test_path_escape_is_refused(tmp_path: Path, adapter_id: str) -> None:
    with pytest.raises(ConfigError, match="is not an adapter id.*without '/'"):
        make_config(f"model.adapter_dir={tmp_path}", f"model.adapter={adapter_id}")


def test_symlink_out_of_the_dir_is_refused(adapters: Path, tmp_path: Path, model_cache: Path) -> None:
    outside = write_adapter(tmp_path / "elsewhere", "evil", ensure_model(cache_dir=model_cache))
    (adapters / "evil").symlink_to(outside)
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=evil")
    assert "model.adapter 'evil' resolves to" in msg and "outside model.adapter_dir" in msg


def test_unknown_id_lists_what_is_there(adapters: Path, model_cache: Path) -> None:
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=nope")
    assert "model.adapter 'nope' is not in model.adapter_dir" in msg
    assert "adapters there: dora, lora" in msg


def test_missing_file_is_refused(adapters: Path, model_cache: Path) -> None:
    (adapters / "lora" / "adapters.safetensors").unlink()
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=lora")
    assert "model.adapter 'lora'" in msg and "has no adapters.safetensors" in msg


def test_adapter_for_another_hidden_size_names_layer_and_shapes(adapters: Path,
                                                                model_cache: Path) -> None:
    """Tensors shaped for hidden 128 on the hidden-64 tiny model."""
    path = adapters / "lora" / "adapters.safetensors"
    wide = {k: mx.random.normal(tuple(128 if d == 64 else d for d in v.shape))
            for k, v in mx.load(str(path)).items()}
    mx.save_safetensors(str(path), wide)
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=lora")
    assert "model.adapter 'lora': layer model.layers." in msg
    assert "(128, 4) in adapters.safetensors, the base model's layer expects (64, 4)" in msg \
        or "(4, 128) in adapters.safetensors, the base model's layer expects (4, 64)" in msg
    assert "trained for a different base model" in msg


def test_layer_names_of_another_model_are_refused(adapters: Path, model_cache: Path) -> None:
    path = adapters / "lora" / "adapters.safetensors"
    weights = mx.load(str(path))
    weights = {k.replace("self_attn.q_proj", "attention.wq"): v for k, v in weights.items()}
    mx.save_safetensors(str(path), weights)
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=lora")
    assert "layer model.layers.0.attention.wq.lora_a (shape (64, 4))" in msg and "is not in the base model" in msg


def test_rank_mismatch_between_config_and_weights(adapters: Path, model_cache: Path) -> None:
    cfg_path = adapters / "lora" / "adapter_config.json"
    config = json.loads(cfg_path.read_text())
    config["lora_parameters"]["rank"] = 8
    cfg_path.write_text(json.dumps(config))
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=lora")
    assert "model.adapter 'lora': rank mismatch at layer model.layers." in msg
    assert "adapter_config.json says rank 8" in msg and "(rank 4)" in msg


def test_full_fine_tune_is_not_an_adapter(adapters: Path, model_cache: Path) -> None:
    cfg_path = adapters / "lora" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "fine_tune_type": "full"}))
    msg = startup_error(model_cache, f"model.adapter_dir={adapters}", "model.adapter=lora")
    assert "fine_tune_type 'full' is not an adapter" in msg


# -- the prompt cache never crosses adapters ---------------------------------------------
def test_cache_identity_names_the_adapter(engine_factory, adapters: Path, tmp_path: Path) -> None:
    plain = engine_factory("cache=off")
    lora = engine_factory("cache=off", f"model.adapter_dir={adapters}", "model.adapter=lora")
    ids = {cache_identity(h.loaded, h.engine.layout) for h in (plain, lora)}
    copy = tmp_path / "copy"
    shutil.copytree(adapters, copy)
    w = copy / "lora" / "adapters.safetensors"
    mx.save_safetensors(str(w), {k: v * 2 for k, v in mx.load(str(w)).items()})
    retrained = engine_factory("cache=off", f"model.adapter_dir={copy}", "model.adapter=lora")
    ids.add(cache_identity(retrained.loaded, retrained.engine.layout))
    assert len(ids) == 3   # same id, other weights: another identity too


def test_ssd_entry_made_without_the_adapter_is_not_hit_with_it(engine_factory, adapters: Path,
                                                               tmp_path: Path) -> None:
    ssd = ["cache=ssd", f"cache.ssd.dir={tmp_path / 'ssd'}"]
    prompt = PROMPTS[3]
    plain = engine_factory(*ssd)
    cold = plain.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)
    assert plain.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)["cached"] > 0
    assert plain.engine.command(Flush()).result(60)
    plain.close()
    lora = engine_factory(*ssd, f"model.adapter_dir={adapters}", "model.adapter=lora")
    got = lora.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)
    assert got["cached"] == 0 and lora.metrics.cache_hits.labels("ssd")._value.get() == 0
    assert got["ids"] == reference(lora.loaded.path, adapters / "lora", prompt) != cold["ids"]
    again = lora.generate(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF)
    assert again["cached"] > 0 and again["ids"] == got["ids"]   # its own entries do hit
