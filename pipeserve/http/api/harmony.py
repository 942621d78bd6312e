"""gpt-oss harmony output: a streaming splitter of the model's messages by channel. `analysis`
is reasoning; `final` and recipient-less `commentary` (preambles) are content; a message to a
recipient (`to=functions.NAME`) is a tool call, handed on to the tool-call parser in the
canonical spelling pipeserve.markup.tool_formats.harmony reads. Event loop, one per request; pure Python."""
from __future__ import annotations

import re

from pipeserve.markup.tool_formats import harmony

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
START = "<|start|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
HEADER_STARTS = ("<|", " to=", "to=")
MAX_HEADER = 256   # characters: a "header" longer than this without <|message|> is text


class HarmonySplitter:
    """Feed output text, get (reasoning, content). Headers and end markers never reach the
    client; partial markers are held back until they resolve."""

    HEADER, BODY = "header", "body"

    def __init__(self) -> None:
        self.state = self.HEADER
        self.kind = "content"   # of the open message: reasoning | content | call
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self.state == self.BODY and self.kind == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        return self._run(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        buf, self._buf = self._buf + text, ""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while buf or not final:
            if self.state == self.HEADER:
                buf = self._header(buf, out, final)
                if self.state == self.HEADER:
                    break
            else:
                buf, closed = self._body(buf, out, final)
                if not closed:
                    break
        return "".join(out["reasoning"]), "".join(out["content"])

    def _header(self, buf: str, out: dict[str, list[str]], final: bool) -> str:
        i = buf.find(MESSAGE)
        if i < 0:
            looks = any(buf.startswith(s) or s.startswith(buf) for s in HEADER_STARTS)
            if buf and (not looks or len(buf) > MAX_HEADER):
                self.state, self.kind = self.BODY, "content"   # text with no header: content
                return buf
            if not final:
                self._buf = buf
            return ""
        header, rest = buf[:i], buf[i + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            self.kind = "call"
            out["content"].append(harmony.canonical(recipient.group(1)))
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"
        self.state = self.BODY
        return rest

    def _body(self, buf: str, out: dict[str, list[str]], final: bool) -> tuple[str, bool]:
        """Release the open message's text; (what follows, whether the message closed)."""
        target = out["reasoning" if self.kind == "reasoning" else "content"]
        hits = [(j, m) for m in (*ENDS, START) if (j := buf.find(m)) >= 0]
        if not hits:
            keep = 0 if final else _partial(buf)
            target.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return "", False
        j, marker = min(hits)
        target.append(buf[:j])
        if self.kind == "call":
            out["content"].append("<|call|>")
        self.state = self.HEADER
        return (buf[j:] if marker == START else buf[j + len(marker):]), True


def _partial(buf: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of a marker."""
    for n in range(min(len(buf), 10), 0, -1):
        tail = buf[-n:]
        if any(m.startswith(tail) for m in (*ENDS, START)):
            return n
    return 0
