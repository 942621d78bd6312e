"""distributed=tensor|pipeline end to end: real `mlx.launch --backend ring -n 2` groups of
`serve.py` on 127.0.0.1, talked to with the openai SDK, against single-process servers of the
same generated float32 models. Every process is started here, stopped by its own PID (a
group: its launcher's process group, made for it), and every wait is bounded."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, make_config, startup_error, wait_http
from pipeserve.errors import ConfigError

TIMEOUT = 60
MAX_TOKENS = 16   # greedy tokens compared per request
PROMPTS = ["hello there, how are", "the quick brown fox", "one two three four five six",
           "a much longer prompt that keeps going for a while so that it spans more tokens"]
CACHED = "system: you are a terse assistant who answers in one word. " * 6


def launcher() -> str:
    return str(Path(sys.executable).with_name("mlx.launch"))


def ring_ports(n: int) -> int:
    """A port p with p … p+n-1 free (mlx.launch's ring gives rank r port p + r), taken below
    the kernel's ephemeral range, so no port-0 bind or outgoing connection of another test
    takes one between this check and the ranks' bind, and from a band of its own for each
    xdist worker (the CI run of 2026-12-04 lost rank 2's port p+2 that way)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + 1000 * (index % 12)
    for _ in range(200):
        p = random.randrange(low, low + 1000 - n)
        try:
            for r in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + r))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in {low}..{low + 999}")


class Group:
    """`mlx.launch --backend ring -n N python serve.py ...` in its own process group."""

    def __init__(self, overrides: list[str], run_dir: Path, model_cache: Path, n: int = 2) -> None:
        # the HTTP port right after the ring's, from the worker's band too: a port-0 pick is
        # in the ephemeral range, where another test's client or server can take it first
        ring = ring_ports(n + 1)
        self.port = ring + n
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / f"group-{self.port}.log"
        args = [launcher(), "--backend", "ring", "-n", str(n), "--starting-port",
                str(ring), sys.executable, str(ROOT / "serve.py"),
                f"server.port={self.port}", f"model.cache_dir={model_cache}",
                f"hydra.run.dir={run_dir / str(self.port)}", *overrides]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_http(f"{self.base_url}/health", self.proc, "mlx.launch group", self.log, timeout_s)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def ranks(self) -> dict[int, int]:
        """rank → PID of the launcher's children (each execs python serve.py with MLX_RANK)."""
        found: dict[int, int] = {}
        for pid in _children(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"MLX_RANK="):
                    found[int(item.split(b"=", 1)[1])] = pid
        return found

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM to rank 0 stops the group (it tells the others); the launcher's process
        group is killed only if that does not end it in time."""
        if self.proc.poll() is None:
            rank0 = self.ranks().get(0)
            if rank0 is not None:
                os.kill(rank0, signal.SIGTERM)
            if self.wait_exit(30) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def sockets(pid: int) -> list[tuple[str, str]]:
    """(state, local host:port) of every TCP socket the process holds (its fds matched to
    /proc/<pid>/net); state 0A is LISTEN."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                host, port = cols[1].split(":")
                found.append((cols[3], f"{_addr(host)}:{int(port, 16)}"))
    return found


def _addr(hexaddr: str) -> str:
    if len(hexaddr) == 8:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexaddr)[::-1])
    raw = bytes.fromhex(hexaddr)
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Any]:
    started: list[Group] = []
    run_dir = tmp_path_factory.mktemp("groups")

    def start(*overrides: str, n: int = 2, wait: bool = True) -> Group:
        for attempt in range(3):   # a ring port taken by something outside the suite: again
            g = Group(list(overrides), run_dir, model_cache, n)
            started.append(g)
            if not wait:
                return g
            try:
                g.wait_ready()
                return g
            except BaseException:
                if attempt == 2 or "Couldn't bind socket" not in g.log():
                    raise
                g.stop()
        raise AssertionError("unreachable")
    yield start
    for g in started:
        g.stop()


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def complete(base_url: str, prompt: str, **kw: Any) -> tuple[list[str], str, int]:
    """The tokens (as logprobs names them), the text, and the completion token count."""
    r = sdk(base_url).completions.create(model="m", prompt=prompt, logprobs=1,
                                         **{"max_tokens": MAX_TOKENS, "temperature": 0, **kw})
    c = r.choices[0]
    return list(c.logprobs.tokens), c.text, r.usage.completion_tokens


def batched(base_url: str, prompts: list[str], **kw: Any) -> list[tuple[list[str], str, int]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(base_url, p, **kw), prompts))


# -- tensor parallel: qwen3 and llama, serial and batched ---------------------------------
@pytest.fixture(scope="module")
def qwen3(launch: Any, server_factory: Any) -> tuple[Any, Group]:
    return server_factory("model=tiny"), launch("model=tiny", "distributed=tensor")


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_tensor_greedy_equals_one_process_serial_and_batched(
        model: str, launch: Any, server_factory: Any, request: pytest.FixtureRequest) -> None:
    """qwen3 with dense KV, llama with paged KV (each rank's block pool holds its heads)."""
    if model == "tiny":
        ref, group = request.getfixturevalue("qwen3")
    else:
        ref = server_factory(f"model={model}", "kv=paged")
        group = launch(f"model={model}", "kv=paged", "distributed=tensor")
    alone = [complete(ref.base_url, p) for p in PROMPTS]
    assert all(n == MAX_TOKENS for _, _, n in alone)
    assert [complete(group.base_url, p) for p in PROMPTS] == alone
    assert batched(group.base_url, PROMPTS) == alone
    if model == "llama":
        group.stop()


def test_ranks_listen_on_loopback_only_and_only_rank0_serves_http(qwen3: Any) -> None:
    _, group = qwen3
    ranks = group.ranks()
    assert sorted(ranks) == [0, 1]
    for rank, pid in ranks.items():
        held = sockets(pid)
        assert held and all(addr.startswith("127.0.0.1:") for _, addr in held), (rank, held)
        listens = [addr for state, addr in held if state == "0A"]
        assert (f"127.0.0.1:{group.port}" in listens) == (rank == 0), (rank, held)
        if rank:
            assert listens == [], (rank, held)   # the ring's listener is rank 0's here
    # ranks must keep the same entries: the RAM tier is not fitted to each one's device
    assert "RAM tier 8.0 GiB (fixed in a distributed group" in group.log()


def test_seeds_logprobs_structured_output_and_prompt_cache_across_ranks(qwen3: Any) -> None:
    ref, group = qwen3
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    assert complete(group.base_url, PROMPTS[0], **seeded) == complete(ref.base_url, PROMPTS[0],
                                                                        **seeded)
    r = sdk(group.base_url).completions.create(model="m", prompt=PROMPTS[1], max_tokens=8)
    assert r.usage.completion_tokens >= 1   # seedless sampling: every rank drew the same seed
    choice = {"extra_body": {"guided_choice": ["alpha", "beta", "gamma"]}}
    one = sdk(ref.base_url).completions.create(model="m", prompt=PROMPTS[2], max_tokens=8,
                                               temperature=0, **choice)
    two = sdk(group.base_url).completions.create(model="m", prompt=PROMPTS[2], max_tokens=8,
                                                 temperature=0, **choice)
    assert two.choices[0].text == one.choices[0].text in ("alpha", "beta", "gamma")
    cold = sdk(group.base_url).completions.create(model="m", prompt=CACHED + "a", max_tokens=12,
                                                  temperature=0)
    warm = sdk(group.base_url).completions.create(model="m", prompt=CACHED + "b", max_tokens=12,
                                                  temperature=0)
    alone = sdk(ref.base_url).completions.create(model="m", prompt=CACHED + "b", max_tokens=12,
                                                 temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 32   # a hit on every rank
    assert warm.choices[0].text == alone.choices[0].text
    _, text, _ = complete(ref.base_url, PROMPTS[3])
    stop = text[6:9]   # a stop string inside the greedy output: rank 0 aborts on every rank
    stopped = complete(group.base_url, PROMPTS[3], stop=[stop])
    assert stopped == complete(ref.base_url, PROMPTS[3], stop=[stop])
    assert stop not in stopped[1] and stopped[2] < MAX_TOKENS
    assert httpx.get(group.base_url + "/health", timeout=5).status_code == 200


def test_cancelled_stream_frees_its_row_on_every_rank(qwen3: Any) -> None:
    ref, group = qwen3
    stream = sdk(group.base_url).completions.create(model="m", prompt=PROMPTS[3], stream=True,
                                                    max_tokens=3000, temperature=0)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()   # the client leaves: rank 0 aborts the row and tells the others
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(group.base_url + "/metrics", timeout=5).text
        if "pipeserve_active_rows 0.0" in metrics:
            break
        time.sleep(0.2)
    assert "pipeserve_active_rows 0.0" in metrics
    assert complete(group.base_url, PROMPTS[0]) == complete(ref.base_url, PROMPTS[0])
    metrics = httpx.get(group.base_url + "/metrics", timeout=5).text
    assert "pipeserve_distributed_ranks 2.0" in metrics
    counts = {(f.name, s.labels["rank"]): s.value for f in text_string_to_metric_families(metrics)
              if f.name.startswith("pipeserve_distributed_s") for s in f.samples
              if s.name.endswith("_count")}
    for rank in ("0", "1"):   # rank 0 exports the other rank's times too
        assert counts[("pipeserve_distributed_step_seconds", rank)] > 0, counts
        assert counts[("pipeserve_distributed_sync_seconds", rank)] > 0, counts


# -- pipeline parallel: the qwen3_5 stand-in (mlx-lm pipelines it; qwen3/llama it does not) -
def test_pipeline_greedy_equals_one_process(launch: Any, server_factory: Any) -> None:
    ref, group = server_factory("model=qwen"), launch("model=qwen", "distributed=pipeline")
    alone = [complete(ref.base_url, p) for p in PROMPTS[:3]]
    assert [complete(group.base_url, p) for p in PROMPTS[:3]] == alone
    assert batched(group.base_url, PROMPTS[:3]) == alone
    group.stop()


# -- a rank killed mid-stream: the group ends, rank 0 says why, nothing hangs ----------------
def test_killed_rank_stops_the_group_in_bounded_time(launch: Any) -> None:
    # the backend reports the lost peer at once; timeout_s is the stuck-collective fallback,
    # long enough that a loaded machine's slow step does not stop the group before the kill
    group = launch("model=tiny", "distributed=tensor", "distributed.linger_s=3",
                   "distributed.timeout_s=12")
    stream = sdk(group.base_url).completions.create(model="m", prompt=PROMPTS[0], stream=True,
                                                    max_tokens=3000, temperature=0)
    it = iter(stream)
    next(it)
    os.kill(group.ranks()[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in it:   # the stream ends with an error event, not a hang
            assert time.monotonic() - t0 < 20
    assert time.monotonic() - t0 < 20
    health = None
    try:
        health = httpx.get(group.base_url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        pass   # the launcher may already have stopped rank 0
    assert health in (None, 503)
    assert group.wait_exit(45) is not None, "the group did not end"
    log = group.log()
    assert "a rank is gone" in log and "the group stops" in log, log[-4000:]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_launcher_ends_every_rank(launch: Any) -> None:
    """A supervisor that kills mlx.launch's PID leaves no server behind."""
    group = launch("model=tiny", "distributed=tensor")
    ranks = group.ranks()
    assert set(ranks) == {0, 1}
    os.kill(group.proc.pid, signal.SIGKILL)
    try:
        assert _all_gone(list(ranks.values()), 20), {r: _alive(p) for r, p in ranks.items()}
        with pytest.raises(httpx.HTTPError):   # nothing listens on rank 0's port any more
            httpx.get(group.base_url + "/health", timeout=2)
    finally:
        for pid in ranks.values():   # bounded cleanup of what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_rank0_is_a_clean_leave_for_every_rank(launch: Any) -> None:
    group = launch("model=tiny", "distributed=tensor")
    ranks = group.ranks()
    os.kill(ranks[0], signal.SIGTERM)
    assert group.wait_exit(30) == 0
    assert _all_gone(list(ranks.values()), 20)   # bounded; generous for a loaded machine
    log = group.log()
    assert "[rank 1] stopped with rank 0" in log, log[-3000:]
    assert "connection to a peer was lost" not in log and "ERROR" not in log, log[-3000:]


# -- refused at launch ---------------------------------------------------------------------
def test_refusals_at_launch(launch: Any, model_cache: Path) -> None:
    assert "needs 2 or more ranks" in startup_error(model_cache, "distributed=tensor")
    assert "qwen3 has no pipeline()" in startup_error(model_cache, "distributed=pipeline")
    for _ in range(3):   # a real 3-rank launch (again if a ring port was taken meanwhile)
        group = launch("model=tiny", "distributed=tensor", n=3, wait=False)
        assert group.wait_exit(120) is not None, "the 3-rank launch did not exit"
        if "Couldn't bind socket" not in group.log():
            break
    assert "num_attention_heads is 4, not a multiple of 3" in group.log(), group.log()[-3000:]
    for overrides, why in [(["cache=ssd"], "cache=ssd with distributed=tensor"),
                           (["draft=ngram"], "draft=ngram with distributed=tensor"),
                           (["model.adapter_dir=/tmp", "model.adapter=a"], "LoRA adapters"),
                           (["server.isolate=true"], "server.isolate=true with distributed")]:
        with pytest.raises(ConfigError, match=why):
            make_config("distributed=tensor", *overrides)
    with pytest.raises(ConfigError, match="kv=q8 with distributed=pipeline is not supported"):
        make_config("distributed=pipeline", "kv=q8")
    with pytest.raises(ConfigError, match="admission.kv_budget_gb with distributed=pipeline"):
        make_config("distributed=pipeline", "admission=budget", "admission.kv_budget_gb=1")
