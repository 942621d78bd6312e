"""The import graph of pipeserve/: the engine core (pipeserve/core/) and the stages never reach
the HTTP side (pipeserve/http/, and the model pool that serves several engines behind it); the
HTTP side reaches the core only through the engine's face (EngineClient, its commands and
events, the request streams, its published limits, prompt scoring) and reads nothing of an
engine but that face; every `pipeserve.*` import names a
module of this tree; and no two modules import each other, directly or through others, at any
depth — a function-level import counts like a module-level one. Only `if TYPE_CHECKING:` blocks
are left out: they never run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTTP_SIDE = ("pipeserve.http", "pipeserve.pool")
CORE_FACE = {"pipeserve.core.client", "pipeserve.core.engine", "pipeserve.core.events",
             "pipeserve.core.stream", "pipeserve.core.limits", "pipeserve.core.scoring"}
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


# What an engine keeps to itself: the HTTP side reads its published EngineLimits and EngineLoad
# (pipeserve/core/client.py) instead.
ENGINE_INTERNALS = {"scheduler", "memory", "kv_pool_bytes", "loaded"}
# the HTTP side: the server, the pool, and the request stages that run on the event loop
FACE_READERS = ("pipeserve/http", "pipeserve/pool", "pipeserve/eventloop",
                "pipeserve/stages/tokenize.py", "pipeserve/stages/admission.py",
                "pipeserve/stages/detokenize.py")


def _names_an_engine(node: ast.expr) -> bool:
    """`engine`, `ctx.engine`, `self._engine`, `m.engine`: an expression ending in an engine."""
    last = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return "engine" in last.lower()


def internal_reads(path: Path, rel: str) -> list[str]:
    """`<an engine>.scheduler` (and the other internals) anywhere in the file, and
    `self.<internal>` inside a class named *Engine (a client that keeps them is one the HTTP
    side could read them of). A method call (`pool.loaded(m)`) is no read."""
    tree = ast.parse(path.read_text(), str(path))
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
                and id(node) not in calls and _names_an_engine(node.value)):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if cls.name.endswith("Engine"):
            found += [f"{rel}:{n.lineno}: {cls.name} keeps {ast.unparse(n)}"
                      for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                      and n.attr in ENGINE_INTERNALS and isinstance(n.value, ast.Name)
                      and n.value.id == "self"]
    return found


def face_readers(root: Path) -> list[tuple[Path, str]]:
    files = []
    for where in FACE_READERS:
        path = root / where
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [(f, str(f.relative_to(root))) for f in files if f.exists()]


def test_the_http_side_reads_nothing_of_an_engine_but_its_client() -> None:
    bad = [hit for path, rel in face_readers(ROOT) for hit in internal_reads(path, rel)]
    assert bad == []


def test_the_face_check_sees_internal_reads(tmp_path: Path) -> None:
    """The check fails on each kind of read it exists for, and passes the published values."""
    (tmp_path / "pipeserve/http").mkdir(parents=True)
    (tmp_path / "pipeserve/http/a.py").write_text(
        "def f(ctx, engine, limits, pool, m):\n"
        "    ctx.engine.scheduler.max_batch\n"
        "    engine.memory\n"
        "    m.engine.kv_pool_bytes\n"
        "    ctx.engine.loaded.adapters\n"
        "    engine.limits.memory, limits.model, engine.load().num_queued\n"
        "    pool.loaded(m)\n"
        "class ChildEngine:\n"
        "    def __init__(self):\n"
        "        self.loaded = None\n")
    hits = [h for p, rel in face_readers(tmp_path) for h in internal_reads(p, rel)]
    assert sorted(h.split(": ", 1)[1] for h in hits) == sorted([
        "ctx.engine.scheduler", "engine.memory", "m.engine.kv_pool_bytes", "ctx.engine.loaded",
        "ChildEngine keeps self.loaded"])
