"""The batch store's results log as a restart reads it: a result line cut short by a crash is
a line not finished (it runs again), every whole line before it is kept; and a second process
cannot claim a batch that one already runs."""
from __future__ import annotations

from pathlib import Path

from pipeserve.http.batch.store import BatchStore, new_batch


def test_a_cut_result_line_runs_again(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = new_batch("file-x", "/v1/chat/completions", "24h", None, 3)
    store.save(batch)
    store.append(batch["id"], 0, True, {"custom_id": "a"})
    store.append(batch["id"], 2, False, {"custom_id": "c"})
    with open(tmp_path / "batches" / batch["id"] / "results.jsonl", "ab") as f:
        f.write(b'{"index": 1, "ok": tr')   # the crash came mid-write
    assert store.results(batch["id"]) == {0: (True, {"custom_id": "a"}),
                                          2: (False, {"custom_id": "c"})}
    assert store.get(batch["id"])["request_counts"]["total"] == 3
    assert store.get("batch_../../etc") is None


def test_one_process_runs_a_batch(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = new_batch("file-x", "/v1/chat/completions", "24h", None, 1)
    store.save(batch)
    held = store.claim(batch["id"])
    assert held is not None
    other = BatchStore(tmp_path).claim(batch["id"])   # flock: per open file, as another process
    assert other is None
    held.close()
    again = store.claim(batch["id"])
    assert again is not None
    again.close()
