"""Responses `background: true` through a real server and the openai SDK: the create call
answers at once with a queued response that GET polls to its end, the finished output is the
one the same request gives in the foreground, the request ran at the least urgent priority
class, a cancel stops a running one (stored as cancelled) and the server goes on serving, and
a background request that cannot be polled (store false) is a 400 naming the field; a
background stream left by its client runs on and resumes after a sequence number, and its
cancel stops it. Across a restart (kill -9, and SIGTERM) on the same server.files_dir, an
interrupted response resumes from its checkpoint to the uninterrupted greedy output, a
finished one stays readable (and continuable), and a resumed one can be cancelled."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.serve.test_openai import NO_EOS, TIMEOUT

POLLS = 3000   # a bound on polling, not a time limit


# a checkpoint every 16 output tokens: a restart test sees one early in its generation
ARGS = ["server.background_checkpoint_tokens=16", "server.admin_key=adm"]


@pytest.fixture(scope="module")
def state(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's server and the directory it keeps background responses in; the restart
    tests (last in the file) replace the server with another on the same directory."""
    files_dir = tmp_path_factory.mktemp("files")
    args = [f"server.files_dir={files_dir}", *ARGS]
    return {"srv": server_factory(*args), "args": args, "start": server_factory,
            "dir": files_dir}


@pytest.fixture(scope="module")
def srv(state: dict[str, Any]) -> Any:
    return state["srv"]


def client_of(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return client_of(srv)


def create(client: openai.OpenAI, tokens: int, **extra: Any) -> Any:
    return client.responses.create(
        model="tiny", input="Tell me a long story about the river.", max_output_tokens=tokens,
        temperature=0, extra_body={"logit_bias": NO_EOS, **extra.pop("extra_body", {})},
        **extra)


def poll(client: openai.OpenAI, response_id: str) -> tuple[Any, list[str]]:
    seen: list[str] = []
    for _ in range(POLLS):
        got = client.responses.retrieve(response_id)
        if not seen or seen[-1] != got.status:
            seen.append(got.status)
        if got.status not in ("queued", "in_progress"):
            return got, seen
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {seen[-1]} after {POLLS} polls")


def test_background_is_polled_to_the_foreground_answer(client: openai.OpenAI, srv: Any) -> None:
    plain = create(client, 48)
    queued = create(client, 48, background=True)
    assert queued.status == "queued" and queued.background is True and not queued.output
    done, seen = poll(client, queued.id)
    assert done.status == plain.status == "incomplete"   # max_output_tokens ended both
    assert set(seen) <= {"queued", "in_progress", "incomplete"}
    assert done.output_text == plain.output_text and done.usage.output_tokens == 48
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert 'pipeserve_queue_wait_seconds_count{priority="batch"} 1.0' in metrics


def test_cancel_stops_a_running_one(client: openai.OpenAI, srv: Any) -> None:
    queued = create(client, 3000, background=True)
    for _ in range(POLLS):   # running: it has written tokens
        if client.responses.retrieve(queued.id).status == "in_progress":
            break
        time.sleep(0.02)
    cancelled = client.post(f"/responses/{queued.id}/cancel", cast_to=httpx.Response).json()
    assert cancelled["status"] == "cancelled" and cancelled["id"] == queued.id
    stored = client.responses.retrieve(queued.id)
    assert stored.status == "cancelled"
    # what it wrote before the cancel is kept (as the usage counts it), marked incomplete
    written = stored.usage.output_tokens
    assert written > 0 and stored.output[0].status == "incomplete", stored
    plain = create(client, written)   # the same greedy tokens, not cut
    assert stored.output_text and plain.output_text.startswith(stored.output_text.rstrip("\ufffd"))
    line = ""
    for _ in range(POLLS):   # the request's log line: stopped by the cancel, not by its end
        line = next((x for x in srv.log().splitlines() if f"request {queued.id} " in x), "")
        if line:
            break
        time.sleep(0.05)
    assert "outcome=cancelled" in line and "generated_tokens=3000" not in line, line
    after = create(client, 8)   # the server serves on
    assert after.status == "incomplete" and after.usage.output_tokens == 8


def test_cancel_of_a_foreground_response_and_bad_bodies(client: openai.OpenAI) -> None:
    plain = create(client, 4)
    with pytest.raises(openai.BadRequestError, match="only a background response can be"):
        client.post(f"/responses/{plain.id}/cancel", cast_to=httpx.Response)
    with pytest.raises(openai.NotFoundError):
        client.post("/responses/resp_missing/cancel", cast_to=httpx.Response)
    with pytest.raises(openai.BadRequestError, match="background is true with store false") as e:
        create(client, 4, background=True, store=False)
    assert e.value.body["param"] == "store"
    # the header a restart resumes a response with is the server's own
    forged = httpx.post(f"{client.base_url}responses", headers={"x-pipeserve-resume": "resp_a"},
                        json={"model": "tiny", "input": "hi", "background": True}, timeout=TIMEOUT)
    assert forged.status_code == 400 and forged.json()["error"]["param"] == "x-pipeserve-resume"


@pytest.mark.parametrize("stream", [False, True])
def test_a_background_body_nested_too_deep_to_keep_on_disk_is_a_400(
        client: openai.OpenAI, stream: bool) -> None:
    """A background request's record on disk holds its body as sent, and orjson writes 254
    levels at most: a body nesting deeper (any field, unknown ones too) used to end in a 500
    once its generation was submitted (the fuzz campaign's find, through text.format); it is a
    400 naming `background` and the limit, and one level less is kept and polled to its end."""
    def post(levels: int) -> httpx.Response:
        body = ('{"model": "tiny", "input": "hi", "max_output_tokens": 2, "background": true, '
                '"stream": %s, "x": %s}' % ("true" if stream else "false",
                                            "[" * levels + "]" * levels))
        return httpx.post(f"{client.base_url}responses", content=body, timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    deep = post(253)   # the body's own object and 253 arrays: 254 levels, 255 in its record
    assert deep.status_code == 400, deep.text
    assert deep.json()["error"]["param"] == "background"
    assert "deeper than 253 levels" in deep.json()["error"]["message"]
    kept = post(252)
    assert kept.status_code == 200, kept.text
    rid = (orjson.loads(kept.text)["id"] if not stream else
           re.search(r'"id":"(resp_\w+)"', kept.text).group(1))
    for _ in range(POLLS):
        got = client.responses.retrieve(rid)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.01)
    assert got.status == "incomplete" and got.usage.output_tokens == 2


def test_a_background_stream_left_by_its_client_resumes_after_a_sequence_number(
        client: openai.OpenAI) -> None:
    """The client reads a few events and leaves; the generation runs on; the stream resumes
    from `starting_after` (OpenAI's retrieve with stream=true) to the foreground's answer."""
    plain = create(client, 40)
    first = []
    with create(client, 40, background=True, stream=True) as events:
        for event in events:
            first.append(event)
            if event.type == "response.output_text.delta" and len(first) > 4:
                break
    rid = first[0].response.id
    assert first[0].response.background is True
    done, _ = poll(client, rid)   # it ran on to its end without a reader
    assert done.status == "incomplete" and done.output_text == plain.output_text
    cut = first[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=cut))
    assert [e.sequence_number for e in rest] == list(range(cut + 1, cut + 1 + len(rest)))
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == plain.output_text and rest[-1].type == "response.incomplete"


def test_cancel_stops_a_background_stream(client: openai.OpenAI) -> None:
    with create(client, 3000, background=True, stream=True) as events:
        rid = next(iter(events)).response.id
    assert client.responses.retrieve(rid).status in ("queued", "in_progress")
    cancelled = client.post(f"/responses/{rid}/cancel", cast_to=httpx.Response).json()
    assert cancelled["status"] == "cancelled"
    assert client.responses.retrieve(rid).status == "cancelled"
    assert create(client, 4).usage.output_tokens == 4   # the server serves on


# -- restarts (last in the file: they replace the module's server) ----------------------------
LONG = 480   # output tokens of an interrupted response: most of it is left at the kill


def uninterrupted(state: dict[str, Any], client: openai.OpenAI) -> Any:
    """The foreground answer an interrupted response must equal (asked once)."""
    if "plain" not in state:
        state["plain"] = create(client, LONG)
    return state["plain"]


def on_disk(state: dict[str, Any], rid: str) -> dict[str, Any]:
    try:
        return orjson.loads((Path(state["dir"]) / "responses" / f"{rid}.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}


def checkpointed(state: dict[str, Any], rid: str) -> int:
    """Wait (bounded) until a checkpoint of the running response is on disk; its length."""
    for _ in range(POLLS):
        record = on_disk(state, rid)
        n = len(record.get("output_ids") or [])
        assert record.get("status") in (None, "queued", "in_progress"), record.get("status")
        if n >= 16:
            return n
        time.sleep(0.01)
    raise AssertionError(f"{rid}: no checkpoint after {POLLS} polls")


def relaunch(state: dict[str, Any]) -> openai.OpenAI:
    state["srv"] = state["start"](*state["args"])
    return client_of(state["srv"])


def resumed_at(srv: Any, rid: str) -> int:
    """The output tokens the relaunched server resumed `rid` from (its log line)."""
    m = re.search(rf"response {rid}: resuming \(in_progress, (\d+) output tokens", srv.log())
    assert m, srv.log()[-2000:]
    return int(m.group(1))


def test_kill_9_mid_generation_resumes_to_the_uninterrupted_output(
        state: dict[str, Any]) -> None:
    client = client_of(state["srv"])
    plain = uninterrupted(state, client)
    short = create(client, 8, background=True)
    finished, _ = poll(client, short.id)
    # an urgent class the admin key granted: the resume keeps it (it has no admin key)
    admin = client.with_options(api_key="adm")
    rid = create(admin, LONG, background=True, extra_body={"priority": "interactive"}).id
    seen = checkpointed(state, rid)
    state["srv"].proc.kill()   # no drain, no last write: the periodic checkpoint is all
    state["srv"].proc.wait(10)
    client = relaunch(state)
    first = client.responses.retrieve(rid)
    assert first.status == "in_progress" and first.background is True
    done, statuses = poll(client, rid)
    assert set(statuses) <= {"in_progress", "incomplete"}
    assert seen <= resumed_at(state["srv"], rid) < LONG
    assert done.output_text == plain.output_text and done.usage.output_tokens == LONG
    assert done.usage.input_tokens == plain.usage.input_tokens
    assert done.created_at == first.created_at and done.id == rid
    # one that ended before the restart is read back, and continues a conversation
    kept = client.responses.retrieve(short.id)
    assert kept.status == finished.status and kept.output_text == finished.output_text
    more = client.responses.create(model="tiny", input="And then?", max_output_tokens=4,
                                   previous_response_id=short.id, temperature=0)
    assert more.usage.input_tokens > finished.usage.input_tokens


def test_sigterm_suspends_and_the_next_launch_resumes_or_cancels(
        state: dict[str, Any]) -> None:
    client = client_of(state["srv"])
    plain = uninterrupted(state, client)
    rid = create(client, LONG, background=True).id
    other = create(client, LONG, background=True).id
    seen = checkpointed(state, rid)
    stopped = state["srv"]
    stopped.stop()   # SIGTERM: the drain suspends both at their last token, waiting for neither
    assert "drained: no request in flight" in stopped.log_path.read_text(errors="replace")
    left = len(on_disk(state, rid)["output_ids"])
    assert on_disk(state, rid)["status"] == "in_progress" and seen <= left < LONG
    client = relaunch(state)
    cancelled = client.post(f"/responses/{other}/cancel", cast_to=httpx.Response).json()
    assert cancelled["status"] == "cancelled"
    done, _ = poll(client, rid)
    assert resumed_at(state["srv"], rid) == left
    assert done.output_text == plain.output_text and done.usage.output_tokens == LONG
    assert client.responses.retrieve(other).status == "cancelled"
    assert on_disk(state, other)["status"] == "cancelled"
