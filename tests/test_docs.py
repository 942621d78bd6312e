"""The docs cannot drift from the code: the generated configuration, metrics and benchmark
blocks equal what scripts/docs_gen.py makes from the schemas, the registry and docs/bench/;
every key a launch accepts is on the configuration page; the README's commands are the ones
CI runs. (CI also builds the site with `mkdocs build --strict`, which checks every internal
link and anchor: .ci/run.)"""
from __future__ import annotations

import dataclasses
import re
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


def test_a_stale_result_file_is_marked_on_the_site() -> None:
    """The oldest result file's commit is behind the code it measured: the site build's hook
    turns its marker into a warning."""
    import docs_hooks
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    marks = docs_hooks.MARK.findall(text)
    assert marks, "every result table carries its commit"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: staleness is read from git history")
    built = docs_hooks.on_page_markdown(text)
    assert "Older than the code it measures" in built


def test_the_readme_commands_are_the_ones_ci_and_the_install_test_run() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = "pip install -e '.[test]' && python -m pytest"
    assert test_cmd in readme and ci.rstrip().splitlines()[-1] == test_cmd
    assert "pip install -e . && pipeserve" in readme   # tests/test_install.py runs `pipeserve`
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), target
