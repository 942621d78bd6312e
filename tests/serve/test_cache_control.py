"""Anthropic cache_control honoured, through a real server and the anthropic SDK: a
breakpoint's prefix survives a flood of other prompts that evicts everything else, and usage
is exact — input_tokens + cache_creation_input_tokens + cache_read_input_tokens is the prompt,
creation counts the breakpoint's tokens the cache did not supply, read what it did."""
from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.serve.test_openai import TIMEOUT

# tiny float32: 512 bytes of KV a token; 160 kB hold two of these prompts, so a flood of
# others evicts every unpinned entry
RAM_GB = 160e3 / (1 << 30)


def system_text(seed: int) -> str:
    words = ["river", "stone", "lamp", "orbit", "cedar", "pulse", "glyph", "ember", "quartz"]
    return " ".join(words[(seed * 5 + i * 7) % len(words)] + str(seed) for i in range(60))


@pytest.fixture(scope="module")
def client(server_factory: Any) -> anthropic.Anthropic:
    srv = server_factory(f"cache.ram_gb={RAM_GB}")
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                               timeout=TIMEOUT)


def ask(client: anthropic.Anthropic, system: str, user: str, pin: bool, **extra: Any) -> Any:
    block: dict[str, Any] = {"type": "text", "text": system}
    if pin:
        block["cache_control"] = {"type": "ephemeral", **extra}
    body = dict(model="tiny", system=[block], messages=[{"role": "user", "content": user}])
    total = client.messages.count_tokens(**body).input_tokens
    usage = client.messages.create(max_tokens=2, **body).usage
    assert (usage.input_tokens + usage.cache_creation_input_tokens
            + usage.cache_read_input_tokens) == total   # exact accounting
    return usage


def flood(client: anthropic.Anthropic) -> None:
    for seed in range(100, 108):
        ask(client, system_text(seed), "Summarise.", pin=False)


def test_pinned_prefix_survives_a_flood_and_usage_is_exact(client: anthropic.Anthropic) -> None:
    first = ask(client, system_text(1), "What is first?", pin=True)
    assert first.cache_read_input_tokens < 10   # cold: only a template opening at most
    assert first.cache_creation_input_tokens > 100   # the system prompt, written now
    flood(client)
    again = ask(client, system_text(1), "And then?", pin=True)
    assert again.cache_creation_input_tokens == 0
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens


def test_without_cache_control_the_flood_evicts(client: anthropic.Anthropic) -> None:
    first = ask(client, system_text(2), "What is first?", pin=False)
    assert first.cache_creation_input_tokens == 0
    flood(client)
    again = ask(client, system_text(2), "And then?", pin=False)
    assert again.cache_read_input_tokens < 10


def test_one_hour_ttl_and_bad_cache_control(client: anthropic.Anthropic) -> None:
    usage = ask(client, system_text(3), "Hi", pin=True, ttl="1h")
    assert usage.cache_creation_input_tokens > 100
    with pytest.raises(anthropic.BadRequestError, match="cache_control.ttl is '2h'"):
        ask(client, system_text(3), "Hi", pin=True, ttl="2h")


def test_five_marked_blocks_in_one_message_are_a_400(client: anthropic.Anthropic) -> None:
    """Anthropic's limit counts blocks: five marked blocks of one message are five, not one."""
    mark = {"type": "ephemeral"}
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="5 blocks have cache_control; at most 4"):
        client.messages.create(model="tiny", max_tokens=2,
                               messages=[{"role": "user", "content": blocks}])
    out = client.messages.create(model="tiny", max_tokens=2,
                                 messages=[{"role": "user", "content": blocks[:4]}])
    assert out.usage.output_tokens >= 1
