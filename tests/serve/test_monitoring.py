"""Monitoring checked for real: the committed Grafana dashboard is what dashboards/build.py
makes; promtool accepts the scrape config and the alert rules; a real Prometheus (Debian's
package, which .ci/run installs; the tests skip, saying so, without it) scrapes a live serve.py while the openai SDK drives
traffic, and every PromQL expression of the dashboard and of the rules is run through its
HTTP API. Prometheus is started and stopped by its own PID; every wait is bounded."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeserve.metrics import Metrics, family_names, sample_names
from tests.system_tools import find_or_skip
from tests.conftest import ROOT, free_port, wait_http

DASHBOARDS = ROOT / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "pipeserve.json"
NAME = re.compile(r"\bpipeserve_[a-z0-9_]+")
# Grafana's variables and macros, as Prometheus sees them at query time.
GRAFANA_VARS = {"$instance": ".*", "$model": ".*", "$__rate_interval": "1m", "$__range": "5m"}
# Every dashboard query must return series. These (panel, legend) may have only NaN values
# after the test's traffic, and why; every other query must have a finite value.
MAY_BE_NAN = {
    ("Hit ratio by tier", "{{cache_tier}}"):
        "no prompt cache yet: hits and misses stay 0, so the ratio is 0/0",
    ("Acceptance ratio by proposer", "{{proposer}}"): "no speculative decoding yet: 0/0",
    ("Tokens per verify by proposer", "{{proposer}}"): "no speculative decoding yet: 0/0",
    ("Context: max safe vs cap", "cap enforced (admission=budget)"):
        "NaN under admission=advisory: no cap is enforced",
    ("KV reserved vs budget", "budget (admission.kv_budget_gb)"):
        "NaN unless admission.kv_budget_gb is set",
    ("MLX memory", "budget (admission.memory_budget_gb)"):
        "NaN unless admission.memory_budget_gb is set",
    ("Active memory / budget", ""): "NaN unless admission.memory_budget_gb is set",
    **{("Step time by rank", f"p{q} {{{{rank}}}}"): "NaN unless distributed≠none"
       for q in (50, 95, 99)},
    **{("Sync (collective) time by rank", f"p{q} {{{{rank}}}}"): "NaN unless distributed≠none"
       for q in (50, 95, 99)},
}
COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*-?[0-9][0-9.e+-]*)")
NO_EOS = {"0": -100, "2": -100}
TIMEOUT = 60.0


# -- the dashboard, statically ------------------------------------------------------------------
def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_JSON.read_text())


def panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels") or [])   # panels inside collapsed rows
    return out


def dashboard_queries(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL with Grafana's variables filled in) for every target."""
    out = []
    for p in panels(d):
        for t in p.get("targets") or []:
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unhandled Grafana variable in {p['title']!r}: {expr}"
            out.append((p["title"], t.get("legendFormat", ""), expr))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    return [(r["alert"], " ".join(r["expr"].split())) for g in rules["groups"] for r in g["rules"]]


def test_dashboard_json_is_generated_from_build_py() -> None:
    assert DASHBOARD_JSON.read_text() == _build_module().render(), \
        "dashboards/pipeserve.json is stale: run `python dashboards/build.py` and commit it"


def test_dashboard_shape() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "pipeserve"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Traffic & errors", "Latency", "Batching & queue", "Prompt cache",
                    "Admission", "Speculation", "KV layout", "Distributed ranks",
                    "MLX memory"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    text = DASHBOARD_JSON.read_text()
    # no hard-coded datasource: every reference goes through the variable
    uids = re.findall(r'"uid": "([^"]*)"', text)
    assert set(uids) == {"${datasource}", "pipeserve"}, set(uids)
    for p in panels(d):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
    queries = {(title, legend) for title, legend, _ in dashboard_queries(d)}
    assert set(MAY_BE_NAN) <= queries, set(MAY_BE_NAN) - queries


def test_dashboard_and_rules_use_only_exported_names() -> None:
    exported = sample_names(Metrics(CollectorRegistry()).registry)
    text = DASHBOARD_JSON.read_text() + (DASHBOARDS / "alerts.yml").read_text()
    used = set(NAME.findall(text))
    assert used and used <= exported, sorted(used - exported)


def test_docs_metrics_table_lists_every_family() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(pipeserve_[a-z0-9_]+)` \| (\w+) \|", section, re.M)
    documented = dict(rows)
    assert documented == family_names(Metrics(CollectorRegistry()).registry)


# -- Prometheus, installed by .ci/run from Debian ------------------------------------------------------------
def _find_prometheus() -> None:
    """Debian's `prometheus` package brings both the server and promtool."""
    for program in ("prometheus", "promtool"):
        find_or_skip(program, "prometheus", "the monitoring checks against a live Prometheus")


@pytest.fixture(scope="module")
def prometheus_bin() -> None:
    _find_prometheus()


def test_promtool_accepts_config_and_rules(prometheus_bin: None) -> None:
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        done = subprocess.run(["promtool", *args], cwd=DASHBOARDS, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    assert "SUCCESS: 7 rules found" in done.stdout


class Prometheus:
    """A Prometheus server scraping one target every second, on its own free port and its own
    storage under `work`; stopped by its PID."""

    def __init__(self, target: str, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  **self.jobs(target)}
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run(["promtool", "check", "config", str(work / "prometheus.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log_path = work / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=self._log, stderr=subprocess.STDOUT)

    def jobs(self, target: str) -> dict[str, Any]:
        """The config's rules and scrape jobs: one job on `target`, with the repo's alerts."""
        return {"rule_files": [str(DASHBOARDS / "alerts.yml")],
                "scrape_configs": [{"job_name": "pipeserve",
                                    "static_configs": [{"targets": [target]}]}]}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float = 60) -> None:
        wait_http(f"{self.url}/-/ready", self.proc, "prometheus", self.log, timeout_s)

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]

    def value(self, expr: str) -> float:
        result = self.query(expr)["result"]
        return float(result[0]["value"][1]) if result else math.nan

    def wait_for(self, expr: str, want: float, timeout_s: float = 30) -> None:
        """Until `expr` (one series) reaches `want`: Prometheus has scraped that far."""
        deadline = time.monotonic() + timeout_s
        got = math.nan
        while time.monotonic() < deadline:
            got = self.value(expr)
            if got >= want:
                return
            time.sleep(0.25)
        raise TimeoutError(f"{expr} = {got}, wanted >= {want} within {timeout_s}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _drive(base_url: str) -> int:
    """A wave of traffic through the openai SDK: chat (plain, streamed) and completions, four
    at once so steps batch, and one invalid request. Returns the tokens generated."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)

    def chat(max_tokens: int) -> int:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me about cats."}],
            max_tokens=max_tokens, temperature=0, logit_bias=NO_EOS)
        return r.usage.completion_tokens

    def stream(max_tokens: int) -> int:
        chunks = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "And dogs?"}],
            max_tokens=max_tokens, logit_bias=NO_EOS, stream=True,
            stream_options={"include_usage": True})
        return sum(c.usage.completion_tokens for c in chunks if c.usage is not None)

    def complete(max_tokens: int) -> int:
        r = client.completions.create(model="tiny", prompt="Once upon a time",
                                      max_tokens=max_tokens, temperature=0, logit_bias=NO_EOS)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(f, 24) for f in (chat, stream, complete, chat)]
        generated = sum(f.result(timeout=TIMEOUT) for f in futures)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    return generated


@pytest.fixture(scope="module")
def live(prometheus_bin: None, server_factory: Any,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Prometheus]]:
    server = server_factory()
    prom = Prometheus(f"127.0.0.1:{server.port}", tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait_ready()
        prom.wait_for('up{job="pipeserve"}', 1)            # scraped once before any traffic
        generated = 0
        for _ in range(2):   # two waves: series born in the first have a rate in the second
            generated += _drive(server.base_url)
            prom.wait_for("sum(pipeserve_generation_tokens_total)", generated)
        prom.wait_for("count(pipeserve_stage_seconds_count)", 2)
        yield server, prom
    finally:
        prom.stop()


def test_every_dashboard_query_runs_and_lights_up(live: tuple[Any, Prometheus]) -> None:
    _, prom = live
    empty: list[str] = []
    dark: list[str] = []
    for title, legend, expr in dashboard_queries(dashboard()):
        result = prom.query(expr)["result"]   # asserts status "success": the query parses
        if not result:
            empty.append(f"{title} [{legend}]: {expr}")
        elif (title, legend) not in MAY_BE_NAN and all(
                math.isnan(float(s["value"][1])) for s in result):
            dark.append(f"{title} [{legend}]: {expr} -> {result}")
    assert not empty, "queries that returned no series:\n" + "\n".join(empty)
    assert not dark, "queries the traffic should light up are all NaN:\n" + "\n".join(dark)


def test_every_rule_runs_is_wired_and_stays_quiet(live: tuple[Any, Prometheus]) -> None:
    """Each rule parses; with its threshold turned into a `bool` comparison it returns series
    (so its names resolve to data, not to a typo that never fires) whose values are all 0:
    a healthy server fires no alert."""
    _, prom = live
    for alert, expr in rule_exprs():
        assert prom.query(expr)["result"] == [], f"{alert} fires on a healthy server: {expr}"
        wired = COMPARISON.sub(r"\1 bool\2", expr)
        assert wired != expr, f"{alert}: no threshold comparison found in {expr}"
        result = prom.query(wired)["result"]
        assert result, f"{alert}: {wired} returned no series"
        assert all(float(s["value"][1]) == 0 for s in result), (alert, result)


def test_prometheus_evaluates_the_rules_without_errors(live: tuple[Any, Prometheus]) -> None:
    _, prom = live
    deadline = time.monotonic() + 15
    while True:
        groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        evaluated = all(r.get("lastEvaluation", "").startswith("2") and
                        not r["lastEvaluation"].startswith("0001") for r in rules)
        if (rules and evaluated) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {a for a, _ in rule_exprs()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert all(r["state"] == "inactive" for r in rules), [(r["name"], r["state"]) for r in rules]


def test_every_name_the_dashboard_and_rules_use_is_on_live_metrics(
        live: tuple[Any, Prometheus]) -> None:
    server, prom = live
    text = httpx.get(server.base_url + "/metrics", timeout=TIMEOUT).text
    live_names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    d = dashboard()
    used = {n for _, _, expr in dashboard_queries(d) for n in NAME.findall(expr)}
    used |= {n for v in d["templating"]["list"] for n in NAME.findall(str(v.get("query", "")))}
    used |= {n for _, expr in rule_exprs() for n in NAME.findall(expr)}
    assert used - live_names == set()
    # the instance variable's query finds this server
    values = httpx.get(f"{prom.url}/api/v1/label/instance/values",
                       params={"match[]": "pipeserve_build_info"}, timeout=10).json()["data"]
    assert values == [f"127.0.0.1:{server.port}"]
