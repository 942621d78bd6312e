"""The import graph of pipeserve/: the engine core (pipeserve/core/) and the stages never reach
the HTTP side (pipeserve/http/, and the model pool that serves several engines behind it); the
HTTP side reaches the core only through the engine's face (engine, its commands and events, the
request streams, its published limits, prompt scoring); every `pipeserve.*` import names a
module of this tree; and no two modules import each other, directly or through others, at any
depth — a function-level import counts like a module-level one. Only `if TYPE_CHECKING:` blocks
are left out: they never run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTTP_SIDE = ("pipeserve.http", "pipeserve.pool")
CORE_FACE = {"pipeserve.core.engine", "pipeserve.core.events", "pipeserve.core.stream",
             "pipeserve.core.limits", "pipeserve.core.scoring"}
# the entry points: they build the app, so they sit above the HTTP side
ENTRIES = ("pipeserve.launch.serve", "pipeserve.bench")


def schema(name: str) -> bool:
    """A group's schema module (`<package>.config`): plain dataclasses that the root config
    composes, readable from anywhere."""
    return name.endswith(".config")


def modules(root: Path) -> dict[str, Path]:
    """Module name → file, for pipeserve/ under `root`."""
    found = {}
    for path in (root / "pipeserve").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every `pipeserve.*` name a file imports, at any depth but type-only blocks
    (`from a.b import c` gives a.b and a.b.c: c may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == "pipeserve"}


def graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the tree it imports (a name resolves to its longest module
    prefix; a package's own name is an edge to its __init__)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {resolve(n) for n in imports(path)}
        edges[name] = {t for t in targets if t is not None and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def under(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


EDGES = graph(ROOT)


def test_the_import_graph_has_no_cycles() -> None:
    assert cycles(EDGES) == []


def test_every_import_names_a_module_of_this_tree() -> None:
    """A stale path (a module that moved) fails here, rather than resolving to another
    checkout of the package that happens to be installed."""
    mods = modules(ROOT)
    missing = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                wanted = [node.module]
            elif isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            else:
                continue
            missing += [f"{name}: {w}" for w in wanted
                        if w.split(".")[0] == "pipeserve" and w not in mods]
    assert missing == []


@pytest.mark.parametrize("side", ["pipeserve.core", "pipeserve.stages"])
def test_the_core_and_the_stages_never_reach_the_http_side(side: str) -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in EDGES.items() if under(m, side)
                 for t in ts if under(t, HTTP_SIDE) and not schema(t))
    assert bad == []


def test_the_framework_outside_the_http_side_never_reaches_it() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in EDGES.items()
                 if not under(m, HTTP_SIDE + ENTRIES)
                 for t in ts if under(t, "pipeserve.http") and not schema(t))
    assert bad == []


def test_the_http_side_reaches_the_core_only_through_its_face() -> None:
    used = {t for m, ts in EDGES.items() if under(m, "pipeserve.http")
            for t in ts if under(t, "pipeserve.core") and t != "pipeserve.core" and not schema(t)}
    assert used and used <= CORE_FACE, sorted(used - CORE_FACE)


def test_the_checks_see_function_level_cycles_and_stray_edges(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function, and a core module importing the HTTP
    side, are both found; a type-only import is not an edge."""
    for rel, text in {
        "pipeserve/__init__.py": "",
        "pipeserve/core/__init__.py": "",
        "pipeserve/core/a.py": "def f():\n    from pipeserve.core import b\n",
        "pipeserve/core/b.py": "import pipeserve.core.a\nfrom pipeserve.http.c import X\n",
        "pipeserve/http/__init__.py": "",
        "pipeserve/http/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pipeserve.core.a import f\nX = 1\n",
        "pipeserve/stages/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = graph(tmp_path)
    assert cycles(edges) == [["pipeserve.core.a", "pipeserve.core.b"]]
    assert "pipeserve.http.c" in edges["pipeserve.core.b"]
    assert edges["pipeserve.http.c"] == set()
