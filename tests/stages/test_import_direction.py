"""Imports point one way: stages reach the framework, never a protocol adapter (pipeserve.http.api);
the output markup they share with the adapters lives outside pipeserve/http/api (pipeserve.markup.output)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth (`from pipeserve.http import api` → pipeserve.http.api)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def api_imports(path: Path) -> list[str]:
    return sorted(n for n in imported(path)
                  if n == "pipeserve.http.api" or n.startswith("pipeserve.http.api."))


@pytest.mark.parametrize("path", sorted((ROOT / "pipeserve" / "stages").glob("*.py")), ids=lambda p: p.name)
def test_no_stage_imports_a_protocol_adapter(path: Path) -> None:
    assert api_imports(path) == []


@pytest.mark.parametrize("path", sorted((ROOT / "pipeserve" / "markup").rglob("*.py")),
                         ids=lambda p: p.name)
def test_the_output_markup_is_framework_not_adapter(path: Path) -> None:
    assert api_imports(path) == []


def test_the_check_sees_adapter_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from pipeserve.http import api\nimport pipeserve.http.api.tools\n"
                     "from pipeserve.http.api.reasoning import ReasoningSplitter\n")
    assert api_imports(probe) == ["pipeserve.http.api", "pipeserve.http.api.reasoning",
                                  "pipeserve.http.api.reasoning.ReasoningSplitter",
                                  "pipeserve.http.api.tools"]
