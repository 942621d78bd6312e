"""The coding agents' own CLIs, unmodified, from the npm registry, against a real pipeserve on
127.0.0.1: Claude Code (`claude -p`, Anthropic Messages), Codex (`codex exec`, Responses) and
opencode (`opencode run`, Chat Completions). Each runs a three-turn session through a recording
proxy on a generated tool-calling model (tests/serve/agent_model.py):

- turn 1 is a one-shot prompt: the model calls the CLI's shell tool, the CLI runs
  `echo pipeserve-tool-ok` and sends its output back, the model answers, the CLI exits 0;
- turns 2 and 3 continue the session: every request they send reuses >= 90% of its prompt from
  the prompt cache (the server's own request log says how much);
- no request the CLI sent got a 4xx or 5xx.

`.ci/run` installs the CLIs (pinned) and sets PIPESERVE_REQUIRE_AGENT_CLIS=1, so a missing one
fails there; elsewhere a test skips, naming the npm package. Run with -s to print the table
docs/coding-agents.md shows."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.serve.agent_model import ANSWER, write_agent_model
from tests.serve.agent_proxy import Exchange, Proxy
from tests.system_tools import find_agent_cli_or_skip

ECHO = "pipeserve-tool-ok"
PROMPTS = [f"Run `echo {ECHO}` and tell me what it printed.", "Thanks. Anything else to check?",
           "Then summarise the session in one line."]
GENERATION = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
LOG_LINE = re.compile(r"request (\S+) endpoint=(\w+) outcome=(\w+) prompt_tokens=(\d+) "
                      r"cached_tokens=(\d+)")
CLI_TIMEOUT_S = 900   # a bound, not a measurement: turn 1 prefills the CLI's whole prompt


def claude_cmd(exe: str, proxy: Proxy, turn: int) -> tuple[list[str], dict[str, str]]:
    """`claude -p`: its full prompt (47.7k tokens) is trimmed to the Bash tool and a one-line
    system prompt so that the CPU test prefills it in seconds (docs say how it ran in full)."""
    env = {"ANTHROPIC_BASE_URL": proxy.base_url, "ANTHROPIC_API_KEY": "sk-local",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    cmd = [exe, "-p", PROMPTS[turn], "--model", "tiny", "--output-format", "json",
           "--tools", "Bash", "--allowedTools", "Bash", "--system-prompt", "You are a coding agent."]
    return cmd + (["--continue"] if turn else []), env


def codex_cmd(exe: str, proxy: Proxy, turn: int) -> tuple[list[str], dict[str, str]]:
    """`codex exec` at its defaults, through a custom provider on the Responses API."""
    provider = (f'model_providers.pipeserve={{name="pipeserve", base_url="{proxy.base_url}/v1", '
                f'env_key="PIPESERVE_API_KEY", wire_api="responses"}}')
    opts = ["-c", 'model_provider="pipeserve"', "-c", provider, "-m", "tiny",
            "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    sub = ["exec", "resume", "--last"] if turn else ["exec"]
    return [exe, *sub, *opts, PROMPTS[turn]], {"PIPESERVE_API_KEY": "sk-local"}


def opencode_cmd(exe: str, proxy: Proxy, turn: int) -> tuple[list[str], dict[str, str]]:
    """`opencode run` at its defaults, with an OpenAI-compatible provider (Chat Completions)."""
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"local": {
        "npm": "@ai-sdk/openai-compatible", "name": "pipeserve",
        "options": {"baseURL": proxy.base_url + "/v1", "apiKey": "sk-local"},
        "models": {"tiny": {"name": "tiny"}}}}}
    cmd = [exe, "run", "-m", "local/tiny", *(["--continue"] if turn else []), PROMPTS[turn]]
    return cmd, {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}


# program, npm package, the call its generated model makes, how to run a turn
CLIS: dict[str, tuple[str, str, dict[str, Any], Callable[..., Any]]] = {
    "claude-code": ("claude", "@anthropic-ai/claude-code",
                    {"name": "Bash", "arguments": {"command": f"echo {ECHO}"}}, claude_cmd),
    "codex": ("codex", "@openai/codex",
              {"name": "exec_command", "arguments": {"cmd": f"echo {ECHO}"}}, codex_cmd),
    "opencode": ("opencode", "opencode-ai",
                 {"name": "bash", "arguments": {"command": f"echo {ECHO}",
                                                "description": "Print a marker"}}, opencode_cmd),
}


def tool_outputs(body: Any) -> list[str]:
    """Every tool result a request carries, in any of the three protocols, as JSON text."""
    found: list[str] = []
    if isinstance(body, dict):
        if body.get("type") in ("tool_result", "function_call_output") or body.get("role") == "tool":
            found.append(json.dumps(body))
        else:
            for value in body.values():
                found += tool_outputs(value)
    elif isinstance(body, list):
        for value in body:
            found += tool_outputs(value)
    return found


def log_requests(log: str) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of every request line in the server's log, in order."""
    return [(int(m[4]), int(m[5])) for m in LOG_LINE.finditer(log)]


def run_turn(name: str, exe: str, proxy: Proxy, turn: int, home: Path) -> subprocess.CompletedProcess:
    cmd, env = CLIS[name][3](exe, proxy, turn)
    full = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), **env}
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=home / "project", env=full, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


def session(name: str, server_factory: Any, tmp_path: Path, model_cache: Path) -> dict[str, Any]:
    """Three turns of one CLI; per turn: its exchanges, the server's request lines, its output."""
    program, package, call, _ = CLIS[name]
    exe = find_agent_cli_or_skip(program, package)
    model = write_agent_model(tmp_path / "tiny-agent", call, model_cache)
    srv = server_factory(f"model.path={model}")
    proxy = Proxy(srv.base_url)
    (tmp_path / "home" / "project").mkdir(parents=True)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    turns = []
    try:
        for turn in range(len(PROMPTS)):
            sent, logged = len(proxy.exchanges), len(log_requests(srv.log()))
            done = run_turn(name, exe, proxy, turn, tmp_path / "home")
            turns.append({"rc": done.returncode, "out": done.stdout + done.stderr,
                          "exchanges": proxy.since(sent),
                          "requests": log_requests(srv.log())[logged:]})
    finally:
        proxy.close()
    return {"version": version.stdout.strip(), "turns": turns}


def check(name: str, result: dict[str, Any]) -> None:
    turns = result["turns"]
    for i, t in enumerate(turns):
        assert t["rc"] == 0 and ANSWER in t["out"], f"{name} turn {i + 1}: {t['out'][-3000:]}"
        bad = [(e.method, e.path, e.status, e.response[:300]) for e in t["exchanges"] if e.status >= 400]
        assert not bad, f"{name} turn {i + 1} got errors: {bad}"
        assert t["requests"], f"{name} turn {i + 1} reached no generation endpoint"
    first = [e for e in turns[0]["exchanges"] if e.path.split("?")[0] in GENERATION]
    results = [r for e in first for r in tool_outputs(e.body) if ECHO in r]
    assert results, f"{name}: no request carried the tool's output back: {[e.body for e in first]}"
    for i, t in enumerate(turns[1:], start=2):
        for prompt, cached in t["requests"]:
            assert cached >= 0.9 * prompt, f"{name} turn {i}: {cached} of {prompt} cached"
    print(f"\n| {name} {result['version']} | " + " | ".join(table_cells(turns)) + " |")


def table_cells(turns: list[dict[str, Any]]) -> list[str]:
    """The doc's row: completes, no 4xx, tool round trip, each turn's cached share."""
    shares = ["/".join(f"{100 * c / p:.1f}%" for p, c in t["requests"]) for t in turns]
    calls = sum(1 for e in turns[0]["exchanges"] for r in tool_outputs(e.body) if ECHO in r)
    return ["yes", "yes", f"yes ({calls} request{'s' * (calls != 1)} carried it back)", *shares]


@pytest.mark.parametrize("name", list(CLIS))
def test_agent_cli_session(name: str, server_factory: Any, tmp_path: Path,
                           model_cache: Path) -> None:
    check(name, session(name, server_factory, tmp_path, model_cache))
