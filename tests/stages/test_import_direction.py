"""Imports point one way: stages reach the framework, never a protocol adapter (pipeline.http.api);
the output markup they share with the adapters lives outside pipeline/http/api (pipeline.markup)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth (`from pipeline import api` → pipeline.http.api)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def api_imports(path: Path) -> list[str]:
    return sorted(n for n in imported(path) if n == "pipeline.http.api" or n.startswith("pipeline.http.api."))


@pytest.mark.parametrize("path", sorted((ROOT / "stages").glob("*.py")), ids=lambda p: p.name)
def test_no_stage_imports_a_protocol_adapter(path: Path) -> None:
    assert api_imports(path) == []


@pytest.mark.parametrize("name", ["markup.py", *sorted(p.name for p in (ROOT / "pipeline" / "tool_formats").glob("*.py"))])
def test_the_output_markup_is_framework_not_adapter(name: str) -> None:
    path = ROOT / "pipeline" / name
    assert api_imports(path if path.exists() else ROOT / "pipeline" / "tool_formats" / name) == []


def test_the_check_sees_adapter_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from pipeline import api\nimport pipeline.http.api.tools\n"
                     "from pipeline.http.api.reasoning import ReasoningSplitter\n")
    assert api_imports(probe) == ["pipeline.http.api", "pipeline.http.api.reasoning",
                                  "pipeline.http.api.reasoning.ReasoningSplitter",
                                  "pipeline.http.api.tools"]
