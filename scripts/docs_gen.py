"""The generated parts of the docs site, from what the code declares, so they cannot drift:
the configuration reference (every group, option and key, from the schemas in
pipeserve/config.py and the group registries, with the option YAMLs' values and the fields'
own comments), the metrics table (from pipeserve/metrics.py's registry) and the benchmark tables
(from the result files in docs/bench/).

    python scripts/docs_gen.py          # rewrite the generated blocks in docs/
    python scripts/docs_gen.py --check  # exit 1 naming each page whose block is stale

A block sits between `<!-- BEGIN GENERATED: <name> -->` and `<!-- END GENERATED: <name> -->`
in a page; the text around it is written by hand. tests/test_docs.py runs --check."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import enum
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs"
CONF = ROOT / "pipeserve" / "conf"
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (\w+) -->\n)(.*?)(<!-- END GENERATED: \2 -->)", re.S)
HIDDEN_GROUPS = {"hydra", "bench", "preset"}   # presets: a hand-written table


# -- configuration ------------------------------------------------------------------------
def _field_comments(cls: type) -> dict[str, str]:
    """name → what the source says of its field: the trailing comment of its line (with the
    aligned comment lines under it), else the comment block just above it (STYLE §9 puts a
    field's unit and effect there)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        current = None
        for line in lines:
            body = line.strip()
            if body.startswith("#"):
                text = body[1:]
                if current and current in out and text.startswith("  "):   # aligned: goes on
                    out[current] += " " + text.strip()
                else:
                    current = None
                    above.append(text.strip())
                continue
            m = re.match(r"^    (\w+)\s*:[^#]*?(?:#\s?(.*))?$", line)
            if m:
                current = m.group(1)
                said = m.group(2).strip() if m.group(2) else " ".join(above)
                if said:
                    out[current] = said
            else:
                current = None
            above = []
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in args) + (
            " or null" if type(None) in typing.get_args(tp) else "")
    if origin in (list, tuple, typing.List, typing.Tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "group"
    return getattr(tp, "__name__", str(tp))


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if v == "???":
        return "*required*"
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, (dict, list)):
        v = json.dumps(v)
    if isinstance(v, str) and v.startswith("${pipeserve.model_id"):
        return "the option's name; with model.path, the weights' own name"
    text = str(v).replace("|", "\\|")
    return f"`{text}`" if text != "" else '`""`'


def _rows(schema: type, values: Any, prefix: str, keep_target: bool) -> list[list[str]]:
    from omegaconf import DictConfig, OmegaConf
    hints = typing.get_type_hints(schema)
    comments = _field_comments(schema)
    rows = []
    for f in dataclasses.fields(schema):
        if f.name.startswith("_") and not (keep_target and f.name == "_target_"):
            continue
        tp = hints.get(f.name, f.type)
        node = values.get(f.name) if isinstance(values, DictConfig) else None
        inner = [a for a in (typing.get_args(tp) or (tp,)) if a is not type(None)]
        nested = next((a for a in inner if isinstance(a, type) and dataclasses.is_dataclass(a)),
                      None)
        if nested is not None and typing.get_origin(tp) in (dict, typing.Dict):   # id → item
            rows.append([f"`{prefix}{f.name}`", f"mapping of id to {nested.__name__}",
                         "`{}`", comments.get(f.name, "").replace("|", "\\|")])
            rows += _rows(nested, OmegaConf.structured(nested), f"{prefix}{f.name}.<id>.", True)
            continue
        if nested is not None and (isinstance(node, DictConfig) or node is None):
            if node is None and isinstance(values, DictConfig) and f.name in values:
                rows.append([f"`{prefix}{f.name}`", _type_name(tp), "null",
                             comments.get(f.name, "")])
            rows += _rows(nested, node if node is not None else OmegaConf.structured(nested),
                          f"{prefix}{f.name}.", True)
            continue
        raw = OmegaConf.to_container(values, resolve=False).get(f.name) if isinstance(
            values, DictConfig) else None
        said = comments.get(f.name, "")
        if f.name == "_target_" and not said:   # a pipeline slot's implementation
            said = f"the class of the `{prefix.rstrip('.').rpartition('.')[2]}` stage"
        rows.append([f"`{prefix}{f.name}`", _type_name(tp), _value(raw), said.replace("|", "\\|")])
    return rows


def _option_values(schema: type, yaml_path: Path) -> Any:
    """The option's values as a launch gets them: the schema's defaults under its YAML's."""
    from omegaconf import OmegaConf
    own = OmegaConf.load(yaml_path)
    own.pop("defaults", None)
    values = OmegaConf.structured(schema)
    OmegaConf.set_struct(values, False)
    return OmegaConf.merge(values, own)


def _own_values(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    own.pop("defaults", None)
    return {k: v for k, v in own.items() if not str(v).startswith("${pipeserve.model_id")}


def _yaml_comment(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip() if not line.startswith("#  ") else line[1:])
    return lines


def _schema_of(group: str, path: Path, schemas: dict[str, dict[str, type]]) -> type:
    text = path.read_text()
    m = re.search(rf"/schema/{group}/(\w+)@_here_", text)
    options = schemas[group]
    return options[m.group(1)] if m else next(iter(options.values()))


def _defaults() -> dict[str, str]:
    from omegaconf import DictConfig, OmegaConf
    out = {}
    for item in OmegaConf.load(CONF / "serve.yaml").defaults:
        if isinstance(item, DictConfig):
            for k, v in item.items():
                if not str(k).startswith("override"):
                    out[str(k)] = "null" if v is None else str(v)
    return out


def config_reference() -> str:
    from pipeserve.config import SCHEMAS, register_configs
    register_configs()
    defaults = _defaults()
    order = [g for g in defaults if g in SCHEMAS] + sorted(set(SCHEMAS) - set(defaults))
    out = []
    for group in order:
        directory = CONF / group
        files = sorted(directory.glob("*.yaml")) if directory.is_dir() else []
        if not files:
            continue
        default = defaults.get(group)
        names = ", ".join(f"`{p.stem}`" + (" (default)" if p.stem == default else "")
                          for p in files)
        out += [f"## {group}", "", f"Options: {names}." + (
            " No option is selected by default: name one (`" + group + "=<option>`)."
            if default in (None, "null") else ""), ""]
        tabled: dict[type, str] = {}   # schema → the option whose table lists its keys
        for path in files:
            schema = _schema_of(group, path, SCHEMAS)
            out += [f"### {group}={path.stem}", ""]
            comment = _yaml_comment(path)
            prose = [c for c in comment if not c.lstrip().startswith(("python serve.py", "pipeserve "))]
            shell = [c.strip() for c in comment if c.lstrip().startswith(("python serve.py", "pipeserve "))]
            if prose:
                out += [" ".join(prose), ""]
            if shell:
                # tests/test_docs.py: each command block says how a test covers it
                out += ["<!-- docs-test: composed -->", "", "```sh", *shell, "```", ""]
            if schema in tabled:
                own = _own_values(path)
                sets = ", ".join(f"`{group}.{k}={_value(v).strip('`')}`" for k, v in own.items())
                out += [f"The keys of [`{group}={tabled[schema]}`](#{group}{tabled[schema]})"
                        + (f"; this option sets {sets}." if sets else "."), ""]
                continue
            tabled[schema] = path.stem
            rows = _rows(schema, _option_values(schema, path), f"{group}.",
                         keep_target=group == "pipeline")
            if rows:
                out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
                out += ["| " + " | ".join(r) + " |" for r in rows]
                out.append("")
            else:
                out += ["No keys.", ""]
    return "\n".join(out).rstrip() + "\n"


# -- metrics ------------------------------------------------------------------------------
def metrics_table() -> str:
    from prometheus_client import CollectorRegistry
    from pipeserve.metrics import Metrics, family_names
    registry = Metrics(CollectorRegistry()).registry
    names = family_names(registry)
    rows = ["| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
    suffix = {"counter": "_total", "info": "_info"}
    for family in registry.collect():
        name = family.name + suffix.get(family.type, "")
        assert name in names
        labels: dict[str, list[str]] = {}
        for s in family.samples:
            for k, v in s.labels.items():
                if k in ("le",) or family.type == "info":
                    continue
                labels.setdefault(k, [])
                if v not in labels[k]:
                    labels[k].append(v)
        shown = "; ".join(f"`{k}` ({', '.join(f'`{v}`' for v in vs)})" if vs and len(vs) <= 12
                          else f"`{k}`" for k, vs in labels.items())
        rows.append(f"| `{name}` | {family.type} | {shown} | {family.documentation} |")
    return "\n".join(rows) + "\n"


# -- benchmarks ---------------------------------------------------------------------------
BENCH_COLUMNS = ["target", "workload", "streams", "requests", "output_tokens", "agg_tok_s",
                 "stream_tok_s_p50", "ttft_p50_s", "ttft_p95_s", "itl_p50_ms", "itl_p95_ms",
                 "peak_rss_mb", "overrides"]


def _read_results(path: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A result file: `# key: value` header lines (machine, date, commit, command; optional
    title, note, columns, plot), then the CSV bench.py wrote (or JSON lines)."""
    meta: dict[str, str] = {}
    body: list[str] = []
    for line in path.read_text().splitlines():
        m = re.match(r"^#\s*(\w+):\s*(.*)$", line)
        if m and not body:
            meta[m.group(1)] = m.group(2).strip()
        elif line.strip():
            body.append(line)
    if path.suffix == ".jsonl":
        rows = [{k: str(v) for k, v in json.loads(line).items()} for line in body]
    else:
        rows = list(csv.DictReader(body))
    missing = {"machine", "date", "commit", "command"} - set(meta)
    if missing:
        raise SystemExit(f"{path}: the header lacks {', '.join(sorted(missing))}")
    return meta, rows


def bench_tables() -> str:
    out = []
    for path in sorted((DOCS / "bench").glob("*.csv")) + sorted((DOCS / "bench").glob("*.jsonl")):
        meta, rows = _read_results(path)
        cols = [c for c in meta.get("columns", ",".join(BENCH_COLUMNS)).split(",")
                if any(c in r for r in rows)]
        out += [f"### {meta.get('title', path.stem)}", ""]
        out += [f"Machine: {meta['machine']}. Measured {meta['date']} at commit "
                f"`{meta['commit']}`. Data: [`bench/{path.name}`](bench/{path.name}).", ""]
        if meta.get("note"):
            out += [meta["note"], ""]
        out += ["<!-- docs-test: not run: the command that measured the table below (minutes on "
                "the machine named above) -->", "", "```sh", meta["command"], "```", ""]
        if meta.get("plot"):   # the plot bench.py drew for this run, committed beside it
            out += [f"![{meta.get('title', path.stem)}](bench/{meta['plot']})", ""]
        out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        out += ["| " + " | ".join(r.get(c, "").replace("|", "\\|") for c in cols) + " |"
                for r in rows]
        out.append("")
    return ("\n".join(out).rstrip() + "\n") if out else "No result files yet.\n"


GENERATORS = {"config": config_reference, "metrics": metrics_table, "bench": bench_tables}


def render(text: str, only: set[str] | None = None) -> str:
    def fill(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in GENERATORS or (only is not None and name not in only):
            return m.group(0)
        return m.group(1) + GENERATORS[name]() + m.group(4)
    return BLOCK.sub(fill, text)


def pages() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*.md")) if BLOCK.search(p.read_text())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated block is stale")
    args = ap.parse_args()
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("stale generated docs (run python scripts/docs_gen.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for p in stale:
        print(f"rewrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
