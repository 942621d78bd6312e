"""`pip install .` (not editable) as a user on a fresh machine does it: the wheel holds every
module of the source tree, the config as package data and the chat page; the installed
`pipeserve` command, run outside the checkout, serves a real request."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import openai
import pytest

from tests.conftest import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "runs", "build", "site", "__pycache__", "*.egg-info",
                              "tests", "docs", "bench-out", ".venv")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "pipeserve"
    shutil.copytree(ROOT, src, ignore=SKIP)   # build/ stays out of the checkout
    (src / "docs").mkdir()
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return next(out.glob("pipeserve-*.whl"))


def test_the_wheel_holds_every_module_the_config_and_the_page(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pipeserve").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - names == set(), "modules left out of the wheel (pyproject: packages)"
    conf = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pipeserve" / "conf").rglob("*.yaml")}
    assert conf - names == set(), "config files left out of the wheel"
    assert {"pipeserve/http/static/chat.html", "pipeserve/http/static/favicon.svg"} <= names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pipeserve"}, "one top-level package, nothing generic in site-packages"
    entry = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "pipeserve = pipeserve.launch.serve:main" in entry


def test_the_installed_command_serves_outside_the_checkout(wheel: Path, tmp_path: Path,
                                                           model_cache: Path) -> None:
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                           "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    command = [sys.executable, str(target / "bin" / "pipeserve")]   # its shebang's python
    helped = subprocess.run([*command, "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "kv " in helped.stdout, helped.stdout + helped.stderr
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([*command, "model=tiny", f"server.port={port}",
                             f"model.cache_dir={model_cache}"], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, "pipeserve",
                  lambda: (tmp_path / "serve.log").read_text(errors="replace"), 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        text = (tmp_path / "serve.log").read_text()
        assert str(target / "pipeserve") in _module_path(env, tmp_path), "ran the checkout's code"
        assert "chat page http://127.0.0.1:" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]


def _module_path(env: dict[str, str], cwd: Path) -> str:
    return subprocess.run([sys.executable, "-c", "import pipeserve; print(pipeserve.__file__)"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=60).stdout
