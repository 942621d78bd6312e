"""End to end: the reproducibility record (the `x-pipeserve-record` header and
`usage.pipeserve`) on every protocol, streamed and not, and the per-request log line in text
and JSON (serve.py's Hydra log file parsed line by line). Real serve.py processes on
127.0.0.1, the real openai and anthropic SDKs and raw SSE; every wait is bounded."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sdk, sse

HEADER = "x-pipeserve-record"
KEYS = {"config_hash", "model_fingerprint", "kv_scheme", "draft", "lane"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 8, "temperature": 0, "logit_bias": NO_EOS}


def parse_header(value: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in value.split(";"))


@pytest.fixture(scope="module")
def continuous(server_factory: Any) -> Any:
    return server_factory("scheduler=continuous")


@pytest.fixture(scope="module")
def identity(continuous: Any) -> dict[str, str]:
    """What the record must name: the server's build info."""
    fams = metric_families(continuous.base_url)
    build = fams.get("pipeserve_build") or fams["pipeserve_build_info"]
    return dict(build.samples[0].labels)


def check_record(record: dict[str, Any], identity: dict[str, str], lane: str,
                 batch: bool = True) -> None:
    assert KEYS <= set(record), record
    assert record["config_hash"] == identity["config_hash"]
    assert record["model_fingerprint"] == identity["model_fingerprint"]
    assert (record["kv_scheme"], record["draft"], record["lane"]) == ("dense", "none", lane)
    if batch:
        assert int(record["batch_size"]) >= 1
    else:
        assert "batch_size" not in record


def test_record_on_openai_chat_and_completions(continuous: Any, identity: dict[str, str]) -> None:
    client = sdk(continuous.base_url)
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    r = raw.parse()
    header = parse_header(raw.headers[HEADER])
    check_record(header, identity, "continuous")
    body = r.usage.model_extra["pipeserve"]   # the SDK's typed model keeps the extension
    assert {k: str(v) for k, v in body.items()} == header
    assert r.system_fingerprint == f"fp_{identity['config_hash']}"

    raw = client.completions.with_raw_response.create(model="tiny", prompt="Once", max_tokens=4,
                                                      logit_bias=NO_EOS)
    check_record(parse_header(raw.headers[HEADER]), identity, "continuous")
    check_record(raw.parse().usage.model_extra["pipeserve"], identity, "continuous")


def test_record_on_streams_is_in_header_and_final_usage(continuous: Any,
                                                        identity: dict[str, str]) -> None:
    with httpx.stream("POST", continuous.base_url + "/v1/chat/completions",
                      json={**CHAT, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        # sent before decoding: everything but the batch size
        check_record(parse_header(r.headers[HEADER]), identity, "continuous", batch=False)
        r.read()
    for body, path in ((CHAT, "/v1/chat/completions"),
                       ({**CHAT, "stream_options": {"include_usage": True}}, "/v1/chat/completions"),
                       ({"model": "tiny", "prompt": "Once", "max_tokens": 4}, "/v1/completions")):
        events, _ = sse(continuous.base_url, path, body)
        usages = [e["usage"] for e in events if e.get("usage")]
        assert len(usages) == 1 and events[-1].get("usage"), events[-1]
        check_record(usages[0]["pipeserve"], identity, "continuous")


def test_record_on_responses_and_messages(continuous: Any, identity: dict[str, str]) -> None:
    client = sdk(continuous.base_url)
    raw = client.responses.with_raw_response.create(model="tiny", input="Hi",
                                                    max_output_tokens=6)
    check_record(parse_header(raw.headers[HEADER]), identity, "continuous")
    check_record(raw.parse().usage.model_extra["pipeserve"], identity, "continuous")
    events, _ = sse(continuous.base_url, "/v1/responses",
                    {"model": "tiny", "input": "Hi", "max_output_tokens": 6})
    done = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    check_record(done[-1]["response"]["usage"]["pipeserve"], identity, "continuous")

    claude = anthropic.Anthropic(base_url=continuous.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    raw_msg = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    check_record(parse_header(raw_msg.headers[HEADER]), identity, "continuous")
    check_record(raw_msg.parse().usage.model_extra["pipeserve"], identity, "continuous")
    with claude.messages.stream(model="tiny", max_tokens=6,
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
    check_record(deltas[-1].usage.model_extra["pipeserve"], identity, "continuous")


def test_record_on_errors_and_batch_size_under_concurrency(continuous: Any,
                                                           identity: dict[str, str]) -> None:
    r = httpx.post(continuous.base_url + "/v1/chat/completions", content=b"{bad",
                   timeout=TIMEOUT)
    assert r.status_code == 400
    check_record(parse_header(r.headers[HEADER]), identity, "continuous", batch=False)

    client = sdk(continuous.base_url)
    body = {**CHAT, "max_tokens": 200}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: client.chat.completions.create(**body), range(4)))
    sizes = [r.usage.model_extra["pipeserve"]["batch_size"] for r in results]
    assert max(sizes) >= 2 and max(sizes) <= 4, sizes


def test_serial_lane_runs_at_batch_size_one(server_factory: Any) -> None:
    server = server_factory("scheduler=serial")
    client = sdk(server.base_url)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.chat.completions.with_raw_response.create(
            **CHAT), range(2)))
    for raw in results:
        record = parse_header(raw.headers[HEADER])
        assert record["lane"] == "serial" and record["batch_size"] == "1"


def test_text_log_line_per_request(continuous: Any) -> None:
    r = sdk(continuous.base_url).chat.completions.create(**CHAT)
    lines = [line for line in continuous.log().splitlines() if f"request {r.id} " in line]
    assert len(lines) == 1, lines
    for field in ("endpoint=chat", "outcome=ok", f"prompt_tokens={r.usage.prompt_tokens} ",
                  f"cached_tokens={r.usage.prompt_tokens_details.cached_tokens} ",
                  "generated_tokens=8", "ttft_s=", "queue_s=", "total_s=", "finish=length"):
        assert field in lines[0], (field, lines[0])
    assert "[INFO]" in lines[0]


def test_json_logs_are_one_object_per_line(server_factory: Any) -> None:
    server = server_factory("server.log_format=json")
    client = sdk(server.base_url)
    r = client.chat.completions.create(**CHAT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    server.stop()
    # Hydra's file handler: <hydra.run.dir>/serve.log (the fixture's run dir for this port)
    log_file = Path(server.log_path).parent / str(server.port) / "serve.log"
    lines = log_file.read_text().splitlines()
    records = [json.loads(line) for line in lines]   # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(rec) for rec in records)
    requests = [rec for rec in records if rec.get("event") == "request"]
    ok = [rec for rec in requests if rec["request_id"] == r.id]
    assert len(ok) == 1
    assert ok[0]["level"] == "INFO" and ok[0]["endpoint"] == "chat" and ok[0]["outcome"] == "ok"
    assert ok[0]["prompt_tokens"] == r.usage.prompt_tokens
    assert ok[0]["generated_tokens"] == 8
    assert ok[0]["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert 0 < ok[0]["ttft_s"] <= ok[0]["total_s"]
    assert 0 <= ok[0]["queue_s"] < ok[0]["ttft_s"]   # a row before its first token
    assert any(rec["outcome"] == "invalid" for rec in requests)
    loading = [rec["msg"] for rec in records if rec["logger"] == "pipeserve.model.loader"]
    assert any("[1/5]" in m for m in loading) and any("[5/5]" in m for m in loading), loading
