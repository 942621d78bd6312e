"""The layout move (issue 40): `pipeline/`, `stages/`, `conf/` and the root scripts go under one
`pipeserve/` package, grouped by concern, and `tests/pipeline/` splits into a mirror of it.

Run once from the repository root on a clean tree: it `git mv`s every file in MOVES, then
rewrites every reference in tracked text files (dotted module names, `from pkg import module`
lines, file paths). Deterministic, so a branch cut before the move can replay it (run it on the
branch, commit, then merge main). Hand edits after the move live in their own commits."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# old path -> new path (files or folders); everything else under pipeline/ keeps its place
# under pipeserve/
MOVES = {
    "pipeline/adapters.py": "pipeserve/adapters/lora.py",
    "pipeline/core/adapter_swap.py": "pipeserve/adapters/swap.py",
    "pipeline/blas.py": "pipeserve/model/blas.py",
    "pipeline/loader.py": "pipeserve/model/loader.py",
    "pipeline/model_cache.py": "pipeserve/model/cache.py",
    "pipeline/embedded.py": "pipeserve/model/embedded/smollm2.py",
    "pipeline/embedded_gemma3.py": "pipeserve/model/embedded/gemma3.py",
    "pipeline/gguf.py": "pipeserve/model/gguf/convert.py",
    "pipeline/gguf_arch.py": "pipeserve/model/gguf/arch.py",
    "pipeline/gguf_quants.py": "pipeserve/model/gguf/quants.py",
    "pipeline/gguf_tokenizer.py": "pipeserve/model/gguf/tokenizer.py",
    "pipeline/tiny.py": "pipeserve/model/tiny/text.py",
    "pipeline/tiny_audio.py": "pipeserve/model/tiny/audio.py",
    "pipeline/tiny_embed.py": "pipeserve/model/tiny/embed.py",
    "pipeline/tiny_vlm.py": "pipeserve/model/tiny/vlm.py",
    "pipeline/embedding.py": "pipeserve/embed/engine.py",
    "pipeline/scoring.py": "pipeserve/core/scoring.py",
    "pipeline/grammar.py": "pipeserve/grammar/constraint.py",
    "pipeline/think_grammar.py": "pipeserve/grammar/think.py",
    "pipeline/tool_grammar.py": "pipeserve/grammar/tool.py",
    "pipeline/turn_grammar.py": "pipeserve/grammar/turn.py",
    "pipeline/markup.py": "pipeserve/markup/output.py",
    "pipeline/tool_formats": "pipeserve/markup/tool_formats",
    "pipeline/offload.py": "pipeserve/eventloop/offload.py",
    "pipeline/template_sandbox.py": "pipeserve/eventloop/template_sandbox.py",
    "pipeline/token_bound.py": "pipeserve/eventloop/token_bound.py",
    "pipeline/latency.py": "pipeserve/eventloop/latency.py",
    "pipeline/waits.py": "pipeserve/http/waits.py",
    "pipeline/static": "pipeserve/http/static",
    "pipeline/launch.py": "pipeserve/launch/checks.py",
    "pipeline/logs.py": "pipeserve/launch/logs.py",
    "pipeline/run_files.py": "pipeserve/launch/run_files.py",
    "pipeline": "pipeserve",
    "stages": "pipeserve/stages",
    "conf": "pipeserve/conf",
    "serve.py": "pipeserve/launch/serve.py",
    "bench.py": "pipeserve/bench/run.py",
    "bench_plots.py": "pipeserve/bench/plots.py",
    "bench_vision.py": "pipeserve/bench/vision.py",
}
NEW_PACKAGES = ["pipeserve/adapters", "pipeserve/model", "pipeserve/model/embedded",
                "pipeserve/model/gguf", "pipeserve/model/tiny", "pipeserve/embed",
                "pipeserve/grammar", "pipeserve/markup", "pipeserve/eventloop",
                "pipeserve/launch", "pipeserve/bench"]
# tests/pipeline/<file> -> tests/<area>/<file>
TEST_AREAS = {
    "adapters": ["test_adapters.py", "test_multi_adapters.py"],
    "kv": ["test_attention.py", "test_kv_layouts.py", "test_kv_paged.py", "test_kv_protocol.py",
           "test_kv_quantized.py", "test_kv_turbo.py"],
    "vision": ["test_audio_decode.py", "test_vision_deepstack.py", "test_vision_media.py",
               "test_vision_text_only.py", "test_vision_video.py"],
    "core": ["test_batching.py", "test_dispatch_late.py", "test_engine.py", "test_fidelity.py",
             "test_priority.py", "test_row_isolation.py", "test_scheduler.py", "test_shapes.py",
             "test_stage_contract.py", "test_store.py", "test_stream_store.py"],
    "model": ["test_blas.py", "test_embedded_gemma3.py", "test_gguf.py", "test_gguf_archs.py",
              "test_gguf_quants.py", "test_gguf_tokenizer.py", "test_tiny.py"],
    "distributed": ["test_distributed_units.py"],
    "draft": ["test_draft_units.py", "test_speculative.py"],
    "markup": ["test_family_templates.py", "test_markup.py", "test_reasoning.py",
               "test_tool_families.py", "test_tools.py", "templates"],
    "grammar": ["test_grammar.py", "test_think_grammar.py", "test_tool_grammar.py"],
    "http": ["test_json_body.py"],
    "pool": ["test_pool_units.py"],
    "prompt_cache": ["test_prompt_cache.py"],
    ".": ["test_import_graph.py"],
}
TEST_MOVES = {f"tests/pipeline/{name}": (f"tests/{name}" if area == "." else f"tests/{area}/{name}")
              for area, names in TEST_AREAS.items() for name in names}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".html", ".json",
                 ".ini", ""}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def old_files() -> list[str]:
    return [p for p in git("ls-files").splitlines()]


def new_path(old: str) -> str | None:
    """Where a tracked file moves (the longest MOVES / TEST_MOVES prefix), or None."""
    for table in (TEST_MOVES, MOVES):
        for src in sorted(table, key=len, reverse=True):
            if old == src or old.startswith(src + "/"):
                return table[src] + old[len(src):]
    return None


def module_of(path: str) -> str | None:
    if not path.endswith(".py"):
        return None
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def module_map(files: list[str]) -> dict[str, str]:
    """Old dotted module -> new dotted module, for every moved module and package."""
    out = {}
    for old in files:
        new = new_path(old)
        if new and old.endswith(".py"):
            out[module_of(old)] = module_of(new)
    # packages whose folder moved whole
    for src, dst in MOVES.items():
        if not src.endswith(".py"):
            out.setdefault(src.replace("/", "."), dst.replace("/", "."))
    for src, dst in TEST_MOVES.items():
        if src.endswith(".py"):
            out[module_of(src)] = module_of(dst)
    out["bench"] = "pipeserve.bench.run"
    out["bench_plots"] = "pipeserve.bench.plots"
    out["bench_vision"] = "pipeserve.bench.vision"
    return out


def path_map(files: list[str]) -> dict[str, str]:
    out = {}
    for old in files:
        new = new_path(old)
        if new:
            out[old] = new
    for src, dst in {**MOVES, **TEST_MOVES}.items():
        out.setdefault(src, dst)
    return out


TOPS = ("pipeline", "stages", "tests")


def rewrite(text: str, mods: dict[str, str], paths: dict[str, str]) -> str:
    def longest(dotted: str) -> tuple[str, str] | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in mods:
                return head, ".".join(parts[n:])
        return None

    # `from A import m1, m2 as x` where A.m is a moved module: one line per module
    def from_import(m: re.Match) -> str:
        indent, pkg, names, tail = m.group(1), m.group(2), m.group(3), m.group(4)
        if "(" in names:
            return m.group(0)
        items = [n.strip() for n in names.split(",") if n.strip()]
        lines = []
        plain = []
        for item in items:
            name, _, alias = item.partition(" as ")
            name, alias = name.strip(), alias.strip()
            dst = mods.get(f"{pkg}.{name}")
            parent, _, leaf = (dst or "").rpartition(".")
            if dst and (parent != mods.get(pkg, pkg) or leaf != name):
                local = alias or name
                lines.append(f"{indent}from {parent} import {leaf}"
                             + (f" as {local}" if local != leaf else ""))
            else:
                plain.append(item)
        if plain:
            lines.insert(0, f"{indent}from {mods.get(pkg, pkg)} import {', '.join(plain)}")
        return "\n".join(lines) + tail

    text = re.sub(r"(?m)^([ \t]*)from ((?:pipeline|stages)(?:\.\w+)*) import ([^\n#]+?)([ \t]*(?:#[^\n]*)?)$",
                  from_import, text)
    # the root scripts imported as modules
    text = re.sub(r"(?m)^([ \t]*)import (bench_vision|bench_plots|bench)\b(?! as)",
                  lambda m: f"{m.group(1)}from pipeserve.bench import "
                            f"{mods[m.group(2)].rpartition('.')[2]} as {m.group(2)}", text)
    text = re.sub(r"(?m)^([ \t]*)from (bench|bench_plots|bench_vision) import",
                  lambda m: f"{m.group(1)}from {mods[m.group(2)]} import", text)

    # dotted names: pipeline.x.y, stages.x, tests.pipeline.test_x
    def dotted(m: re.Match) -> str:
        name = m.group(0)
        hit = longest(name)
        if hit is None:
            return name
        head, rest = hit
        if head in TOPS or rest.startswith("_target_"):
            return name  # `pipeline.sample._target_`, `pipeline.draft._target_`: config keys
        return mods[head] + ("." + rest if rest else "")

    text = re.sub(r"(?<![\w./\-])(?:pipeline|stages|tests)(?:\.\w+)+", dotted, text)
    text = re.sub(r"(?m)^([ \t]*)import pipeline\b(?!\.)", r"\1import pipeserve", text)

    # file paths: pipeline/x.py, stages/x.py, conf/..., tests/pipeline/x.py, bench_plots.py
    def path(m: re.Match) -> str:
        whole = m.group(0)
        p = whole.rstrip(".")
        dots = whole[len(p):]
        stem = p.rstrip("/")
        for src in sorted(paths, key=len, reverse=True):
            if stem == src or stem.startswith(src + "/"):
                return paths[src] + p[len(src):] + dots
        return whole

    text = re.sub(r"(?<![\w./\-])(?:pipeline|stages|conf|tests/pipeline)(?:/[\w.\-*]*)+", path, text)
    text = re.sub(r"(?<![\w./\-])(bench_plots|bench_vision)\.py\b",
                  lambda m: paths[m.group(0)], text)
    return text


def main() -> None:
    if git("status", "--porcelain").strip():
        sys.exit("move_layout: the tree has uncommitted changes")
    files = old_files()
    mods = module_map(files)
    paths = path_map(files)
    for old in files:
        new = new_path(old)
        if new:
            (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
            git("mv", old, new)
    for pkg in NEW_PACKAGES + [f"tests/{a}" for a in TEST_AREAS if a != "."]:
        init = ROOT / pkg / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text("")
            git("add", str(init.relative_to(ROOT)))
    for rel in git("ls-files").splitlines():
        f = ROOT / rel
        if f.suffix not in TEXT_SUFFIXES or not f.is_file() or rel.startswith("scripts/move_layout"):
            continue
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite(text, mods, paths)
        if new != text:
            f.write_text(new)


if __name__ == "__main__":
    main()
