"""OpenAI's Files and Batch APIs through a real server and the openai SDK: a JSONL file
uploaded, listed, read back and deleted (a file over server.files_max_mb is a 413 naming it); a
batch of chat lines polled to completed whose greedy outputs equal the same requests sent live,
run at the least urgent priority class, with a bad line and a refused line in the error file;
a file with no request, an unknown endpoint or window is a 400 at create; batch lines leave a
row free, so a live request runs beside them; a cancel stops a running batch; and a batch cut
by a restart resumes its unfinished lines only, on a server of the same model."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.serve.test_openai import NO_EOS, TIMEOUT
from tests.serve.test_openapi_conformance import conforms   # OpenAI's published schemas

POLLS = 3000   # a bound on polling, not a time limit
PROMPTS = ["Name a river.", "Count to three.", "Say hello."]
# three rows: batch lines take at most two (one stays free for live requests), however many
# server.batch_concurrency allows
ARGS = ["server.files_max_mb=0.02", "server.batch_concurrency=16", "scheduler.max_batch=3"]


@pytest.fixture(scope="module")
def state(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's server and the files directory it keeps; the restart test replaces it."""
    files_dir = tmp_path_factory.mktemp("files")
    args = [f"server.files_dir={files_dir}", *ARGS]
    return {"srv": server_factory(*args), "args": args, "start": server_factory}


def client_of(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def chat_body(prompt: str, tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "logit_bias": NO_EOS}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)


def line(cid: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def submit(client: openai.OpenAI, rows: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    up = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return client.batches.create(input_file_id=up.id, endpoint=endpoint,
                                 completion_window="24h")


def poll(client: openai.OpenAI, batch_id: str, until: Any) -> Any:
    for _ in range(POLLS):
        got = client.batches.retrieve(batch_id)
        if until(got):
            return got
        time.sleep(0.02)
    raise AssertionError(f"{batch_id} still {got.status} after {POLLS} polls")


def ended(b: Any) -> bool:
    return b.status in ("completed", "failed", "cancelled", "expired")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()] \
        if file_id else []


def test_files_upload_list_content_delete_and_limits(state: dict[str, Any]) -> None:
    client = client_of(state["srv"])
    data = jsonl([line("a", chat_body("hi", 2))])
    up = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert (up.object, up.purpose, up.bytes, up.filename) == ("file", "batch", len(data),
                                                             "mine.jsonl")
    conforms("OpenAIFile", up.model_dump(exclude_unset=True))
    assert client.files.retrieve(up.id).id == up.id
    listed = httpx.get(f"{state['srv'].base_url}/v1/files?purpose=batch").json()
    conforms("ListFilesResponse", listed)
    assert up.id in [f["id"] for f in listed["data"]]
    assert client.files.content(up.id).content == data
    deleted = client.files.delete(up.id)
    conforms("DeleteFileResponse", deleted.model_dump(exclude_unset=True))
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)
    with pytest.raises(openai.APIStatusError, match=r"server.files_max_mb \(0.02 MB\)") as e:
        client.files.create(file=("big.jsonl", b"x" * 30_000), purpose="batch")
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose is 'fine-tune'; allowed: batch"):
        client.files.create(file=("f.jsonl", data), purpose="fine-tune")


def test_batch_outputs_equal_live_requests(state: dict[str, Any]) -> None:
    srv = state["srv"]
    client = client_of(srv)
    live = [client.chat.completions.create(**chat_body(p, 6)).choices[0].message.content
            for p in PROMPTS]
    before = _batch_waits(srv)
    rows: list[Any] = [line(f"q{i}", chat_body(p, 6)) for i, p in enumerate(PROMPTS)]
    rows += [b"{not json", line("neg", chat_body("hi", -3))]
    batch = submit(client, rows)
    assert batch.status == "validating" and batch.request_counts.total == 5
    done = poll(client, batch.id, ended)
    assert done.status == "completed", done
    for shown in (batch, done):
        conforms("Batch", shown.model_dump(exclude_unset=True))
    conforms("ListBatchesResponse", httpx.get(f"{srv.base_url}/v1/batches").json())
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 2)
    outs = read_lines(client, done.output_file_id)
    prompts = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outs)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompts, 3 * 6)
    assert [o["custom_id"] for o in outs] == ["q0", "q1", "q2"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outs)
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in outs] == live
    assert outs[0]["response"]["request_id"] == outs[0]["response"]["body"]["id"]
    errs = {e["custom_id"]: e for e in read_lines(client, done.error_file_id)}
    assert errs[None]["response"] is None and errs[None]["error"]["code"] == "invalid_json_line"
    refused = errs["neg"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert _batch_waits(srv) == before + 3   # the three lines queued in the `batch` class
    assert done.id in [b.id for b in client.batches.list()]


def test_a_line_nested_too_deep_to_send_is_its_own_error(state: dict[str, Any]) -> None:
    """A line whose body nests past the 254 levels orjson writes used to fail the whole batch
    (`server_error`, "TypeError: Recursion limit reached", the good lines' answers lost); it
    is an error line naming the limit and the rest run."""
    client = client_of(state["srv"])
    deep = orjson.dumps(line("deep", {**chat_body("hi", 2), "x": 0}))
    deep = deep.replace(b'"x":0', b'"x":' + b"[" * 300 + b"]" * 300)
    done = poll(client, submit(client, [line("ok", chat_body("hi", 2)), deep]).id, ended)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert [o["custom_id"] for o in read_lines(client, done.output_file_id)] == ["ok"]
    [err] = read_lines(client, done.error_file_id)
    assert err["custom_id"] == "deep" and err["error"]["code"] == "invalid_value"
    assert "deeper than 254 levels" in err["error"]["message"]


def test_a_responses_batch_equals_the_live_response(state: dict[str, Any]) -> None:
    client = client_of(state["srv"])
    body = {"model": "tiny", "input": "Name a colour.", "max_output_tokens": 6,
            "temperature": 0, "logit_bias": NO_EOS}
    live = client.responses.create(**{k: v for k, v in body.items() if k != "logit_bias"},
                                   extra_body={"logit_bias": NO_EOS})
    batch = submit(client, [line("r", body, "/v1/responses")], "/v1/responses")
    done = poll(client, batch.id, ended)
    assert done.status == "completed" and done.error_file_id is None, done
    (out,) = read_lines(client, done.output_file_id)
    got = out["response"]["body"]
    assert got["object"] == "response" and got["id"] == out["response"]["request_id"]
    assert got["output"][0]["content"][0]["text"] == live.output_text


def test_a_bad_file_or_field_is_a_400_at_create(state: dict[str, Any]) -> None:
    client = client_of(state["srv"])
    with pytest.raises(openai.BadRequestError, match="no line of the input file is a request"):
        submit(client, [b"nope", b"[1]"])
    with pytest.raises(openai.BadRequestError, match="custom_id 'a' is used by an earlier"):
        submit(client, [line("a", chat_body("x", 2)), line("a", chat_body("y", 2))])
    up = client.files.create(file=("in.jsonl", jsonl([line("a", chat_body("x", 2))])),
                             purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint is '/v1/messages'") as e:
        client.batches.create(input_file_id=up.id, endpoint="/v1/messages",  # type: ignore
                              completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError, match="completion_window is '1h'"):
        client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions",
                              completion_window="24h")


def test_a_live_request_beside_a_batch_and_a_cancel(state: dict[str, Any]) -> None:
    """Batch lines leave a row free: a live request runs while every line is still going
    (none of them finished first); then the cancel stops them."""
    srv = state["srv"]
    client = client_of(srv)
    batch = submit(client, [line(f"c{i}", chat_body("Tell a story.", 3000)) for i in range(3)])
    poll(client, batch.id, lambda b: _inflight(srv) == 2)   # two lines hold two of 3 rows
    live = client.chat.completions.create(**chat_body("hi", 3))
    assert live.usage.completion_tokens == 3 and _inflight(srv) == 2   # never a third line
    assert client.batches.retrieve(batch.id).request_counts.completed == 0
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    conforms("Batch", cancelled.model_dump(exclude_unset=True))
    assert cancelled.request_counts.completed == 0 and cancelled.output_file_id is None
    stopped = ""
    for _ in range(POLLS):   # its line's request was aborted, not run to its 3000 tokens
        stopped = next((x for x in state["srv"].log().splitlines()
                        if "endpoint=chat outcome=cancelled" in x), "")
        if stopped:
            break
        time.sleep(0.02)
    assert stopped and "generated_tokens=3000" not in stopped
    after = client.chat.completions.create(**chat_body("hi", 3))   # the server serves on
    assert after.usage.completion_tokens == 3


def test_live_requests_preempt_batch_lines(state: dict[str, Any]) -> None:
    """Every row taken (two lines and a live request): a second live request takes a line's
    row (preempted: its KV cached, its output kept), and the preempted line's output equals
    its live run."""
    srv = state["srv"]
    client = client_of(srv)
    prompts = ["Tell a long story.", "Tell a longer story."]
    solo = [client.chat.completions.create(**chat_body(p, 300)).choices[0].message.content
            for p in prompts]
    before = _preemptions(srv)
    batch = submit(client, [line(f"p{i}", chat_body(p, 300)) for i, p in enumerate(prompts)])
    poll(client, batch.id, lambda b: _inflight(srv) == 2)   # two lines hold two of 3 rows
    with ThreadPoolExecutor(2) as pool:   # the first takes the free row, the second a line's
        lives = list(pool.map(lambda p: client.chat.completions.create(**chat_body(p, 24)),
                              ["Hi.", "Hello."]))
    assert [x.usage.completion_tokens for x in lives] == [24, 24]
    assert client.batches.retrieve(batch.id).request_counts.completed == 0   # lines still ran
    done = poll(client, batch.id, ended)
    assert done.status == "completed", done
    outs = read_lines(client, done.output_file_id)
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in outs] == solo
    assert _preemptions(srv) >= before + 1
    assert any("preemptions=1" in x for x in srv.log().splitlines()
               if "endpoint=chat outcome=ok" in x)


def _preemptions(srv: Any) -> float:
    text = httpx.get(srv.base_url + "/metrics").text
    m = re.search(r"^pipeserve_preemptions_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_restart_resumes_the_unfinished_lines(state: dict[str, Any]) -> None:
    """Last in the file: it stops the module's server and starts another on the same files."""
    srv = state["srv"]
    client = client_of(srv)
    prompts = [f"Line {i} of a long list." for i in range(5)]
    live = [client.chat.completions.create(**chat_body(p, 96)).choices[0].message.content
            for p in prompts]
    ran_before = _ok_lines(srv)
    batch = submit(client, [line(f"r{i}", chat_body(p, 96)) for i, p in enumerate(prompts)])
    seen = poll(client, batch.id, lambda b: b.request_counts.completed >= 1 or ended(b))
    assert seen.status == "in_progress", seen   # cut while lines were left
    srv.stop()
    first = _ok_lines(srv) - ran_before
    # a server of another model on the same directory leaves it open (a single-model server
    # answers whatever `model` a line names, so it would answer with the wrong model)
    other = state["start"](*state["args"], "model.name=other")
    assert client_of(other).batches.retrieve(batch.id).status == "in_progress"
    assert f"batch {batch.id}: its lines go to tiny, not served here" in other.log()
    assert "resuming" not in other.log()
    other.stop()
    srv = state["srv"] = state["start"](*state["args"])
    client = client_of(srv)
    done = poll(client, batch.id, ended)
    assert done.status == "completed" and done.request_counts.completed == 5, done
    assert f"batch {batch.id}: resuming (in_progress)" in srv.log()
    assert 0 < _ok_lines(srv) <= 5 - first + 1 and first + _ok_lines(srv) >= 5
    outs = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in outs] == [f"r{i}" for i in range(5)]
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in outs] == live


def _inflight(srv: Any) -> int:
    return httpx.get(srv.base_url + "/health").json()["inflight"]


def _batch_waits(srv: Any) -> float:
    text = httpx.get(srv.base_url + "/metrics").text
    m = re.search(r'^pipeserve_queue_wait_seconds_count\{priority="batch"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _ok_lines(srv: Any) -> int:
    """Generations the server's log shows finished (one log line each)."""
    text = srv.log_path.read_text(errors="replace")   # readable after the server stopped
    return sum(1 for x in text.splitlines() if "endpoint=chat outcome=ok" in x)
