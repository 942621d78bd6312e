"""A batch's input file read into lines, and the lines of its output and error files in
OpenAI's shape: `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`. A line that cannot be sent (not JSON, a field missing, another endpoint's url) is
an error line of its own; a file with no line to send is refused whole. Pure Python."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from pipeserve.errors import InvalidRequest
from pipeserve.http.api.fields import check_depth

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LINES = 50_000   # OpenAI's limit of requests in one batch
# nesting a line's body may have: it is sent on as JSON, and orjson writes 254 levels at most
# (it reads 1024)
BODY_DEPTH = 254


@dataclass(frozen=True, slots=True)
class Line:
    index: int                      # its place among the requests (0-based; blank lines skipped)
    custom_id: str | None
    body: dict[str, Any] | None     # the request body; None when the line cannot be sent
    code: str | None = None         # why it cannot be: an OpenAI error code and message
    message: str | None = None


def parse(data: bytes, endpoint: str) -> list[Line]:
    """Every non-blank line of the file; a 400 (param input_file_id) when the file is not a
    batch input at all: not UTF-8, no line, more than MAX_LINES, a custom_id used twice, or
    no line that could be sent."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the input file is not UTF-8 text (byte {e.start}); a batch "
                             "input is JSONL, one request per line", param="input_file_id",
                             code="invalid_file") from None
    # split on newlines only: a JSON string may hold U+2028 and the like, which splitlines cuts
    raw = [(n, s) for n, s in enumerate(text.split("\n"), 1) if s.strip()]
    if not raw:
        raise InvalidRequest("the input file has no lines; a batch input is JSONL, one "
                             "request per line", param="input_file_id", code="invalid_file")
    if len(raw) > MAX_LINES:
        raise InvalidRequest(f"the input file has {len(raw)} lines; a batch holds at most "
                             f"{MAX_LINES}", param="input_file_id", code="too_many_lines")
    lines = [_line(i, n, s, endpoint) for i, (n, s) in enumerate(raw)]
    seen: set[str] = set()
    for line in lines:
        if line.custom_id is not None and line.custom_id in seen:
            raise InvalidRequest(f"request {line.index + 1}: custom_id {line.custom_id!r:.80} is "
                                 "used by an earlier line; each line needs its own",
                                 param="input_file_id", code="duplicate_custom_id")
        if line.custom_id is not None:
            seen.add(line.custom_id)
    if all(line.body is None for line in lines):
        first = lines[0]
        raise InvalidRequest(f"no line of the input file is a request; {first.message}",
                             param="input_file_id", code="invalid_file")
    return lines


def _line(index: int, number: int, text: str, endpoint: str) -> Line:
    """Line `number` of the file (1-based, blank lines counted), the `index`-th request."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        return Line(index, None, None, "invalid_json_line", f"line {number} is not JSON: {e}")
    if not isinstance(obj, dict):
        return Line(index, None, None, "invalid_json_line", f"line {number} is not a JSON object")
    cid = obj.get("custom_id")
    cid = cid if isinstance(cid, str) else None

    def bad(code: str, message: str) -> Line:
        return Line(index, cid, None, code, f"line {number}: {message}")
    if cid is None:
        return bad("missing_required_parameter", "custom_id is missing or not a string")
    if obj.get("method") != "POST":
        return bad("invalid_method", f"method is {obj.get('method')!r:.40}; allowed: 'POST'")
    if obj.get("url") != endpoint:
        return bad("invalid_url", f"url is {obj.get('url')!r:.80}; this batch's endpoint is "
                   f"{endpoint!r} (one endpoint per batch)")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("missing_required_parameter", "body is missing or not a JSON object")
    if body.get("stream") or body.get("background"):
        key = "stream" if body.get("stream") else "background"
        return bad("invalid_value", f"body.{key} is true; a batch line is answered whole")
    try:
        check_depth(body, "body", "body", BODY_DEPTH)
    except InvalidRequest as e:
        return bad("invalid_value", f"{e.message} (a line's body is sent on as JSON)")
    return Line(index, cid, body)


def response_line(line: Line, status: int, request_id: str, body: Any) -> dict[str, Any]:
    """The line of the output file (2xx) or of the error file (any other status)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def error_line(line: Line, code: str, message: str) -> dict[str, Any]:
    """The error file's line of a request that was never answered."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": None, "error": {"code": code, "message": message}}


def usage(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's `usage`: the tokens of its answered lines summed, whichever endpoint's
    usage shape they carry (chat and completions, Responses, embeddings)."""
    got = {"input": 0, "cached": 0, "output": 0, "reasoning": 0}
    for out in outs:
        u = (out["response"]["body"] or {}).get("usage") or {}
        details_in = u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}
        details_out = (u.get("output_tokens_details") or u.get("completion_tokens_details")
                       or {})
        got["input"] += u.get("input_tokens", u.get("prompt_tokens", 0)) or 0
        got["output"] += u.get("output_tokens", u.get("completion_tokens", 0)) or 0
        got["cached"] += details_in.get("cached_tokens", 0) or 0
        got["reasoning"] += details_out.get("reasoning_tokens", 0) or 0
    return {"input_tokens": got["input"], "input_tokens_details": {"cached_tokens": got["cached"]},
            "output_tokens": got["output"],
            "output_tokens_details": {"reasoning_tokens": got["reasoning"]},
            "total_tokens": got["input"] + got["output"]}
