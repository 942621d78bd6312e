"""OpenAI's `prompt_cache_key` (Chat Completions and Responses): the key a client gives a session
so that its requests find their shared prefix. A model here runs on one engine and its prompt
cache finds a shared prefix by the tokens themselves, so there is nothing to route; what the key
does is pin the session's history (the whole input before the generation prompt) in the prompt
cache, as an Anthropic `cache_control` breakpoint does, for `prompt_cache_retention`
("in_memory", the default, or "24h"). Event loop; pure Python."""
from __future__ import annotations

from typing import Any

from pipeserve.http.api import fields as F
from pipeserve.errors import InvalidRequest

RETENTION_S = {"in_memory": 600.0, "24h": 86400.0}   # how long the pinned prefix is kept
MAX_KEY_CHARS = 1024


def pin(body: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[dict[str, Any],
                                                                     list[tuple[int, float]]]:
    """The fields to echo and the cache breakpoint (last message index, seconds) of a body's
    prompt_cache_key; none when the body has no key or no messages."""
    key = F.get(body, "prompt_cache_key", str)
    retention = F.get(body, "prompt_cache_retention", str)
    if retention is not None and retention not in RETENTION_S:
        raise InvalidRequest(f"prompt_cache_retention is {F.short(retention)}; allowed: "
                             f"{', '.join(RETENTION_S)}", param="prompt_cache_retention")
    if key is None:
        return {}, []
    if len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(f"prompt_cache_key has {len(key)} characters; at most "
                             f"{MAX_KEY_CHARS}", param="prompt_cache_key")
    echo = {"prompt_cache_key": key, "prompt_cache_retention": retention or "in_memory"}
    if not messages:
        return echo, []
    return echo, [(len(messages) - 1, RETENTION_S[retention or "in_memory"])]
