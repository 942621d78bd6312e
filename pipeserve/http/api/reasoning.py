"""Reasoning spans: a streaming splitter of output text into (reasoning, content) by the
model's think markers (pipeserve.markup.output), and reasoning-effort values. Event loop; pure Python."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.markup.output import ThinkMarkers

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinking_from_effort(effort: Any, param: str) -> bool:
    """`reasoning_effort`-style value → enable_thinking ("none" turns thinking off)."""
    if effort not in EFFORTS:
        raise InvalidRequest(f"{param} is {effort!r}; allowed: {', '.join(EFFORTS)}", param=param)
    return effort != "none"


class ReasoningSplitter:
    """Feed output text, get (reasoning, content). A think span counts only at the start of
    the turn (after whitespace); partial markers and the whitespace around the span are held
    back, so neither marker nor padding reaches the client."""

    START, THINK, AFTER, CONTENT = "start", "think", "after", "content"

    def __init__(self, markers: ThinkMarkers, calls: tuple[str, ...] = ()) -> None:
        self.m = markers
        # tool-call start markers that also end a span: a model may write its call inside an
        # unclosed think span (Qwen3.5 does); the call and what follows are then content
        self.calls = calls
        self.state = self.START
        self._buf = ""
        self._fresh = True   # nothing of the think span released yet: strip its leading space

    @property
    def in_reasoning(self) -> bool:
        return self.state == self.THINK

    def feed(self, text: str) -> tuple[str, str]:
        return self._run(self._buf + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(self._buf, final=True)

    def _run(self, buf: str, final: bool) -> tuple[str, str]:
        self._buf = ""
        reasoning = ""
        if self.state == self.START:
            head = buf.lstrip()
            if head.startswith(self.m.start):
                self.state, buf = self.THINK, head[len(self.m.start):]
            elif not final and self.m.start.startswith(head):
                self._buf = buf   # whitespace or a partial start marker: wait
                return "", ""
            else:
                self.state = self.CONTENT
        if self.state == self.THINK:
            if self._fresh:
                buf = buf.lstrip()
            i, marker = self._first_end(buf)
            if i < 0:
                keep = 0 if final else self._held(buf)
                reasoning, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                self._fresh = self._fresh and not reasoning
                return (reasoning.rstrip() if final else reasoning), ""
            if marker != self.m.end:   # a call opened inside the span: it is the answer
                self.state = self.CONTENT
                return buf[:i].rstrip(), buf[i:]
            reasoning, buf = buf[:i].rstrip(), buf[i + len(self.m.end):]
            self.state = self.AFTER
        if self.state == self.AFTER:
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self.state = self.CONTENT
        return reasoning, buf

    def _first_end(self, buf: str) -> tuple[int, str]:
        """Where the span ends in `buf` and by which marker (the end marker or a call's
        start); (-1, "") when it does not."""
        found = [(i, m) for m in (self.m.end, *self.calls) if (i := buf.find(m)) >= 0]
        return min(found) if found else (-1, "")

    def _held(self, buf: str) -> int:
        """Tail to hold in a think span: a partial end (or call) marker and the whitespace
        before it."""
        keep = 0
        for marker in (self.m.end, *self.calls):
            for n in range(min(len(marker) - 1, len(buf)), keep, -1):
                if marker.startswith(buf[-n:]):
                    keep = n
                    break
        body = buf[:len(buf) - keep]
        return keep + len(body) - len(body.rstrip())
