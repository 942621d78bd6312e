"""The conversation previous_response_id continues: the stored one a request names (looked up
on the event loop, read by parse off it), each response stored with its conversation, and the
oldest turns truncation "auto" drops. Event loop."""
from __future__ import annotations

import json
import logging
from typing import Any

from pipeserve.errors import NotFound
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.openai import tool_call_body
from pipeserve.http.api.responses_input import conversation_media
from pipeserve.http.api.store import ResponseStore
from pipeserve.request import PromptInput

log = logging.getLogger("pipeserve")


class Looked:
    """The response store as parse sees it off the loop: the one entry the body's
    previous_response_id names, looked up on the loop beforehand."""

    def __init__(self, body: dict[str, Any], store: ResponseStore) -> None:
        previous = body.get("previous_response_id")
        self.id = previous
        self.item = store.get(previous) if isinstance(previous, str) else None

    def get(self, response_id: str) -> Any:
        return self.item if response_id == self.id else None


def history(store: ResponseStore | Looked, previous: str | None) -> list[dict[str, Any]]:
    """The conversation previous_response_id continues (none without it)."""
    if previous is None:
        return []
    item = store.get(previous)
    if item is None:
        raise NotFound(f"previous_response_id {previous!r} is unknown or expired (responses "
                       "are kept for server.responses_ttl_s and within "
                       "server.responses_store_mb)", param="previous_response_id",
                       code="previous_response_not_found")
    return list(item.conversation)


def save_response(store: ResponseStore, body: dict[str, Any],
                  conversation: list[dict[str, Any]], gen: Generation) -> list[dict[str, Any]]:
    """Store the response with its conversation (returned)."""
    turn: dict[str, Any] = {"role": "assistant", "content": gen.content}
    if gen.tool_calls:
        turn["tool_calls"] = [tool_call_body(c) for c in gen.tool_calls]
        for call in turn["tool_calls"]:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    stored = conversation + [turn]
    if not store.put(body["id"], body, stored):
        log.warning("response %s is larger than server.responses_store_mb, or nests too deep "
                    "to write as JSON; not stored", body["id"])
    return stored


def drop_oldest(inputs: PromptInput) -> bool:
    """Drop the first turn after the system messages, and what answers it, up to the next user
    message; False when only the last user turn is left."""
    messages = inputs.messages or []
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    end = first + 1
    while end < len(messages) and messages[end]["role"] != "user":
        end += 1
    if end >= len(messages):
        return False
    inputs.messages = messages[:first] + messages[end:]
    inputs.media = conversation_media(inputs.messages)
    return True
