"""The README's and docs' command blocks, run as a reader would paste them into bash.

A `run` block goes to bash as written against a real server on 127.0.0.1 (model=tiny, or the
marker's overrides, or the launch line the block itself starts with); `localhost:8080` is
that server's address, files it names (cat.png) are generated beside it. A `transcript`'s
commands must print the lines the page shows after each. A `launch` block's
lines are started as written, with `~/models/NAME` a generated model under that name in a
fresh HOME, and each must serve a request. Which blocks carry which marker, and that none is
unmarked, is tests/test_docs.py's check (tests/doc_blocks.py reads the markers)."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.conftest import ROOT, free_port, wait_http
from tests.doc_blocks import Block, command_blocks

LAUNCH = re.compile(r"^(?:pipeserve|python serve\.py)(?: +(?!fit\b)(.*))?$")   # not `fit`
ADDRESS = re.compile(r"(?:https?://)?(?:localhost|127\.0\.0\.1):8080")


def _marked(kind: str) -> list[Block]:
    return [b for b in command_blocks() if b.marker and b.kind()[0] == kind]


def _shell_env(home: Path, cache: Path) -> dict[str, str]:
    """bash finds this interpreter's `python` and `pipeserve` first; HOME is a fresh one, and
    generated models come from the session's cache."""
    home.mkdir(parents=True, exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "HOME": str(home), "HF_HUB_OFFLINE": "1",
            "PIPESERVE_CACHE": str(cache)}


def _uncommented(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line).strip()


def _split_launch(script: str) -> tuple[list[str] | None, str]:
    """A block that starts its own server (`python serve.py pool=example` then curls): that
    launch's overrides, and the rest of the block."""
    lines = script.splitlines()
    for i, line in enumerate(lines):
        m = LAUNCH.match(_uncommented(line))
        if m:
            return shlex.split(m.group(1) or ""), "\n".join(lines[:i] + lines[i + 1:]) + "\n"
    return None, script


def _media(where: Path, script: str) -> None:
    """The files a block reads from its directory, generated."""
    if "cat.png" in script:
        from PIL import Image
        Image.new("RGB", (64, 48), (200, 120, 40)).save(where / "cat.png")


@pytest.fixture(scope="module")
def servers(server_factory: Any) -> Any:
    """One real server per distinct set of overrides, shared by the blocks that use it."""
    started: dict[tuple[str, ...], Any] = {}

    def get(overrides: list[str]) -> Any:
        key = tuple(overrides)
        if key not in started:
            started[key] = server_factory(*overrides)
        return started[key]
    return get


@pytest.mark.parametrize("block", _marked("run"), ids=lambda b: b.where)
def test_a_documented_command_block_runs_as_written(block: Block, servers: Any, tmp_path: Path,
                                                    model_cache: Path) -> None:
    """bash -e runs the block as pasted; it exits 0, prints something, and prints no error
    object unless the marker names the one it documents."""
    _, on, expect = block.kind()
    launched, script = _split_launch(block.commands())
    if ADDRESS.search(script):
        server = servers(shlex.split(on) if on else launched or [])
        script = ADDRESS.sub(server.base_url, script)
    _media(tmp_path, script)
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, env=_shell_env(tmp_path / "home", model_cache), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and done.stdout.strip(), (block.where, done.returncode, out)
    if expect:
        assert expect in done.stdout, (block.where, out)
    else:
        assert not re.search(r'"error"\s*:\s*[{"]', done.stdout), (block.where, out)   # not null


@pytest.mark.parametrize("block", _marked("transcript"), ids=lambda b: b.where)
def test_a_documented_transcript_prints_what_the_page_shows(block: Block, tmp_path: Path,
                                                            model_cache: Path) -> None:
    """`$ command` and the lines the page shows after it (an error example, say): run by bash,
    the command prints each of those lines, in order, whatever its exit code."""
    env = _shell_env(tmp_path / "home", model_cache)
    runs = {command: subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for command, _ in block.transcript()}   # all at once: each is a fresh process
    for command, shown in block.transcript():
        printed = [x.rstrip() for x in runs[command].communicate(timeout=300)[0].splitlines()]
        at = 0
        for line in shown:
            assert line in printed[at:], (block.where, command, line, printed)
            at = printed.index(line, at) + 1


def _launch_lines() -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for block in _marked("launch"):
        for line in block.commands().splitlines():
            if _uncommented(line):
                seen.setdefault(_uncommented(line), block.where)
    return [(line, where) for line, where in seen.items()]


def _stand_ins(home: Path, lines: list[str], model_cache: Path) -> None:
    """Each `~/models/NAME` the launches name is a generated model (model=tiny's files)."""
    tiny = ensure_model(cache_dir=model_cache)
    for name in {n for line in lines for n in re.findall(r"~/models/([\w.-]+)", line)}:
        (home / "models").mkdir(parents=True, exist_ok=True)
        (home / "models" / name).symlink_to(tiny, target_is_directory=True)


def test_the_documented_launches_start_and_serve(tmp_path: Path, model_cache: Path) -> None:
    """Every line of a `launch` block, started by bash as written (all at once), answers a
    chat request under the model id the docs imply, then drains on SIGTERM."""
    lines = _launch_lines()
    assert lines
    home = tmp_path / "home"
    env = _shell_env(home, model_cache)
    _stand_ins(home, [line for line, _ in lines], model_cache)
    procs = []
    for i, (line, where) in enumerate(lines):
        port = free_port()
        extra = f"server.port={port} hydra.run.dir={tmp_path / str(i)}"
        log = open(tmp_path / f"{i}.log", "wb")   # `python serve.py` runs in a checkout
        proc = subprocess.Popen(["bash", "-c", f"exec {line} {extra}"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        procs.append((f"{where}: {line}", port, proc, log, tmp_path / f"{i}.log"))
    try:
        for what, port, proc, _, log_path in procs:
            wait_http(f"http://127.0.0.1:{port}/health", proc, what, log_path.read_text, 300)
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                               json={"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2})
            assert reply.status_code == 200, (what, reply.text)
            named = re.search(r"~/models/([\w.-]+)|model=(\w+)", what)
            want = (named.group(1) or named.group(2)) if named else "smollm2"
            assert reply.json()["model"] == want, (what, reply.json()["model"])
    finally:
        for _, _, proc, _, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for what, _, proc, log, _ in procs:
            try:
                assert proc.wait(60) == 0, (what, "did not drain on SIGTERM")
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
                log.close()
