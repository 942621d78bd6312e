"""Tool calls in model output, in the format pipeserve.markup.output resolved: a streaming extractor
that holds call markup back from the text, and arguments decoded against the tool's JSON schema.
Event loop, one ToolCallParser per request; pure Python."""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from pipeserve.http.api.fields import check_depth
from pipeserve.errors import InvalidRequest
from pipeserve.markup.tool_formats import RawCall, ToolFormat

log = logging.getLogger("pipeserve.tools")


@dataclass(slots=True)
class ToolCall:
    """One parsed call; `id` is protocol-neutral (adapters add call_/toolu_/fc_ prefixes)."""

    index: int
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


# -- arguments against the schema ----------------------------------------------------------
def _coerce(value: Any, kind: str) -> Any:
    """`value` as JSON-schema type `kind`; text (as XML-style markup writes values) converts."""
    if kind == "string":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return json.dumps(value)
    elif kind == "integer":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _coerce(value, "number")
        if float(number).is_integer():
            return int(number)
    elif kind == "number":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip()) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                pass
    elif kind == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
    elif kind == "null":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
            return None
    elif kind in ("object", "array"):
        want = dict if kind == "object" else list
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if isinstance(value, want):
            return value
    else:
        return value   # a type we do not check
    raise ValueError(f"{value!r:.40} is not {kind}")


def _check_property(name: str, value: Any, prop: dict[str, Any]) -> Any:
    kinds = prop.get("type")
    kinds = kinds if isinstance(kinds, list) else ([kinds] if isinstance(kinds, str) else [])
    if kinds:
        errors = []
        for kind in sorted(kinds, key=lambda k: k == "string"):   # string last: it takes text
            try:
                value = _coerce(value, kind)
                break
            except ValueError as e:
                errors.append(str(e))
        else:
            raise ValueError(f"argument '{name}': {' and '.join(errors)}")
    if "enum" in prop and value not in prop["enum"]:
        raise ValueError(f"argument '{name}' is {value!r:.40}; allowed: {prop['enum']}")
    return value


def decode_arguments(raw: RawCall, tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Check a parsed call against the request's tools: the name must be one of them, the
    required arguments present, and top-level argument values of the declared types."""
    name, args = raw
    try:   # the response echoes the arguments: keep them within what it can serialise
        check_depth(args, f"the arguments of the call to '{name}'", "tools")
    except InvalidRequest as e:
        raise ValueError(e.message) from None
    specs = {t["function"]["name"]: t["function"] for t in tools if isinstance(t.get("function"), dict)}
    if name not in specs:
        raise ValueError(f"the model called '{name}', which is not among the request's tools "
                         f"({', '.join(sorted(specs)) or 'none'})")
    schema = specs[name].get("parameters") or {}
    props = schema.get("properties") or {}
    out = {k: _check_property(k, v, props[k]) if isinstance(props.get(k), dict) else v
           for k, v in args.items()}
    missing = [k for k in schema.get("required") or [] if k not in out]
    if missing:
        raise ValueError(f"call to '{name}' lacks required argument(s) {', '.join(missing)}")
    return name, out


# -- the streaming extractor ---------------------------------------------------------------
class ToolCallParser:
    """Feed content text, get (text, calls). Text before a call streams live; a tail that
    could start a call is held back, and so is whitespace next to a call. A call body that
    does not parse or fit its schema goes back into the text, and the reason is logged."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]], request_id: str = "",
                 max_calls: int | None = None) -> None:
        self.fmt, self.tools, self.request_id = fmt, tools, request_id
        self.max_calls = max_calls       # parallel_tool_calls false: 1; later calls are dropped
        self.calls: list[ToolCall] = []
        self._buf = ""                   # text not yet released
        self._marker: str | None = None  # start marker of the open call (None: in text)
        self._body = ""                  # the open call's text after its marker
        self._gap = ""                   # whitespace dropped before the open call
        self._started = False            # text or a call seen: `leading` no longer applies
        self._emitted = False            # any text released yet
        self._after_call = False         # drop whitespace that follows a call
        self._pending_ws = ""            # whitespace that preceded a call, for the next text
        self._hold = max(len(m) for m in fmt.starts) - 1
        self._cut = False                # the output was cut (max_tokens) in the open call
        self.dropped_cut = False         # a call cut short was dropped, not returned as text

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._run(text, final=False)

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """At the end of the output: an unterminated call is parsed as it stands. `cut`: the
        output ended at max_tokens; a call it left unfinished is dropped (`dropped_cut`),
        never released as markup."""
        self._cut = cut
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        first = len(self.calls)
        if self._marker is None:
            self._buf += text
        else:
            self._body += text
        while self._close(out, final) if self._marker is not None else self._open(out, final):
            pass
        return "".join(out), self.calls[first:]

    def _open(self, out: list[str], final: bool) -> bool:
        """In text: release what cannot start a call; True when a call opened."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            self._after_call = not self._buf
        buf, lead = self._buf, self.fmt.leading
        if not self._started and lead is not None and buf.lstrip().startswith(lead):
            self._begin("", buf[:len(buf) - len(buf.lstrip())], buf.lstrip())
            return True
        hits = [(i, m) for m in self.fmt.starts if (i := buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            text = buf[:i].rstrip()
            self._emit(out, text)
            self._begin(marker, buf[len(text):i], buf[i + len(marker):])
            return True
        if final:
            self._emit(out, buf.rstrip() if self.calls else buf)
            self._buf = ""
            return False
        if not self._started and lead is not None and not buf.strip():
            return False   # only whitespace so far: a leading call may still come
        text = buf[:len(buf) - self._partial_start(buf)].rstrip()
        self._emit(out, text)
        self._buf = buf[len(text):]
        return False

    def _begin(self, marker: str, gap: str, body: str) -> None:
        self._marker, self._gap, self._body, self._buf = marker, gap, body, ""
        self._started = True

    def _close(self, out: list[str], final: bool) -> bool:
        """In a call: parse it once its end marker (or the output's end) arrives; True when
        the call closed."""
        end = self.fmt.end
        j = self._body.find(end) if end else -1
        if j < 0 and not final:
            return False
        body, rest = (self._body[:j], self._body[j + len(end or ""):]) if j >= 0 else (self._body, "")
        try:
            calls = [decode_arguments(raw, self.tools) for raw in self.fmt.parse(body)]
        except (ValueError, KeyError, TypeError, RecursionError) as e:   # model text: any shape
            if j < 0 and self._cut:
                log.info("request %s: %s tool call cut by max_tokens, dropped: %s",
                         self.request_id, self.fmt.name, e)
                self.dropped_cut = True
            else:
                log.info("request %s: %s tool call kept as text: %s", self.request_id,
                         self.fmt.name, e)
                closing = end if (j >= 0 and end) else ""
                self._emit(out, self._gap + (self._marker or "") + body + closing)
        else:
            for name, args in calls:
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    log.info("request %s: call to %s dropped: parallel_tool_calls is false and "
                             "the turn already made a call", self.request_id, name)
                    continue
                self.calls.append(ToolCall(len(self.calls), name, args))
            self._after_call = True
            self._pending_ws = self._pending_ws or self._gap
        self._marker, self._body, self._gap, self._buf = None, "", "", rest
        return True

    def _emit(self, out: list[str], text: str) -> None:
        """Release text; whitespace that stood before a call goes between the text around it."""
        if text:
            if self._emitted:
                text = self._pending_ws + text
            self._pending_ws = ""
            out.append(text)
            self._started = self._emitted = True

    def _partial_start(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a start marker."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            if any(m.startswith(buf[-n:]) for m in self.fmt.starts):
                return n
        return 0
