"""BackgroundStore: each background response's state on disk, so a restart loses none of them:
`<dir>/responses/<id>.json` holds the request body as sent, its status, the generated token ids
so far (a checkpoint) and, once it ended, the response object and the conversation
`previous_response_id` continues. Each write replaces the whole file atomically; an older
write that lands after a newer one is dropped. `<id>.lock` is held (flock) by the server that
runs the response, so two servers sharing the directory never run it twice. Blocking disk I/O:
callers run it off the loop."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import IO, Any

import orjson

from pipeserve.http.batch.files import read_json, try_lock, write_atomic

OPEN = ("queued", "in_progress")   # states a restart resumes


class BackgroundStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "responses"
        self._lock = threading.Lock()
        self._revs: dict[str, int] = {}   # response id → the revision last written

    def _path(self, response_id: str, suffix: str) -> Path | None:
        if not (response_id.startswith("resp_") and response_id[5:].isalnum()):
            return None
        return self.dir / f"{response_id}{suffix}"

    def save(self, record: dict[str, Any], rev: int) -> None:
        """Write `record` (its "id" names it) unless a later revision is already written."""
        path = self._path(record["id"], ".json")
        if path is None:
            return
        with self._lock:
            if rev < self._revs.get(record["id"], -1):
                return
            self._revs[record["id"]] = rev
            write_atomic(path, orjson.dumps(record))

    def get(self, response_id: str) -> dict[str, Any] | None:
        path = self._path(response_id, ".json")
        return read_json(path) if path is not None else None

    def all(self) -> list[dict[str, Any]]:
        if not self.dir.is_dir():
            return []
        found = (read_json(p) for p in self.dir.glob("resp_*.json"))
        return sorted((r for r in found if r is not None and "id" in r),
                      key=lambda r: (r.get("created_at", 0), r["id"]))

    def claim(self, response_id: str) -> IO[bytes] | None:
        """An open lock file while this process runs the response; None when another process
        sharing the directory does."""
        path = self._path(response_id, ".lock")
        if path is None:
            return None
        return try_lock(path)

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id, ".json")
        if path is None or not path.exists():
            return False
        with self._lock:
            self._revs[response_id] = 1 << 62   # a write still in flight does not bring it back
            path.unlink(missing_ok=True)
        self.unlock(response_id)
        return True

    def unlock(self, response_id: str) -> None:
        """Remove the lock file of a response no server runs any more."""
        lock = self._path(response_id, ".lock")
        if lock is not None:
            lock.unlink(missing_ok=True)

    def expire(self, ttl_s: float) -> list[dict[str, Any]]:
        """Drop the finished responses older than `ttl_s`; every record left, oldest first."""
        now = time.time()
        kept = []
        for record in self.all():
            ended = record.get("finished_at")
            if record.get("status") not in OPEN and (ended is None or now - ended > ttl_s):
                self.delete(record["id"])
            else:
                kept.append(record)
        return kept
