"""One registry per config group (pipeserve/registry.py): the options of kv, draft, cache and
admission are declared once, by `@register` on their schema, and pipeserve/conf/<group>/, the
ConfigStore, option names, `group=<option>` messages and metric labels all follow from it.
The last test registers a KV layout and a proposer that exist nowhere else and checks that
each is served by its module + its YAML alone. No model load."""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from prometheus_client import CollectorRegistry

from pipeserve import config as pc
from pipeserve import registry
from pipeserve.draft.config import DraftConfig
from pipeserve.errors import ConfigError
from pipeserve.kv.config import KvConfig
from pipeserve.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "pipeserve" / "conf"
GROUPS = sorted(registry.SCHEMA_MODULES)
# Options that are errors on their own: what each needs to make sense (as in test_config).
REQUIRED = {("admission", "budget"): ["admission.memory_budget_gb=8"],
            ("kv", "mixed"): ["kv.config_path=kv_config.json"],
            ("draft", "model"): ["draft.path=/models/draft"]}

pc.register_configs()


def load(conf: Path, *overrides: str) -> pc.ServeConfig:
    """Composed and typed (every schema's __post_init__ runs); the `_target_` imports of
    load_config() are test_config's business."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        typed = OmegaConf.to_object(compose("serve", overrides=list(overrides)))
    assert isinstance(typed, pc.ServeConfig)
    return typed


def extended_schema(path: Path, group: str) -> str:
    defaults = [d for d in OmegaConf.load(path).get("defaults", [])
                if isinstance(d, str) and d.startswith(f"/schema/{group}/")]
    assert len(defaults) == 1, f"{path} must extend one /schema/{group}/<name>@_here_"
    return defaults[0].removeprefix(f"/schema/{group}/").split("@")[0]


@pytest.mark.parametrize("group", GROUPS)
def test_one_yaml_per_registered_option(group: str) -> None:
    """pipeserve/conf/<group>/ holds exactly the registered options, and each YAML extends the schema
    registered under its own name."""
    yamls = {p.stem: p for p in (CONF / group).glob("*.yaml")}
    names = set(registry.options(group))
    assert names == set(yamls), (
        f"registered {group} options {sorted(names)} vs pipeserve/conf/{group}/ {sorted(yamls)}: "
        f"a registered option needs pipeserve/conf/{group}/<name>.yaml and a YAML needs @register")
    for name, path in yamls.items():
        assert extended_schema(path, group) == name, (
            f"{path.name} extends schema/{group}/{extended_schema(path, group)}, not its own name")


def test_config_schemas_come_from_the_registry() -> None:
    for group in GROUPS:
        assert dict(pc.SCHEMAS[group]) == registry.schemas(group), group
        for name, schema in pc.SCHEMAS[group].items():
            stored = ConfigStore.instance().load(f"schema/{group}/{name}.yaml")
            assert OmegaConf.get_type(stored.node) is schema, f"schema/{group}/{name}"
            assert dataclasses.is_dataclass(schema)
            assert schema.__module__ == registry.SCHEMA_MODULES[group], (
                f"{schema.__qualname__} is declared in {schema.__module__}; {group} options "
                f"are declared in {registry.SCHEMA_MODULES[group]}")


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in registry.options(g)])
def test_composed_option_knows_its_name(group: str, option: str) -> None:
    """The typed node's `name` (logs, messages, metric labels) is the option it came from."""
    cfg = load(CONF, f"{group}={option}", *REQUIRED.get((group, option), []))
    assert getattr(cfg, group).name == option


def test_metric_labels_are_the_registered_proposers() -> None:
    m = Metrics(CollectorRegistry())
    labels = {s.labels["proposer"] for fam in m.registry.collect()
              if fam.name == "pipeserve_speculation_proposed_tokens" for s in fam.samples
              if s.name.endswith("_total")}
    assert labels == set(registry.labels("draft")) == set(registry.options("draft")) - {"none"}


def test_register_refuses_a_second_schema_for_a_name() -> None:
    with pytest.raises(ValueError, match="kv=dense is registered twice"):
        registry.register("kv", "dense")(dataclasses.make_dataclass("Other", [], bases=(KvConfig,)))
    with pytest.raises(ValueError, match="unknown config group"):
        registry.register("kvv", "x")


# -- a new option: its module + its YAML ------------------------------------------------------
@pytest.fixture
def new_options(tmp_path: Path) -> Iterator[Path]:
    """kv=probe and draft=probe, declared the way docs/development.md's recipe says (schema with
    @register, `_target_` naming the class), plus a copy of pipeserve/conf/ with their YAMLs; removed
    from the registry and the ConfigStore afterwards."""
    saved = {g: dict(o) for g, o in registry._OPTIONS.items()}

    @registry.register("kv", "probe")
    @dataclasses.dataclass
    class ProbeKvConfig(KvConfig):
        _target_: str = "pipeserve.kv.layouts.DenseLayout"
        probe_bits: int = 8

    @registry.register("draft", "probe")
    @dataclasses.dataclass
    class ProbeDraftConfig(DraftConfig):
        _target_: str = "pipeserve.draft.proposers.NoDraft"

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "kv" / "probe.yaml").write_text(
        "defaults: [/schema/kv/probe@_here_, _self_]\nprobe_bits: 4\n")
    (conf / "draft" / "probe.yaml").write_text("defaults: [/schema/draft/probe@_here_, _self_]\n")
    pc.register_configs()
    try:
        yield conf
    finally:
        registry._OPTIONS.clear()
        registry._OPTIONS.update(saved)
        for group in ("kv", "draft"):
            ConfigStore.instance().repo["schema"][group].pop("probe.yaml", None)



def test_a_new_option_is_its_schema_and_its_yaml(new_options: Path) -> None:
    cfg = load(new_options, "kv=probe", "draft=probe")
    assert type(cfg.kv).__name__ == "ProbeKvConfig" and cfg.kv.probe_bits == 4
    assert cfg.kv.name == "probe" and cfg.draft.name == "probe"
    assert "probe" in pc.SCHEMAS["kv"] and "probe" in pc.SCHEMAS["draft"]
    # its metric label series exist from the first scrape
    m = Metrics(CollectorRegistry())
    assert m.registry.get_sample_value("pipeserve_speculation_proposed_tokens_total",
                                       {"proposer": "probe"}) == 0
    # and the launch-time messages list it among the group's options
    with pytest.raises(ConfigError, match="pick one option of kv: .*probe"):
        pc.check_overrides(["kv=probe", "kv=dense"])
