"""The run files of a launch (`<run dir>/.hydra/{config,overrides,hydra}.yaml`), written by us
instead of Hydra (pipeserve/conf/serve.yaml sets `hydra.output_subdir: null`) so that a key given
literally (`server.api_key=sekrit`) never reaches the disk: it is written as `<redacted>`.
A reference (`server.api_key=${oc.env:PIPESERVE_API_KEY}`) and a key file's path are kept as
written, unresolved. Main thread, at launch, before the config is checked."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

REDACTED = "<redacted>"
KEY_FIELDS = ("api_key", "admin_key")   # server fields that hold a key itself
_OVERRIDE = re.compile(r"^(?P<prefix>[+~]*)server\.(?P<name>api_key|admin_key)=(?P<value>.*)$",
                       re.DOTALL)


def _is_reference(value: str) -> bool:
    return value.startswith("${") and value.endswith("}")


def redact_override(item: str) -> str:
    """`server.api_key=<literal>` → `server.api_key=<redacted>`; references stay."""
    m = _OVERRIDE.match(item)
    if m is None or _is_reference(m["value"]) or m["value"] in ("", "null"):
        return item
    return f"{m['prefix']}server.{m['name']}={REDACTED}"


def literal_keys(task: DictConfig) -> list[str]:
    """The keys the composed config holds literally (not as references)."""
    server = task.get("server")
    if not isinstance(server, DictConfig):
        return []
    out = []
    for name in KEY_FIELDS:
        if name in server and not OmegaConf.is_interpolation(server, name):
            value = server._get_node(name)._value()
            if isinstance(value, str) and value:
                out.append(value)
    return out


def _scrub(node: Any, secrets: list[str]) -> Any:
    """Guard for places not redacted by name: in a string naming a key field, a literal key
    written as that field's value (`admin_key=adm`) becomes `<redacted>`; one that still shows
    as a word of its own elsewhere in it replaces the string whole. A short key that is only a
    part of other words (`adm` in `admission`, `admin_key`) leaves the rest of the line alone."""
    if isinstance(node, dict):
        return {k: _scrub(v, secrets) for k, v in node.items()}
    if isinstance(node, list):
        return [_scrub(v, secrets) for v in node]
    if not isinstance(node, str) or not any(f in node for f in KEY_FIELDS):
        return node
    for secret in secrets:
        node = re.sub(rf"((?:{'|'.join(KEY_FIELDS)})\s*[=:]\s*['\"]?){re.escape(secret)}"
                      r"(?=$|['\",;\s])", lambda m: m[1] + REDACTED, node)
        if re.search(rf"(?<![\w.-]){re.escape(secret)}(?![\w.-])", node):
            return REDACTED
    return node


def _dirname(overrides: list[str], job_cfg: dict[str, Any]) -> str:
    """hydra.job.override_dirname as Hydra computes it (get_overrides_dirname), from the
    redacted overrides."""
    od = job_cfg.get("override_dirname", {})
    exclude = set(od.get("exclude_keys", []))
    lines = sorted(o for o in overrides if o.partition("=")[0].lstrip("+~") not in exclude)
    return re.sub("=", od.get("kv_sep", "="), od.get("item_sep", ",").join(lines))


def write_run_files(task: DictConfig, hydra_cfg: DictConfig) -> Path:
    """Write config.yaml (the composed config, unresolved), overrides.yaml and hydra.yaml
    with literal keys redacted; returns the folder. Overwrites what Hydra wrote there (when
    hydra.output_subdir is set on the command line) with the redacted copies."""
    secrets = literal_keys(task)
    config = OmegaConf.to_container(task, resolve=False, enum_to_str=True)
    server = config.get("server") if isinstance(config, dict) else None
    if isinstance(server, dict):
        for name in KEY_FIELDS:
            if isinstance(server.get(name), str) and server[name] in secrets:
                server[name] = REDACTED
    hydra = OmegaConf.to_container(hydra_cfg, resolve=False, enum_to_str=True)
    assert isinstance(hydra, dict)
    overrides = [redact_override(o) for o in hydra["overrides"]["task"]]
    hydra["overrides"]["task"] = overrides
    hydra["job"]["override_dirname"] = _dirname(overrides, hydra["job"].get("config", {}))
    out = Path(hydra["runtime"]["output_dir"]) / (hydra.get("output_subdir") or ".hydra")
    out.mkdir(parents=True, exist_ok=True)
    for name, body in (("config.yaml", config), ("hydra.yaml", {"hydra": hydra}),
                       ("overrides.yaml", overrides)):
        (out / name).write_text(OmegaConf.to_yaml(OmegaConf.create(_scrub(body, secrets))),
                                encoding="utf-8")
    return out
