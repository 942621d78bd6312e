"""Volatile spans: per-request noise in a chat that carries no instruction (Claude Code's
attribution line, new on every request) removed from the messages before tokenize, so a
session's next prompt shares its whole prefix with this one's. Event loop; pure Python."""
from __future__ import annotations

import re

from pipeserve.request import PromptInput

HEADER = "x-pipeserve-volatile"


class VolatileSpans:
    """Removes the configured spans from every text of a chat's messages, in place."""

    def __init__(self, spans: dict[str, str] | None) -> None:
        # checked at launch (pipeserve/http/config.py), so every pattern compiles
        self.patterns = {name: re.compile(p) for name, p in (spans or {}).items()}

    def strip(self, inputs: PromptInput) -> list[str]:
        """Remove every match from `inputs.messages`' texts; the names of the spans removed."""
        if not self.patterns or not inputs.messages:
            return []
        found: set[str] = set()
        for message in inputs.messages:
            content = message.get("content")
            if isinstance(content, str):
                message["content"] = self._clean(content, found)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = self._clean(part["text"], found)
        return sorted(found)

    def _clean(self, text: str, found: set[str]) -> str:
        for name, pattern in self.patterns.items():
            text, n = pattern.subn("", text)
            if n:
                found.add(name)
        return text
