"""OpenAI's prompt_cache_key, through a real server and the openai SDK (Codex sends one on every
Responses request): the session's history is pinned in the prompt cache, so its next turn still
finds it after a flood of other prompts that evicts everything unpinned; the key is echoed,
honoured (not named as ignored), and a bad prompt_cache_retention is a 400 naming the field."""
from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve.test_cache_control import system_text
from tests.serve.test_openai import TIMEOUT

# tiny float32: 512 bytes of KV a token; 400 kB hold two of these ~300-token prompts, so a flood
# of eight raw completions (each smaller than the whole cache, so each is kept, and none sharing
# a first token with a chat prompt, so none refreshes one as a hit) evicts every unpinned one
RAM_GB = 400e3 / (1 << 30)
FLOOD = range(20, 28)


@pytest.fixture(scope="module")
def client(server_factory: Any) -> openai.OpenAI:
    srv = server_factory(f"cache.ram_gb={RAM_GB}")
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def respond(client: openai.OpenAI, seed: int, user: str, **extra: Any) -> Any:
    return client.responses.with_raw_response.create(
        model="tiny", instructions=system_text(seed), input=user, max_output_tokens=2, **extra)


def flood(client: openai.OpenAI) -> None:
    for seed in FLOOD:
        client.completions.create(model="tiny", prompt=system_text(seed), max_tokens=2)


def cached(raw: Any) -> int:
    return raw.parse().usage.input_tokens_details.cached_tokens


def test_keyed_session_survives_a_flood(client: openai.OpenAI) -> None:
    first = respond(client, 1, "What is first?", prompt_cache_key="session-1")
    body = first.parse()
    assert cached(first) < 10
    flood(client)
    again = respond(client, 1, "What is first?", prompt_cache_key="session-1")
    assert cached(again) >= body.usage.input_tokens - 10   # all but the generation prompt
    assert body.prompt_cache_key == "session-1"
    assert "prompt_cache_key" not in first.headers.get("x-pipeserve-ignored", "")


def test_without_a_key_the_flood_evicts(client: openai.OpenAI) -> None:
    first = respond(client, 2, "What is first?")
    flood(client)
    assert cached(respond(client, 2, "What is first?")) < 10
    assert first.parse().prompt_cache_key is None


def test_chat_completions_pin_by_key_too(client: openai.OpenAI) -> None:
    def ask() -> Any:
        return client.chat.completions.create(
            model="tiny", max_tokens=2, prompt_cache_key="chat-session",
            messages=[{"role": "system", "content": system_text(3)},
                      {"role": "user", "content": "Hello"}])
    first = ask()
    other = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "system", "content": system_text(5)}, {"role": "user", "content": "Hello"}])
    flood(client)
    again = ask()
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 10
    unkeyed = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "system", "content": system_text(5)}, {"role": "user", "content": "Hello"}])
    assert unkeyed.usage.prompt_tokens_details.cached_tokens < 10 < other.usage.prompt_tokens


def test_retention_is_checked(client: openai.OpenAI) -> None:
    raw = respond(client, 4, "Hi", prompt_cache_key="s4", prompt_cache_retention="24h")
    assert raw.parse().prompt_cache_retention == "24h"
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention is '1w'") as e:
        respond(client, 4, "Hi", prompt_cache_key="s4", prompt_cache_retention="1w")
    assert e.value.body["param"] == "prompt_cache_retention"
