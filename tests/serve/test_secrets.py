"""Keys stay secret, with real serve.py processes: the public config hash (build info, the
record header, even on a 401) is the same whatever the keys; run files and logs hold no
literal key; keys come from an environment reference or a key file, and a missing one fails
at launch naming it; /metrics can be put behind a key (server.metrics_auth)."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeserve.config import config_hash
from pipeserve.errors import ConfigError
from tests.conftest import ROOT, make_config
from tests.serve.test_monitoring import Prometheus, _find_prometheus

LIT_API = "lit-api-Q7xw93k"       # given on the command line
ENV_API = "env-api-Zr4m21p"       # from $PIPESERVE_TEST_API_KEY
FILE_ADMIN = "file-adm-Hb8s55t"   # from a key file
ENV_VAR = "PIPESERVE_TEST_API_KEY"
TIMEOUT = 30.0


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def record(response: httpx.Response) -> dict[str, str]:
    return dict(item.split("=", 1) for item in response.headers["x-pipeserve-record"].split(";"))


def build_hash(metrics_text: str) -> str:
    samples = [s for f in text_string_to_metric_families(metrics_text) for s in f.samples
               if s.name == "pipeserve_build_info"]
    assert len(samples) == 1, samples
    return samples[0].labels["config_hash"]


def observe(s: Any, api_key: str, metrics_key: str) -> dict[str, Any]:
    """What an outsider and a key holder see of one server."""
    metrics = httpx.get(s.base_url + "/metrics", headers=bearer(metrics_key), timeout=TIMEOUT)
    assert metrics.status_code == 200, metrics.text
    return {"denied": httpx.get(s.base_url + "/v1/models", timeout=TIMEOUT),
            "denied_msg": httpx.post(s.base_url + "/v1/messages", json={}, timeout=TIMEOUT,
                                     headers={"x-api-key": "wrong"}),
            "metrics_denied": httpx.get(s.base_url + "/metrics", timeout=TIMEOUT),
            "build_hash": build_hash(metrics.text),
            "ok": httpx.get(s.base_url + "/v1/models", headers=bearer(api_key), timeout=TIMEOUT)}


def quiet_port() -> int:
    """A free port below the ephemeral range, so that no client socket of another process
    takes it between the two launches that share it."""
    for _ in range(100):
        port = random.randint(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")


def on_port(server_factory: Any, port: int, *overrides: str) -> Any:
    """server_factory's process, on a port of our choosing (the last server.port wins)."""
    s = server_factory(f"server.port={port}", *overrides, wait=False)
    s.port, s.base_url = port, f"http://127.0.0.1:{port}"
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def launches(server_factory: Any, tmp_path_factory: pytest.TempPathFactory,
             model_cache: Path) -> dict[str, Any]:
    """Two launches on one port and files_dir (both in the config hash) with different keys:
    `literal` gives the API key on the command line; `refs` takes it from an environment
    reference and the admin key from a file. Both put /metrics behind a key."""
    work = tmp_path_factory.mktemp("secrets")
    port = quiet_port()
    lit_dir = work / "run-literal"
    files = f"server.files_dir={work / 'files'}"   # one for both: it is in the hash too
    literal = on_port(server_factory, port, f"server.api_key={LIT_API}", files,
                             "server.metrics_auth=true", f"hydra.run.dir={lit_dir}")
    seen_literal = observe(literal, LIT_API, LIT_API)
    literal_rc = literal.stop()
    literal_log = literal.log_path.read_text(errors="replace")

    key_file = work / "admin.key"
    key_file.write_text(FILE_ADMIN + "\n")
    refs_dir = work / "run-refs"
    os.environ[ENV_VAR] = ENV_API   # serve.py inherits it at Popen
    try:
        refs = on_port(server_factory, port, f"server.api_key=${{oc.env:{ENV_VAR}}}",
                              f"server.admin_key_file={key_file}", "server.metrics_auth=true",
                              f"hydra.run.dir={refs_dir}", files)
    finally:
        del os.environ[ENV_VAR]
    return {"port": port, "files": files, "literal": seen_literal, "literal_log": literal_log,
            "literal_rc": literal_rc, "literal_dir": lit_dir, "refs": refs,
            "seen_refs": observe(refs, ENV_API, FILE_ADMIN), "refs_dir": refs_dir,
            "key_file": key_file, "model_cache": model_cache}


def test_config_hash_is_the_same_whatever_the_keys(launches: dict[str, Any]) -> None:
    lit, refs = launches["literal"], launches["seen_refs"]
    assert launches["literal_rc"] == 0
    assert lit["build_hash"] == refs["build_hash"]
    for seen in (lit, refs):   # the record of a 401 and of a 200 name the same hash
        assert record(seen["denied"])["config_hash"] == seen["build_hash"]
        assert record(seen["ok"])["config_hash"] == seen["build_hash"]
    # and it is the hash of the same config with no key at all (the admin key it needs for
    # metrics_auth is a fourth, different value)
    keyless = make_config(f"server.port={launches['port']}",
                          f"model.cache_dir={launches['model_cache']}", launches["files"],
                          "server.metrics_auth=true", "server.admin_key=something-else")
    assert config_hash(keyless) == lit["build_hash"]


def test_401_carries_nothing_derived_from_the_key(launches: dict[str, Any]) -> None:
    for seen, keys in ((launches["literal"], [LIT_API]),
                       (launches["seen_refs"], [ENV_API, FILE_ADMIN])):
        denied, denied_msg = seen["denied"], seen["denied_msg"]
        assert denied.status_code == 401 and denied_msg.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"   # OpenAI's shape
        body = denied_msg.json()                                          # Anthropic's
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert body["error"]["type"] == "authentication_error"
        for r in (denied, denied_msg):
            everything = r.text + "".join(f"{k}:{v}" for k, v in r.headers.items())
            assert not any(k in everything for k in keys)
            # the only config-derived value, the hash, does not depend on the key (above)
            assert record(r)["config_hash"] == seen["build_hash"]


def grep(folder: Path, *needles: str) -> list[str]:
    hits = []
    for path in folder.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            hits += [f"{path}: {n}" for n in needles if n in text]
    return hits


def test_run_files_and_logs_hold_no_literal_key(launches: dict[str, Any]) -> None:
    lit_dir, refs_dir = launches["literal_dir"], launches["refs_dir"]
    hydra_files = {p.name for p in (lit_dir / ".hydra").iterdir()}
    assert hydra_files == {"config.yaml", "overrides.yaml", "hydra.yaml"}
    assert grep(lit_dir, LIT_API) == []
    assert LIT_API not in launches["literal_log"]
    assert "api_key: <redacted>" in (lit_dir / ".hydra" / "config.yaml").read_text()
    assert "- server.api_key=<redacted>" in (lit_dir / ".hydra" / "overrides.yaml").read_text()
    # references and key files are written as given, never resolved
    assert grep(refs_dir, ENV_API, FILE_ADMIN) == []
    config = (refs_dir / ".hydra" / "config.yaml").read_text()
    assert f"api_key: ${{oc.env:{ENV_VAR}}}" in config
    assert f"admin_key_file: {launches['key_file']}" in config
    assert "serve.log" in {p.name for p in refs_dir.iterdir()}


def test_env_and_file_keys_authenticate(launches: dict[str, Any]) -> None:
    base = launches["refs"].base_url
    assert httpx.get(base + "/v1/models", headers=bearer(ENV_API), timeout=TIMEOUT).status_code == 200
    assert httpx.get(base + "/v1/models", headers={"x-api-key": ENV_API},
                     timeout=TIMEOUT).status_code == 200
    for wrong in (LIT_API, ENV_API[:-1], ENV_API + "x", "-"):
        assert httpx.get(base + "/v1/models", headers=bearer(wrong),
                         timeout=TIMEOUT).status_code == 401, wrong
    # a non-ASCII key is compared like any other (401, never a 500)
    r = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer ключ".encode()},
                  timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    flush = base + "/admin/cache/flush"
    assert httpx.post(flush, headers=bearer(ENV_API), timeout=TIMEOUT).status_code == 401
    assert httpx.post(flush, headers=bearer(FILE_ADMIN), timeout=TIMEOUT).status_code == 200


def test_metrics_auth_needs_the_admin_key(launches: dict[str, Any]) -> None:
    base = launches["refs"].base_url
    for headers in ({}, bearer(ENV_API), bearer("nope")):   # the API key is not enough
        r = httpx.get(base + "/metrics", headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401
        body = r.json()["error"]
        assert body["type"] == "authentication_error" and "server.admin_key" in body["message"]
        assert "pipeserve_" not in r.text
    r = httpx.get(base + "/metrics", headers=bearer(FILE_ADMIN), timeout=TIMEOUT)
    assert r.status_code == 200 and "pipeserve_build_info" in r.text
    assert httpx.get(base + "/health", timeout=TIMEOUT).status_code == 200   # stays open


def test_metrics_auth_takes_the_api_key_without_an_admin_key(launches: dict[str, Any]) -> None:
    """The `literal` launch has only an API key: /metrics answered it 200 (observe asserts
    that) and refused a request without it, naming the key it wants."""
    r = launches["literal"]["metrics_denied"]
    assert r.status_code == 401
    assert "Authorization: Bearer <server.api_key>" in r.json()["error"]["message"]


# -- launches that must fail --------------------------------------------------------------
def launch(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PIPESERVE_UNSET_VAR"}
    return subprocess.run([sys.executable, str(ROOT / "serve.py"), "model=tiny",
                           f"hydra.run.dir={tmp_path / 'run'}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


LIT_BESIDE = "lit-beside-Pq09zz"   # a literal key beside the bad one: never in run files


@pytest.mark.parametrize("overrides, message", [
    (["server.api_key=${oc.env:PIPESERVE_UNSET_VAR}", f"server.admin_key={LIT_BESIDE}"],
     "server.api_key=${oc.env:PIPESERVE_UNSET_VAR} cannot be resolved: Environment variable "
     "'PIPESERVE_UNSET_VAR' not found"),
    (["server.api_key_file={tmp}/no-such.key", f"server.admin_key={LIT_BESIDE}"],
     "server.api_key_file '{tmp}/no-such.key' cannot be read: No such file or directory"),
], ids=["unset-env", "missing-file"])
def test_a_missing_key_source_fails_at_launch(tmp_path: Path, overrides: list[str],
                                              message: str) -> None:
    done = launch(tmp_path, *(o.replace("{tmp}", str(tmp_path)) for o in overrides))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "config error: " + message.replace("{tmp}", str(tmp_path)) in done.stderr
    run = tmp_path / "run"
    assert grep(run, LIT_BESIDE) == [] and LIT_BESIDE not in done.stdout + done.stderr
    assert "admin_key: <redacted>" in (run / ".hydra" / "config.yaml").read_text()


def test_key_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    """The same launch-time checks, in process (no serve.py start each)."""
    (tmp_path / "empty.key").write_text(" \n")
    (tmp_path / "ok.key").write_text("k")
    cases = [
        ([f"server.admin_key_file={tmp_path}/empty.key"],
         f"server.admin_key_file '{tmp_path}/empty.key' is empty"),
        ([f"server.api_key_file={tmp_path}/ok.key", "server.api_key=other"],
         "server.api_key and server.api_key_file are both set"),
        (["server.api_key=${oc.env:PIPESERVE_EMPTY_VAR,''}"],
         "server.api_key is empty; unset it to serve without a key"),
        (["server.metrics_auth=true"],
         "server.metrics_auth=true needs server.admin_key or server.api_key"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            make_config(*overrides)
        assert message in str(e.value), overrides
    assert make_config(f"server.api_key_file={tmp_path}/ok.key").server.api_key == "k"


def test_a_failed_launch_does_not_echo_a_literal_key(tmp_path: Path) -> None:
    """Hydra reports a job's exception with its overrides; serve.py reports it itself."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = launch(tmp_path, f"server.port={port}",
                      f"server.api_key={LIT_BESIDE}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"server.port {port} on 127.0.0.1 is already in use" in done.stderr
    assert LIT_BESIDE not in done.stdout + done.stderr
    assert grep(tmp_path / "run", LIT_BESIDE) == []


# -- a real Prometheus scraping /metrics behind the key ------------------------------------
class KeyedPrometheus(Prometheus):
    """Two scrape jobs of one server: `with_key` sends the admin key from its file, as
    dashboards/prometheus.yml documents; `without_key` sends none."""

    def __init__(self, target: str, key_file: Path, work: Path) -> None:
        self.key_file = key_file
        super().__init__(target, work)

    def jobs(self, target: str) -> dict[str, Any]:
        auth = {"type": "Bearer", "credentials_file": str(self.key_file)}
        return {"scrape_configs": [
            {"job_name": "with_key", "authorization": auth,
             "static_configs": [{"targets": [target]}]},
            {"job_name": "without_key", "static_configs": [{"targets": [target]}]}]}


def test_prometheus_scrapes_with_the_key_from_a_file(launches: dict[str, Any],
                                                     tmp_path: Path) -> None:
    _find_prometheus()
    prom = KeyedPrometheus(f"127.0.0.1:{launches['port']}", launches["key_file"], tmp_path)
    try:
        prom.wait_ready()
        prom.wait_for('up{job="with_key"}', 1)
        prom.wait_for('count(up{job="without_key"})', 1)   # scraped (and refused) at least once
        assert prom.value('up{job="without_key"}') == 0
        assert prom.value('count(pipeserve_build_info{job="with_key"})') == 1
        assert prom.query('pipeserve_build_info{job="without_key"}')["result"] == []
    finally:
        prom.stop()
