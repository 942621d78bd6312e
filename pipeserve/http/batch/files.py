"""FileStore: the uploaded and the produced files of /v1/files, each its bytes and its OpenAI
file object side by side under one directory, written atomically (a temporary file renamed),
so a crash leaves either the old state or the new. Blocking disk I/O: callers run it off the
event loop."""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

import orjson


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, never a part (rename within one dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def try_lock(path: Path) -> IO[bytes] | None:
    """`path` opened and locked (flock, exclusive) for as long as the file stays open; None when
    another process sharing the directory holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "ab")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


class FileStore:
    """Files by id: `<dir>/<id>.data` (the bytes) and `<dir>/<id>.json` (the file object)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "files"

    def create(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        fid = f"file-{uuid.uuid4().hex}"
        obj = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "expires_at": None, "filename": filename, "purpose": purpose,
               "status": "processed", "status_details": None}
        write_atomic(self.dir / f"{fid}.data", data)
        write_atomic(self.dir / f"{fid}.json", orjson.dumps(obj))   # last: the file exists
        return obj

    def get(self, fid: str) -> dict[str, Any] | None:
        if not _safe(fid):
            return None
        return read_json(self.dir / f"{fid}.json")

    def content(self, fid: str) -> bytes | None:
        if self.get(fid) is None:
            return None
        try:
            return (self.dir / f"{fid}.data").read_bytes()
        except OSError:
            return None

    def list(self, purpose: str | None) -> list[dict[str, Any]]:
        """Every file (of `purpose` when given), newest first."""
        if not self.dir.is_dir():
            return []
        found = [read_json(p) for p in self.dir.glob("file-*.json")]
        return sorted((f for f in found if f is not None
                       and (purpose is None or f.get("purpose") == purpose)),
                      key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete(self, fid: str) -> bool:
        if self.get(fid) is None:
            return False
        (self.dir / f"{fid}.json").unlink(missing_ok=True)   # first: the file is gone
        (self.dir / f"{fid}.data").unlink(missing_ok=True)
        return True


def _safe(fid: str) -> bool:
    """An id this store could have made: no path separators or dots to leave the directory."""
    return fid.startswith("file-") and fid[5:].isalnum()
