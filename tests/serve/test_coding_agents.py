"""Coding agents' request shapes through a real server and the real SDKs. Claude Code's
attribution line (`x-anthropic-billing-header: ...; cch=<random>;`, its first system block,
new on every request) is a volatile span: removed before tokenize, so turns 2 and 3 of a
session reuse the whole prefix they share with the turn before; with server.volatile_spans=null
the cache stops at the line."""
from __future__ import annotations

import secrets
from typing import Any

import anthropic
import pytest

from tests.serve.test_anthropic import NO_EOS
from tests.serve.test_openai import TIMEOUT

SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude. You are an interactive "
          "agent that helps users with software engineering tasks. Use the tools available to "
          "you to read files, run commands and edit code. ") * 4
TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}},
         {"name": "Read", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]},
          "cache_control": {"type": "ephemeral"}}]
PROMPTS = ["List the files in this repository.", "Now read the README.",
           "Summarise what the project does."]


def billing() -> str:
    """Claude Code's attribution line: a fresh random `cch` on every request."""
    return (f"x-anthropic-billing-header: cc_version=2.1.37.{secrets.token_hex(2)}; "
            f"cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};")


def turn_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One request as Claude Code shapes it: the billing block, the system prompt marked
    for caching, tools, metadata, the last user block marked too."""
    return {"model": "tiny", "system": [
        {"type": "text", "text": billing()},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS, "messages": messages,
        "metadata": {"user_id": "user_abc_account__session_1234"}}


def session(client: anthropic.Anthropic) -> list[tuple[int, int, Any]]:
    """Three turns; per turn (prompt tokens of the turn before, cached tokens, raw response)."""
    messages: list[dict[str, Any]] = []
    out: list[tuple[int, int, Any]] = []
    previous = 0
    for prompt in PROMPTS:
        messages.append({"role": "user", "content": [
            {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]})
        body = turn_body(messages)
        raw = client.messages.with_raw_response.create(
            max_tokens=8, extra_body={"temperature": 0, "logit_bias": NO_EOS},
            extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
            **body)
        m = raw.parse()
        usage = m.usage
        total = (usage.input_tokens + usage.cache_creation_input_tokens
                 + usage.cache_read_input_tokens)
        out.append((previous, usage.cache_read_input_tokens, raw))
        previous = total
        messages[-1]["content"][0].pop("cache_control")
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": m.content[0].text}]})
    return out


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory()


def client_of(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                               timeout=TIMEOUT)


def test_billing_line_does_not_defeat_the_prefix_cache(srv: Any) -> None:
    turns = session(client_of(srv))
    for previous, cached, raw in turns[1:]:
        # the whole previous prompt is reused but its generation prompt (a few tokens),
        # which the next turn renders as the assistant's reply instead
        assert cached >= previous - 4, [(p, c) for p, c, _ in turns]
        assert raw.headers["x-pipeserve-volatile"] == "claude_code_billing"
    metrics = srv_metrics(srv)
    assert 'pipeserve_volatile_spans_total{span="claude_code_billing"} 3.0' in metrics


def test_count_tokens_ignores_the_billing_line(srv: Any) -> None:
    client = client_of(srv)
    body = turn_body([{"role": "user", "content": "hi"}])
    body.pop("metadata")   # not a count_tokens parameter
    with_line = client.messages.count_tokens(**body).input_tokens
    body["system"] = body["system"][1:]
    assert client.messages.count_tokens(**body).input_tokens == with_line


def test_off_with_one_key_the_line_breaks_the_prefix(server_factory: Any) -> None:
    off = server_factory("server.volatile_spans=null")
    turns = session(client_of(off))
    for previous, cached, raw in turns[1:]:
        assert cached < 40 < previous, [(p, c) for p, c, _ in turns]   # stops at the cch
        assert "x-pipeserve-volatile" not in raw.headers
        miss = raw.parse().usage.model_extra["cache_miss"]
        assert miss["reason"] == "diverged_at" and miss["index"] == cached


def srv_metrics(srv: Any) -> str:
    import httpx
    return httpx.get(srv.base_url + "/metrics", timeout=TIMEOUT).text
