"""Admission that knows its latency, through a real server: a `deadline_ms` the measured
rates cannot meet is refused (429) with an estimate within 2x of the time the request then
takes (widened by how much the machine's own speed wanders meanwhile); `priority` classes
reorder the queue under overload, and a `batch` request is not starved past
scheduler.max_wait_s; the queue-wait and estimate metrics are exported."""
from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sample_value, wait_health

MAX_WAIT_S = 3.0   # queueing three requests fits well inside it, on a busy machine too
PROMPT = [3 + (i * 7) % 200 for i in range(48)]


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    # one row at a time: every other request queues; cache=off: every prompt is prefilled
    return server_factory("scheduler=serial", "cache=off", f"scheduler.max_wait_s={MAX_WAIT_S}")


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS, **extra}


def post(base: str, max_tokens: int, **extra: Any) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json=body(max_tokens, **extra), timeout=TIMEOUT)


def timed_post(base: str, max_tokens: int) -> float:
    """Seconds one greedy request of exactly `max_tokens` takes, start to answer."""
    t0 = time.perf_counter()
    r = post(base, max_tokens)
    took = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens, r.text
    return took


def test_unmeetable_deadline_is_refused_with_an_estimate_within_2x(srv: Any) -> None:
    per_token = []   # seconds a token of each whole request: how steady the machine is
    for _ in range(3):   # measured rates: prefill of this prompt, decode per row
        per_token.append(timed_post(srv.base_url, 150) / 150)
    ratios = []
    for _ in range(3):   # a shared CI machine's speed wanders: the median of three trials
        r = post(srv.base_url, 400, deadline_ms=1)
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "deadline_unmeetable" and int(r.headers["Retry-After"]) >= 1
        estimate_ms = float(re.search(r"the estimate is (\d+) ms", error["message"]).group(1))
        measured_s = timed_post(srv.base_url, 400)
        per_token.append(measured_s / 400)
        ratios.append(measured_s * 1000 / estimate_ms)
    # rates measured while the machine ran at one speed predict a request at another off by
    # that much: within 2x, widened by the spread of the same machine's own per-token times
    drift = max(per_token) / min(per_token)
    print(f"\nmeasured / estimated: {[round(x, 2) for x in ratios]}; ms a token: "
          f"{[round(x * 1e3, 2) for x in per_token]} (drift {drift:.2f})")
    assert 0.5 / max(drift, 1.0) <= sorted(ratios)[1] <= 2.0 * max(drift, 1.0), (ratios, drift)
    assert post(srv.base_url, 4, deadline_ms=600_000).status_code == 200   # meetable
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_latency_estimate_ratio",
                        "pipeserve_latency_estimate_ratio_count") >= 1
    assert sample_value(fams, "pipeserve_admission_decisions",
                        "pipeserve_admission_decisions_total", decision="rejected",
                        reason="deadline") >= 3


@pytest.mark.parametrize("field,value,needle", [
    ("deadline_ms", 0, "deadline_ms is 0; allowed range is [1, inf]"),
    ("priority", "urgent", "priority is 'urgent'; allowed: an integer 0 (most urgent) .. 9"),
    ("priority", 12, "priority is 12"),
])
def test_bad_scheduling_fields_are_400(srv: Any, field: str, value: Any, needle: str) -> None:
    r = post(srv.base_url, 2, **{field: value})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


class Blocker:
    """A long stream holding the only row until `cut()` closes it (the server aborts it)."""

    def __init__(self, base: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(base,), daemon=True)
        self.thread.start()
        wait_health(base, inflight=1, waiting=0)

    def _run(self, base: str) -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body(4000, stream=True),
                          timeout=TIMEOUT) as r:
            for _ in r.iter_raw():
                if self.stop.is_set():
                    return

    def cut(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)


def run_queued(base: str, ids: dict[str, str], name: str, priority: Any) -> threading.Thread:
    def go() -> None:
        r = post(base, 4, priority=priority)
        assert r.status_code == 200
        ids[name] = r.json()["id"]
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def queue_up(srv: Any, names: list[tuple[str, Any]], ids: dict[str, str]) -> list[threading.Thread]:
    threads = []
    for i, (name, priority) in enumerate(names, start=1):
        threads.append(run_queued(srv.base_url, ids, name, priority))
        assert wait_health(srv.base_url, waiting=i)["waiting"] == i   # queued in this order
    return threads


def served_order(srv: Any, ids: dict[str, str]) -> list[str]:
    """The names in the order the server finished their requests (its log's line for each;
    one row, so the order they got it). The clients' own order of seeing the answers is not
    it: on a busy machine a thread woken first can run last."""
    for _ in range(100):   # bounded: the line is written as the answer goes out
        log = srv.log()
        at = {name: log.find(f" request {rid} ") for name, rid in ids.items()}
        if min(at.values()) >= 0:
            return sorted(at, key=lambda name: at[name])
        time.sleep(0.05)
    raise AssertionError(f"no log line for some of {ids}: {log[-2000:]}")


def test_interactive_overtakes_batch_in_the_queue(srv: Any) -> None:
    """Strict priority while nothing has waited max_wait_s. An attempt that took longer from
    the first request sent to the last answered (a busy machine) may rightly have aged the
    batch request, so it shows nothing either way and is made again (bounded)."""
    for _ in range(3):
        blocker = Blocker(srv.base_url)
        ids: dict[str, str] = {}
        t0 = time.monotonic()
        threads = queue_up(srv, [("batch", "batch"), ("default", None), ("interactive", 0)],
                           ids)
        blocker.cut()
        for t in threads:
            t.join(TIMEOUT)
        took = time.monotonic() - t0
        print(f"\nqueued, cut and answered in {took:.2f} s (max_wait_s {MAX_WAIT_S})")
        if took < MAX_WAIT_S:
            break
    assert took < MAX_WAIT_S, f"no attempt ran inside max_wait_s: the last took {took:.1f} s"
    assert served_order(srv, ids) == ["interactive", "default", "batch"], ids
    fams = metric_families(srv.base_url)
    for cls in ("interactive", "default", "batch"):
        assert sample_value(fams, "pipeserve_queue_wait_seconds",
                            "pipeserve_queue_wait_seconds_count", priority=cls) >= 1


def test_batch_is_not_starved_past_max_wait_s(srv: Any) -> None:
    blocker = Blocker(srv.base_url)
    ids: dict[str, str] = {}
    threads = queue_up(srv, [("batch", "batch")], ids)
    t0 = time.monotonic()
    for i in range(3):   # urgent requests keep arriving behind it
        threads.append(run_queued(srv.base_url, ids, f"interactive-{i}", "interactive"))
        wait_health(srv.base_url, waiting=i + 2)
    time.sleep(max(0.0, MAX_WAIT_S + 0.3 - (time.monotonic() - t0)))   # batch has aged
    blocker.cut()
    for t in threads:
        t.join(TIMEOUT)
    assert served_order(srv, ids)[0] == "batch", ids
