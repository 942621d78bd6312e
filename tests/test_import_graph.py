"""The import graph of pipeserve/: the engine core (pipeserve/core/) and the stages never reach
the HTTP side (pipeserve/http/, and the model pool that serves several engines behind it); the
HTTP side reaches the core only through the engine's face (EngineClient, its commands and
events, the request streams, its published limits, prompt scoring) and reads nothing of an
engine but that face; every `pipeserve.*` import names a
module of this tree; and no two modules import each other, directly or through others, at any
depth. Every import is an edge: a function-level one and a type-only one (`if TYPE_CHECKING:`)
count like a module-level one. A function-level import of a module of the tree is allowed only
where LAZY says why it must stay lazy."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTTP_SIDE = ("pipeserve.http", "pipeserve.pool")
CORE_FACE = {"pipeserve.core.client", "pipeserve.core.engine", "pipeserve.core.events",
             "pipeserve.core.stream", "pipeserve.core.limits", "pipeserve.core.scoring"}
# the entry points: they build the app, so they sit above the HTTP side
ENTRIES = ("pipeserve.launch.serve", "pipeserve.bench")
# (importer, imported) → why the import stays inside a function. Each keeps mlx (and, for the
# server, sanic) out of a process or a check that must not load it; nothing else is lazy.
LAZY = {
    ("pipeserve.launch.serve", "pipeserve.http.server"):
        "the config is checked before anything loads: the app loads mlx and sanic",
    ("pipeserve.launch.serve", "pipeserve.model.loader"):
        "the config is checked before anything loads: the loader's LoRA layers load mlx",
    ("pipeserve.launch.serve", "pipeserve.launch.fit"):
        "`pipeserve fit` reads a checkpoint's headers through the loader (mlx): only when asked",
    ("pipeserve.launch.serve", "pipeserve.distributed.follower"):
        "the config is checked before anything loads: a follower imports the engine",
    ("pipeserve.memory", "pipeserve.kv.attention"):
        "memory imports mlx only where it measures, so the scheduler that reads it loads none",
    ("pipeserve.bench.run", "pipeserve.model.loader"):
        "the bench's client process loads no mlx; the server process it starts does",
    ("pipeserve.model.tiny.text", "pipeserve.draft.mtp"):
        "the generator (and the bench workloads that read its corpus) loads mlx-lm only "
        "when it builds an MTP head",
}


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
    """Every `pipeserve.*` name a file imports, at any depth, type-only ones included
    (`from a.b import c` gives a.b and a.b.c: c may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names.update(imported(node))
    return {n for n in names if n.split(".")[0] == "pipeserve"}


def imported(node: ast.AST) -> list[str]:
    """The names one import statement imports (none for any other node)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def lazy_imports(root: Path) -> set[tuple[str, str]]:
    """(importer, imported module) for every import of a module of the tree made inside a
    function, at any depth."""
    mods = modules(root)
    found = set()
    for name, path in mods.items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                # `from a import b`: the module a.b if there is one, else a
                wanted = imported(node)[1:] if isinstance(node, ast.ImportFrom) else imported(node)
                found.update((name, t) for n in wanted if n.split(".")[0] == "pipeserve"
                             and (t := resolve(mods, n)) is not None and t != name)
    return found


def resolve(mods: dict[str, Path], name: str) -> str | None:
    """The longest prefix of `name` that is a module of the tree."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the tree it imports (a name resolves to its longest module
    prefix; a package's own name is an edge to its __init__)."""
    mods = modules(root)
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {resolve(mods, n) for n in imports(path)}
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


def test_function_level_imports_of_the_tree_are_only_those_on_the_allow_list() -> None:
    """A new lazy import of a pipeserve module fails here (move it to the module's top, or
    say in LAZY why it cannot be); an entry whose import went away fails too."""
    assert sorted(lazy_imports(ROOT)) == sorted(LAZY)


@pytest.mark.parametrize(("module", "unloaded"), [
    ("pipeserve.launch.serve", ("mlx", "mlx_lm", "sanic")),   # with every group's schema
    ("pipeserve.core.scheduler", ("mlx",)),
    ("pipeserve.bench.run", ("mlx",)),
    ("pipeserve.model.tiny.text", ("mlx_lm",)),
])
def test_what_the_lazy_imports_keep_unloaded_stays_unloaded(module: str,
                                                            unloaded: tuple[str, ...]) -> None:
    """LAZY's reasons hold: importing the launch (the config check: a bad override fails
    before anything loads), the scheduler, the bench's client or the tiny-model generator
    loads none of what its lazy imports keep out."""
    probe = (f"import sys, {module}\n"
             f"print(sorted(m for m in {unloaded!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_checks_see_function_level_and_type_only_cycles_and_stray_edges(
        tmp_path: Path) -> None:
    """A cycle closed by an import inside a function, one closed by a type-only import, a
    core module importing the HTTP side, and a function-level import are all found."""
    for rel, text in {
        "pipeserve/__init__.py": "",
        "pipeserve/core/__init__.py": "",
        "pipeserve/core/a.py": "def f():\n    from pipeserve.core import b\n",
        "pipeserve/core/b.py": "import pipeserve.core.a\nfrom pipeserve.http.c import X\n",
        "pipeserve/http/__init__.py": "",
        "pipeserve/http/c.py": "X = 1\n",
        "pipeserve/http/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pipeserve.http.e import Y\nZ = 1\n",
        "pipeserve/http/e.py": "from pipeserve.http.d import Z\nY = 1\n",
        "pipeserve/stages/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = graph(tmp_path)
    assert sorted(cycles(edges)) == [["pipeserve.core.a", "pipeserve.core.b"],
                             ["pipeserve.http.d", "pipeserve.http.e"]]
    assert "pipeserve.http.c" in edges["pipeserve.core.b"]
    assert lazy_imports(tmp_path) == {("pipeserve.core.a", "pipeserve.core.b")}


# What an engine keeps to itself: the HTTP side reads its published EngineLimits and EngineLoad
# (pipeserve/core/client.py) instead.
ENGINE_INTERNALS = {"scheduler", "memory", "kv_pool_bytes", "loaded"}
# the HTTP side: the server, the pool, and the request stages that run on the event loop
FACE_READERS = ("pipeserve/http", "pipeserve/pool", "pipeserve/eventloop",
                "pipeserve/stages/tokenize.py", "pipeserve/stages/admission.py",
                "pipeserve/stages/detokenize.py", "pipeserve/markup/chat_prompt.py",
                "pipeserve/vision/placeholders.py")


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
