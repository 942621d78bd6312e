"""BatchStore: each batch's OpenAI batch object and its results on disk, under
`<dir>/batches/<id>/`: `batch.json` (rewritten atomically on each change) and `results.jsonl`
(one line appended per finished request, so a restart knows which lines are left; a line cut
short by a crash is read as not finished). Blocking disk I/O: callers run it off the loop."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from pipeserve.http.batch.files import read_json, try_lock, write_atomic

WINDOW_S = {"24h": 24 * 3600}   # completion_window values and their seconds
# the states a batch can still move out of: a restart picks these up again
OPEN = ("validating", "in_progress", "finalizing", "cancelling")


def new_batch(input_file_id: str, endpoint: str, window: str,
              metadata: dict[str, str] | None, total: int,
              models: list[str] | None = None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
            "errors": None, "input_file_id": input_file_id, "completion_window": window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S[window],
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0},
            "metadata": metadata, "usage": None,
            "_models": models or []}   # the models its lines go to (not shown)


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"

    def save(self, batch: dict[str, Any]) -> None:
        write_atomic(self.dir / batch["id"] / "batch.json", orjson.dumps(batch))

    def get(self, batch_id: str) -> dict[str, Any] | None:
        if not (batch_id.startswith("batch_") and batch_id[6:].isalnum()):
            return None
        return read_json(self.dir / batch_id / "batch.json")

    def list(self) -> list[dict[str, Any]]:
        """Every batch, newest first."""
        if not self.dir.is_dir():
            return []
        found = [read_json(p / "batch.json") for p in self.dir.iterdir() if p.is_dir()]
        return sorted((b for b in found if b is not None),
                      key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def claim(self, batch_id: str) -> Any:
        """An open lock file while this process runs the batch; None when another process
        sharing the directory already does (each line runs once)."""
        return try_lock(self.dir / batch_id / "lock")

    def append(self, batch_id: str, index: int, ok: bool, line: dict[str, Any]) -> None:
        """One finished request, durable before the counts say so."""
        with open(self.dir / batch_id / "results.jsonl", "ab") as f:
            f.write(orjson.dumps({"index": index, "ok": ok, "line": line}) + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def results(self, batch_id: str) -> dict[int, tuple[bool, dict[str, Any]]]:
        """Input line index → (ok, its output or error line), for the lines finished."""
        try:
            data = (self.dir / batch_id / "results.jsonl").read_bytes()
        except OSError:
            return {}
        done = {}
        for raw in data.splitlines():
            try:
                r = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue   # the last line, cut short by a crash: that request runs again
            done[r["index"]] = (r["ok"], r["line"])
        return done
