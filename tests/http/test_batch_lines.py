"""A batch input read as OpenAI reads it, without a server: every line a request or an error
line of its own (with the file's line number), a JSON string holding U+2028 kept whole, a file
with no request refused; and a batch past its completion window ends `expired`, its unsent
lines in the error file as `batch_expired`; a batch a stopped server left `cancelling` ends
cancelled with the lines that had finished, unless its lines went to a model not served here."""
from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from pipeserve.errors import InvalidRequest
from pipeserve.http.batch import lines as L
from pipeserve.http.batch.files import FileStore
from pipeserve.http.batch.runner import BatchRunner
from pipeserve.http.batch.store import BatchStore, new_batch

URL = "/v1/chat/completions"


def row(cid: str, url: str = URL, **body: object) -> bytes:
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": url,
                         "body": {"messages": [{"role": "user", "content": "hi\u2028there"}],
                                  **body}})


def test_each_line_is_a_request_or_its_own_error() -> None:
    data = b"\n".join([row("a"), b"", b"{oops", row("b", url="/v1/embeddings"),
                       row("c", stream=True), b'{"custom_id": 5}', row("d")]) + b"\n"
    got = L.parse(data, URL)
    assert [(x.custom_id, x.code) for x in got] == [
        ("a", None), (None, "invalid_json_line"), ("b", "invalid_url"), ("c", "invalid_value"),
        (None, "missing_required_parameter"), ("d", None)]
    assert got[0].body["messages"][0]["content"] == "hi\u2028there"   # not cut at U+2028
    assert got[1].message.startswith("line 3 is not JSON")   # the file's line number
    assert "this batch's endpoint is '/v1/chat/completions'" in got[2].message


def test_a_body_nested_past_what_orjson_writes_is_an_error_line() -> None:
    """A line's body is sent on as JSON, which orjson writes to 254 levels (it reads 1024): a
    body nested deeper is an error line of its own naming the limit, not a batch that fails
    whole with the writer's exception."""
    def nested(cid: str, levels: int) -> bytes:   # x: `levels` arrays, one in another
        return row(cid, x=0).replace(b'"x":0', b'"x":' + b"[" * levels + b"]" * levels)
    # the body's own object and 253 arrays: 254 levels; with 254 arrays, 255
    kept, refused = L.parse(nested("a", 253) + b"\n" + nested("b", 254), URL)
    assert kept.code is None and orjson.loads(orjson.dumps(kept.body)) == kept.body
    assert (refused.custom_id, refused.code, refused.body) == ("b", "invalid_value", None)
    assert refused.message.startswith("line 2: body nests arrays/objects deeper than 254 levels")


@pytest.mark.parametrize("data, words", [
    (b"", "has no lines"), (b"\xff\xfe", "not UTF-8"), (b"[1]\n{x\n", "no line of the input"),
    (row("a") + b"\n" + row("a"), "used by an earlier line")])
def test_a_file_with_no_request_is_refused(data: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as e:
        L.parse(data, URL)
    assert e.value.param == "input_file_id"


def test_a_batch_past_its_window_expires(tmp_path: Path) -> None:
    files, store = FileStore(tmp_path), BatchStore(tmp_path)
    up = files.create(row("a") + b"\n" + row("b"), "in.jsonl", "batch")
    batch = new_batch(up["id"], URL, "24h", None, 2)
    batch["expires_at"] = batch["created_at"] - 1
    store.save(batch)

    async def run() -> None:   # no line is sent: nothing listens on the runner's address
        runner = BatchRunner(files, store, "http://127.0.0.1:9", {}, 1)
        runner.start(batch["id"])
        await runner.tasks[batch["id"]]
    asyncio.run(run())
    done = store.get(batch["id"])
    assert done["status"] == "expired" and done["expired_at"] is not None
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    errors = [orjson.loads(x) for x in files.content(done["error_file_id"]).splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("a", "batch_expired"),
                                                                      ("b", "batch_expired")]


def test_a_batch_left_cancelling_ends_cancelled_with_its_finished_lines(tmp_path: Path) -> None:
    """A server that stopped mid-cancel: the next one ends the batch with what had finished."""
    files, store = FileStore(tmp_path), BatchStore(tmp_path)
    up = files.create(row("a") + b"\n" + row("b"), "in.jsonl", "batch")
    batch = new_batch(up["id"], URL, "24h", None, 2)
    batch["status"] = "cancelling"
    store.save(batch)
    answered = L.response_line(L.parse(row("a"), URL)[0], 200, "chatcmpl-1", {"id": "chatcmpl-1"})
    store.append(batch["id"], 0, True, answered)

    async def run() -> None:
        await BatchRunner(files, store, "http://127.0.0.1:9", {}, 1).resume(lambda _: True)
    asyncio.run(run())
    done = store.get(batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert orjson.loads(files.content(done["output_file_id"]))["custom_id"] == "a"


def test_a_batch_for_a_model_not_served_here_is_left_open(tmp_path: Path) -> None:
    """Another server on the same directory created it: this one neither runs nor ends it."""
    files, store = FileStore(tmp_path), BatchStore(tmp_path)
    up = files.create(row("a"), "in.jsonl", "batch")
    batch = new_batch(up["id"], URL, "24h", None, 1, ["other-model"])
    batch["status"] = "cancelling"
    store.save(batch)
    asked: list[list[str]] = []

    def serves(models: list[str]) -> bool:
        asked.append(models)
        return "other-model" not in models

    async def run() -> None:
        await BatchRunner(files, store, "http://127.0.0.1:9", {}, 1).resume(serves)
    asyncio.run(run())
    assert asked == [["other-model"]]
    assert store.get(batch["id"])["status"] == "cancelling"   # left for its own server
