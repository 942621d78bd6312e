"""The docs cannot drift from the code: the generated configuration, metrics and benchmark
blocks equal what scripts/docs_gen.py makes from the schemas, the registry and docs/bench/;
every key a launch accepts is on the configuration page; the README's commands are the ones
CI runs. (CI also builds the site with `mkdocs build --strict`, which checks every internal
link and anchor: .ci/run.)"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_gen  # noqa: E402

from tests.conftest import make_config  # noqa: E402


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in docs_gen.pages()])
def test_generated_blocks_are_what_the_code_declares(page: str) -> None:
    text = (ROOT / page).read_text()
    assert docs_gen.render(text) == text, (
        f"{page} is stale: run `python scripts/docs_gen.py` and commit the result")


def test_every_block_the_generator_knows_is_on_a_page() -> None:
    found = {m.group(2) for p in docs_gen.pages() for m in docs_gen.BLOCK.finditer(p.read_text())}
    assert found == set(docs_gen.GENERATORS)


def _keys(node: object, prefix: str = "") -> set[str]:
    if dataclasses.is_dataclass(node):
        out = set()
        for f in dataclasses.fields(node):
            if f.name.startswith("_"):
                continue
            out |= _keys(getattr(node, f.name), f"{prefix}{f.name}.") or {f"{prefix}{f.name}"}
        return out
    return set()


def test_every_key_of_a_composed_launch_is_documented() -> None:
    """From a real composition (not the generator's own walk): each leaf key of the default
    launch and of a few other options is a row of docs/configuration.md."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `([\w.]+)` \|", page, re.M))
    for overrides in ([], ["kv=turbo", "draft=ngram", "cache=ssd", "admission=budget",
                       "admission.kv_budget_gb=1"],
                      ["kv=paged", "draft=mtp", "scheduler=serial"], ["distributed=tensor"]):
        cfg = make_config(*overrides)
        keys = {k for group in ("model", "scheduler", "sampling", "admission", "server", "cache",
                                "kv", "draft", "distributed")
                for k in _keys(getattr(cfg, group), f"{group}.")}
        assert keys - rows == set(), overrides


def test_result_tables_name_their_date_and_commit_and_raw_tables_stay_out_of_the_nav() -> None:
    """Each result table says when and at which commit it was measured (no blanket warning);
    raw result pages under docs/bench/ are linked from the benchmarks page, not nav entries."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in sorted((ROOT / "docs" / "bench").glob("*.csv")):
        meta, _ = docs_gen._read_results(path)
        assert f"Measured {meta['date']} at commit `{meta['commit']}`" in page, path.name
    assert "Older than the code" not in page
    assert "hide: true" in (ROOT / "docs" / "bench" / ".pages").read_text()
    assert "/bench/**" in (ROOT / "mkdocs.yml").read_text()   # not_in_nav: strict stays quiet
    for raw in sorted((ROOT / "docs" / "bench").rglob("*.md")):
        assert f"(bench/{raw.relative_to(ROOT / 'docs' / 'bench').as_posix()})" in page, raw


def test_the_docs_install_is_light_and_the_generators_need_no_mlx() -> None:
    """docs/requirements.txt (the docs build's install) lists what the docs extra lists, and the
    page generators run without importing MLX, mlx-lm or transformers."""
    import tomllib
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["docs"]
    lines = (ROOT / "docs" / "requirements.txt").read_text().splitlines()
    assert sorted(line for line in lines if line and not line.startswith("#")) == sorted(extra)
    assert not {"mlx", "mkl", "transformers"} & {r.split(">")[0].split("=")[0] for r in extra}
    code = ("import sys; sys.path.insert(0, 'scripts'); import docs_gen; "
            "docs_gen.config_reference(); docs_gen.metrics_table(); docs_gen.bench_tables(); "
            "print(sorted({'mlx', 'mlx_lm', 'transformers', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_sample_ready_line_names_the_demo_model_as_served() -> None:
    from pipeserve.model.embedded.smollm2 import DIR_NAME
    page = (ROOT / "docs" / "getting-started.md").read_text()
    line = next(x for x in page.splitlines() if x.startswith("ready: model smollm2 from "))
    assert f" from {DIR_NAME} (" in line, (line, DIR_NAME)


def test_the_readme_commands_are_the_ones_ci_and_the_install_test_run() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = "pip install -e '.[test]' && python -m pytest"
    assert test_cmd in readme and ci.rstrip().splitlines()[-1] == test_cmd
    assert "pip install -e . && pipeserve" in readme   # tests/test_install.py runs `pipeserve`
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), target


def test_every_source_path_the_docs_name_exists() -> None:
    """Paths into the tree (`pipeserve/...`, `tests/...`, `scripts/...`) in the README and the
    pages name files that are there; the `foo` / `mine` of a how-to are examples, not paths."""
    missing = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"(?<![\w/.])((?:pipeserve|tests|scripts|dashboards)/[\w./-]*[\w/])",
                             page.read_text()):
            path = m.group(1)
            if not re.search(r"\bfoo\b|\bmine\b", path) and not (ROOT / path).exists():
                missing.add(f"{page.name}: {path}")
    assert not missing, sorted(missing)


def test_every_command_block_is_run_or_says_why_not() -> None:
    """Each shell block of the README and docs carries a docs-test marker (tests/doc_blocks.py):
    `run` and `launch` blocks are run by tests/serve/test_doc_commands.py, `composed` ones
    hold only launches that test_first_contact.py composes, and the rest say why not. A new
    block without one fails here."""
    from tests.doc_blocks import MARKER, command_blocks, pages
    from tests.serve.test_first_contact import LAUNCH, documented_launches, launch_args

    blocks = command_blocks()
    unmarked = [b.where for b in blocks if b.marker is None]
    assert not unmarked, f"mark these blocks (see tests/doc_blocks.py): {unmarked}"
    markers = sum(len(re.findall(r"^[ >]*" + MARKER.pattern, p.read_text(), re.M))
                  for p in pages())   # on a line of their own (a page may quote one inline)
    assert markers == len(blocks), "a docs-test marker stands before no command block"
    composed = {(where.split(":")[0], tuple(args)) for where, args in documented_launches()}
    kinds: dict[str, list[str]] = {}
    for b in blocks:
        kind = b.kind()[0]
        kinds.setdefault(kind, []).append(b.where)
        lines = [x.strip() for x in b.commands().replace("\\\n", " ").splitlines() if x.strip()]
        launches = [x for x in lines if LAUNCH.search(x)]
        if kind in ("composed", "launch"):   # each launch line is one the launch test composes
            assert launches, b.where
            for line in launches:
                args = tuple(launch_args(line) or ())
                assert (Path(b.page).name, args) in composed, (b.where, line)
        if kind == "launch":
            assert len(launches) == len(lines), (b.where, "a launch block holds launches only")
    assert len(kinds["run"]) >= 10 and len(kinds["launch"]) >= 3, kinds
