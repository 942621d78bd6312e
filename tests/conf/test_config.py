"""Config tests, no model load: every option of every group composes into a typed ServeConfig;
bad overrides fail at launch with a message naming the key, the value and what is allowed;
serve.py rejects a bad config before loading anything; config_hash is stable."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeserve import config as pc
from pipeserve.core.config import ContinuousSchedulerConfig, SamplingConfig, SerialSchedulerConfig
from pipeserve.http.config import LogFormat, ServerConfig
from pipeserve.model.config import Arch, ModelConfig, ModelSource
from pipeserve.stages.config import AdvisoryAdmissionConfig, PipelineConfig
from pipeserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "pipeserve" / "conf"
# pipeserve/conf/hydra/ holds options of Hydra's own groups (job_logging), not of ServeConfig
# pipeserve/conf/bench/ holds bench.py's overlays (its model shapes), not a serve.py group
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "bench", "preset"))

pc.register_configs()


def compose_raw(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("serve", overrides=list(overrides))


def load(*overrides: str) -> pc.ServeConfig:
    return pc.load_config(compose_raw(*overrides))


def error_text(exc: BaseException) -> str:
    """The message and its causes, as Hydra's CLI prints them."""
    parts: list[str] = []
    e: BaseException | None = exc
    while e is not None:
        parts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def option_yaml(group: str, option: str) -> DictConfig:
    return OmegaConf.load(CONF / group / f"{option}.yaml")


def schema_of(group: str, option: str) -> type:
    """The dataclass an option extends: its YAML's `/schema/<group>/<name>@_here_` default."""
    defaults = list(option_yaml(group, option).get("defaults", []))
    refs = [d for d in defaults if isinstance(d, str) and d.startswith(f"/schema/{group}/")]
    assert len(refs) == 1, (
        f"pipeserve/conf/{group}/{option}.yaml must extend exactly one /schema/{group}/<name>@_here_, "
        f"has defaults {defaults}")
    name = refs[0].removeprefix(f"/schema/{group}/").split("@")[0]
    assert name in pc.SCHEMAS[group], (
        f"pipeserve/conf/{group}/{option}.yaml extends schema/{group}/{name}, which register_configs() "
        f"does not store (has {sorted(pc.SCHEMAS[group])})")
    return pc.SCHEMAS[group][name]


def plain(obj: Any) -> Any:
    """A typed config node as plain YAML-like data (enums as their values)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, list):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def assert_subset(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a mapping, got {actual!r}"
        for k, v in expected.items():
            assert k in actual, f"{where}.{k} missing from the typed config"
            assert_subset(v, actual[k], f"{where}.{k}")
    else:
        assert actual == expected, f"{where}: YAML says {expected!r}, typed config has {actual!r}"


OPTIONAL_GROUPS = ("pool",)   # `- pool: null` in pipeserve/conf/serve.yaml: one model unless selected
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


# -- 1. every option composes ------------------------------------------------------------
def test_groups_match_schema() -> None:
    fields = {f.name for f in dataclasses.fields(pc.ServeConfig)}
    assert set(GROUPS) == fields, f"pipeserve/conf/ groups {GROUPS} vs ServeConfig fields {sorted(fields)}"
    assert set(pc.SCHEMAS) == fields
    for g in GROUPS:
        assert list((CONF / g).glob("*.yaml")), f"pipeserve/conf/{g}/ has no options"


# Options that are errors on their own: what each needs to make sense.
REQUIRED = {("admission", "budget"): ["admission.memory_budget_gb=8"],
            ("kv", "mixed"): ["kv.config_path=kv_config.json"],
            ("draft", "model"): ["draft.path=/models/draft"],
            ("pool", "dir"): ["pool.model_dir=/models"]}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(group: str, option: str) -> None:
    cfg = load(f"{group}={option}", *REQUIRED.get((group, option), []))
    assert isinstance(cfg, pc.ServeConfig)
    node = getattr(cfg, group)
    expected = schema_of(group, option)
    assert type(node) is expected, f"{group}={option} gave {type(node).__name__}, want {expected.__name__}"
    # every value the YAML sets lands, typed, in the object
    values = OmegaConf.to_container(option_yaml(group, option), resolve=True)
    values.pop("defaults", None)
    assert_subset(values, plain(node), group)
    # every other group keeps a typed node of its schema family (pool: None unless selected)
    for other in GROUPS:
        sub = getattr(cfg, other)
        if sub is None and other in OPTIONAL_GROUPS:
            continue
        assert dataclasses.is_dataclass(sub) and not isinstance(sub, DictConfig), other


def test_known_schema_classes_and_defaults() -> None:
    cfg = load()
    assert type(cfg.scheduler) is ContinuousSchedulerConfig
    assert type(cfg.admission) is AdvisoryAdmissionConfig
    assert type(cfg.model) is ModelConfig
    assert type(cfg.sampling) is SamplingConfig
    assert type(cfg.server) is ServerConfig
    assert type(cfg.pipeline) is PipelineConfig
    assert cfg.server.port == 8080 and isinstance(cfg.server.port, int)
    assert cfg.server.host == "127.0.0.1"
    assert cfg.scheduler.prefill_chunk == 2048
    assert cfg.scheduler.max_batch is None   # fitted to the device at load (CPU 8, GPU 256)
    assert cfg.scheduler.max_num_batched_tokens is None
    assert cfg.admission.max_queue == 64
    assert cfg.model.name == "smollm2" and cfg.model.source is ModelSource.smollm2
    assert cfg.model.path is None and cfg.model.arch is Arch.llama
    assert cfg.server.log_format is LogFormat.text
    assert cfg.sampling.temperature is None
    assert cfg.pipeline.sample._target_ == "pipeserve.stages.sample.Sample"
    assert type(load("scheduler=serial").scheduler) is SerialSchedulerConfig


def test_overrides_are_typed() -> None:
    cfg = load("server.port=9000", "model.arch=llama", "sampling.temperature=0.5",
               "admission.max_queue=0", "server.log_format=json")
    assert cfg.server.port == 9000
    assert cfg.model.arch is Arch.llama
    assert cfg.sampling.temperature == 0.5
    assert cfg.admission.max_queue == 0
    assert cfg.server.log_format is LogFormat.json


# -- 2. bad overrides and their messages -------------------------------------------------
COMPOSE = ConfigCompositionException  # Hydra: misspelt option, unknown key, wrong type
BAD = [
    # (overrides, exception type, strings the message must contain)
    (["scheduler=seriall"], MissingConfigException, ["scheduler", "seriall", "serial"]),
    (["server.prot=1"], COMPOSE, ["server.prot", "1", "prot"]),
    (["+server.extra=1"], ConfigError, ["server.extra", "1", "port"]),
    (["+extra_top=1"], ConfigError, ["extra_top", "1", "server"]),
    (["server.port=abc"], COMPOSE, ["server.port", "abc", "Integer"]),
    (["model.arch=gpt5"], COMPOSE, ["model.arch", "gpt5", "qwen3", "llama", "gemma3", "qwen3_next"]),
    (["server.log_format=xml"], COMPOSE, ["server.log_format", "xml", "text", "json"]),
    (["server.port=70000"], ConfigError, ["server.port", "70000", "65535"]),
    (["model.tool_call_format=xml"], COMPOSE,
     ["model.tool_call_format", "xml", "auto", "none", "hermes", "qwen3_coder", "llama3"]),
    (["server.responses_ttl_s=0"], ConfigError, ["server.responses_ttl_s", "got 0", "> 0"]),
    (["server.responses_store_mb=-1"], ConfigError, ["server.responses_store_mb", "-1", ">= 0"]),
    (["+server.volatile_spans.mine='a('"], ConfigError,
     ["server.volatile_spans.mine", "a(", "not a regular expression"]),
    (["scheduler.prefill_chunk=0"], ConfigError, ["scheduler.prefill_chunk", "got 0", "> 0"]),
    (["sampling.temperature=3"], ConfigError, ["sampling.temperature", "got 3", "[0, 2]"]),
    (["sampling.top_p=0"], ConfigError, ["sampling.top_p", "got 0", "(0, 1]"]),
    (["sampling.min_p=2"], ConfigError, ["sampling.min_p", "got 2", "[0, 1]"]),
    (["sampling.top_k=-1"], ConfigError, ["sampling.top_k", "got -1", ">= 0"]),
    (["admission.max_queue=-1"], ConfigError, ["admission.max_queue", "got -1", ">= 0"]),
    (["scheduler=serial", "scheduler.max_batch=4"], ConfigError,
     ["scheduler.max_batch", "got 4", "must be 1", "scheduler=serial"]),
    (["admission=advisory", "admission.memory_budget_gb=8"], ConfigError,
     ["admission.memory_budget_gb", "8", "admission=budget"]),
    (["admission=budget"], ConfigError,
     ["admission=budget", "admission.memory_budget_gb", "admission.kv_budget_gb", "neither"]),
    (["admission=budget", "admission.kv_budget_gb=-1"], ConfigError,
     ["admission.kv_budget_gb", "-1"]),
    (["admission.buffer_cache_gb=-2"], ConfigError, ["admission.buffer_cache_gb", "-2"]),
    (["draft=ngram", "draft.gate_ratio=0"], ConfigError, ["draft.gate_ratio", "got 0", "(0, 100]"]),
    (["draft=mtp", "draft.gate=maybe"], COMPOSE, ["draft.gate", "maybe"]),
    (["scheduler.arrival_gap_ms=-1"], ConfigError, ["scheduler.arrival_gap_ms", ">= 0", "-1"]),
    (["pipeline.sample._target_=stages.nope.Sample"], ConfigError,
     ["pipeline.sample._target_", "stages.nope.Sample", "cannot be imported"]),
]


@pytest.mark.parametrize("overrides,exc_type,needles", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_override_message(overrides: list[str], exc_type: type[BaseException],
                              needles: list[str]) -> None:
    with pytest.raises((ConfigError, ConfigCompositionException, OmegaConfBaseException)) as info:
        load(*overrides)
    assert isinstance(info.value, exc_type), (
        f"{overrides}: raised {type(info.value).__name__}, want {exc_type.__name__}: {info.value}")
    # ConfigError's own message must carry everything; Hydra's CLI prints the cause chain.
    text = str(info.value) if exc_type is ConfigError else error_text(info.value)
    missing = [n for n in needles if n not in text]
    assert not missing, f"{overrides}: message lacks {missing}:\n{text}"


def test_unknown_key_is_rejected_not_dropped() -> None:
    """`+x.y=...` gets past Hydra and OmegaConf.to_object would silently drop it."""
    raw = compose_raw("+server.extra=1")
    assert raw.server.extra == 1  # Hydra accepted it
    with pytest.raises(ConfigError, match=r"server\.extra"):
        pc.load_config(raw)


# -- 3. serve.py fails at launch, before any model load ----------------------------------
def run_serve(tmp_path: Path, *overrides: str) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["HF_HUB_OFFLINE"] = "1"
    args = [sys.executable, "serve.py", *overrides,
            f"hydra.run.dir={tmp_path / 'run'}", f"model.cache_dir={tmp_path / 'models'}"]
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_serve_rejects_wrong_type(tmp_path: Path) -> None:
    rc, out, elapsed = run_serve(tmp_path, "server.port=abc")
    assert rc != 0, out
    assert "server.port" in out and "abc" in out, out
    assert "loading model" not in out, out
    assert not (tmp_path / "models").exists(), "a model was generated for a bad config"
    assert elapsed < 30, f"took {elapsed:.1f}s to reject a bad config"


def test_serve_rejects_unknown_key(tmp_path: Path) -> None:
    rc, out, elapsed = run_serve(tmp_path, "+server.bogus=1")
    assert rc == 2, f"exit {rc}:\n{out}"
    assert "server.bogus" in out, out
    assert "loading model" not in out, out
    assert not (tmp_path / "models").exists(), "a model was generated for a bad config"
    assert elapsed < 30, f"took {elapsed:.1f}s to reject a bad config"


# -- 4. config_hash ----------------------------------------------------------------------
def test_config_hash_stable_and_sensitive() -> None:
    a = pc.config_hash(compose_raw("server.port=9000"))
    b = pc.config_hash(compose_raw("server.port=9000"))
    assert a == b
    assert len(a) == 12 and all(c in "0123456789abcdef" for c in a)
    assert pc.config_hash(compose_raw("server.port=9001")) != a
    assert pc.config_hash(compose_raw("server.port=9000", "sampling.temperature=0.5")) != a
    assert pc.config_hash(compose_raw("server.port=9000", "model=llama")) != a
    # the same whether given the composed DictConfig or load_config()'s typed result
    raw = compose_raw("server.port=9000")
    assert pc.config_hash(pc.load_config(raw)) == a
    # override order does not matter
    assert (pc.config_hash(compose_raw("server.port=9000", "admission.max_queue=8"))
            == pc.config_hash(compose_raw("admission.max_queue=8", "server.port=9000")))


# -- presets -------------------------------------------------------------------------------
PRESETS = sorted(p.stem for p in (CONF / "preset").glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_sets_what_the_docs_say(name: str) -> None:
    """Each preset is a row of the configuration page's table, and every key the row names
    holds that value in the loaded config (a group choice names its option)."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), None)
    assert row is not None, f"docs/configuration.md has no row for preset={name}"
    cfg = load(f"preset={name}")
    said = re.findall(r"`([a-z_]+)(?:\.([a-z_.]+))?=([^`]+)`", row.split("|")[3])
    assert said, row
    for group, key, value in said:
        node = getattr(cfg, group)
        if not key:
            assert node.name == value, f"preset={name}: {group}={node.name}, the docs say {value}"
            continue
        for part in key.split("."):
            node = getattr(node, part)
        assert str(node) == value or str(float(node)) == str(float(value)), (name, group, key, node)


def test_a_preset_yields_to_the_command_line() -> None:
    cfg = load("preset=agents", "cache=ram", "cache.ram_gb=2")
    assert cfg.cache.name == "ram" and cfg.cache.ram_gb == 2.0
    assert cfg.admission.default_priority == "interactive"   # the rest of the preset holds


def test_a_media_key_under_server_names_its_new_place() -> None:
    with pytest.raises(ConfigError, match=r"server\.max_images is media\.max_images now.*"
                                          r"media\.max_images=4"):
        pc.check_overrides(["server.max_images=4"])
    assert load("media.max_images=4").media.max_images == 4
