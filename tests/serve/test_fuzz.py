"""Fuzz: hypothesis generates structurally plausible bodies for every endpoint (known fields
with wrong types, huge and negative numbers, odd unicode, lone surrogates, deep nesting, broken
JSON) and sends them to a real server while a bystander greedy stream runs alongside. No answer
is a 5xx (nor a stream that fails with a server error), every 4xx is in the protocol's own error
shape with no exception text, and the bystander's output is exactly its solo output.

Bounded in time: FUZZ_SECONDS (120 s by default; PIPESERVE_FUZZ_SECONDS) for sending, with up
to FUZZ_EXAMPLES bodies per endpoint (PIPESERVE_FUZZ_EXAMPLES). scripts/fuzz_campaign.py runs
the same generators for longer, with a /health poller and a cancel storm."""
from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_from_bytes

import httpx
import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning

pytestmark = pytest.mark.filterwarnings("ignore", category=HypothesisWarning)  # large reprs

FUZZ_SECONDS = float(os.environ.get("PIPESERVE_FUZZ_SECONDS", "120"))
FUZZ_EXAMPLES = int(os.environ.get("PIPESERVE_FUZZ_EXAMPLES", "300"))
WORKERS = 4
NO_EOS = {"0": -100, "2": -100}
EXCEPTION_TEXT = re.compile(r"internal error|Traceback|\w+Error\(|\w+Exception\(")

# -- values -------------------------------------------------------------------------------
ODD_TEXT = st.sampled_from([
    "", " ", "\x00", "\u202e\u2066rtl", "e\u0301\u0301\u0301", "\U0001f600" * 8, "\ufeff",
    "\u2028\u2029", "<|im_end|>", "<|endoftext|>", "{{ 7*7 }}", "{% for x in range(9) %}x{% endfor %}",
    "\ud800", "\udfff", "a\ud83dz", "\\u0000", "null", "[", "{", "𝕳𝖊𝖑𝖑𝖔", "ａｂｃ", "x" * 5000,
])
TEXT = st.text(max_size=24) | ODD_TEXT | st.text(st.characters(codec="utf-8"), max_size=12)
BIG = st.sampled_from([0, -1, -2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                       -2**63, -2**63 - 1, 10**30, -10**30, 4094, 4095, 4096, 512, 513, 511])
FLOAT = (st.floats(allow_nan=True, allow_infinity=True)
         | st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 1.0, 2.0, 100.0, -1.0]))
SCALAR = st.none() | st.booleans() | st.integers() | BIG | FLOAT | TEXT
KEYS = st.sampled_from(["type", "text", "role", "content", "name", "id", "function",
                        "arguments", "parameters", "properties", "image_url", "url", "input"]) | TEXT


def nested_json(depth: int) -> str:
    """`depth` levels of alternating {"a": ...} and [...] around 0, as JSON text."""
    opens = ['{"a": ' if i % 2 == 0 else "[" for i in reversed(range(depth))]
    closes = ["}" if i % 2 == 0 else "]" for i in range(depth)]
    return "".join(opens) + "0" + "".join(closes)


# Deep nesting (past Python's recursion limit) stands in a body as a marker string that
# `encode` swaps for the nested JSON text, since json.dumps itself would recurse.
DEEP_JSON = {f"\x00deep{n}\x00": nested_json(n) for n in (40, 300, 900, 1100)}
DEEP = st.sampled_from(sorted(DEEP_JSON))
DEEP_900 = st.just("\x00deep900\x00")
NESTED = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(KEYS, inner, max_size=4), max_leaves=10)
VALUE = st.one_of(*[NESTED] * 11, DEEP)   # deep in about 1 of 12 values


GOOD: dict[int, Any] = {}   # id(mostly(...)) -> its plausible part


def mostly(good: Any, weight: int = 3) -> Any:
    """`good` most of the time, else any value."""
    out = st.one_of(*([good] * weight), VALUE)
    GOOD[id(out)] = good
    return out


def plausible(strategy: Any) -> Any:
    return GOOD.get(id(strategy), strategy)


SMALL_MAX = st.integers(1, 12)
# a generation limit: small, or any value that is not a valid long one (time is bounded)
LIMIT = st.one_of(*[SMALL_MAX] * 8, VALUE.filter(
    lambda v: v is not None and (not isinstance(v, int) or isinstance(v, bool)
                                 or not 24 < v <= 4096)))
SAMPLING = {
    "temperature": mostly(st.floats(0, 2) | st.sampled_from([0, 1, 1.5])),
    "top_p": mostly(st.floats(0, 1)),
    "top_k": mostly(st.integers(-3, 600) | BIG),
    "min_p": mostly(st.floats(0, 1)),
    "seed": mostly(st.integers(-2**64, 2**65) | BIG),
    "repetition_penalty": mostly(st.floats(0, 3)),
    "repetition_context_size": mostly(st.integers(-2, 100) | BIG),
    "presence_penalty": mostly(st.floats(-2, 2)),
    "frequency_penalty": mostly(st.floats(-2, 2)),
    "xtc_probability": mostly(st.floats(0, 1)),
    "xtc_threshold": mostly(st.floats(0, 0.6)),
    "logit_bias": mostly(st.dictionaries(st.integers(-5, 600).map(str) | TEXT,
                                         st.floats(-150, 150) | st.integers(-200, 200) | VALUE,
                                         max_size=4)),
    "stop": mostly(st.lists(TEXT, max_size=5) | TEXT),
    "n": mostly(st.integers(-1, 4) | BIG),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": VALUE})),
    "user": VALUE,
    "metadata": VALUE,
}
SCHEMA = st.recursive(st.fixed_dictionaries({"type": st.sampled_from(
    ["string", "integer", "number", "boolean", "null", "object", "array"]) | VALUE}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": st.dictionaries(TEXT, inner, max_size=3),
        "required": st.lists(TEXT, max_size=3) | VALUE}) | st.fixed_dictionaries(
        {"type": st.just("array"), "items": inner}), max_leaves=6) | VALUE
STRUCTURED = {
    "response_format": mostly(st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "json_object", "json_schema", "xml"]) | VALUE}, optional={
        "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})})),
    "guided_json": mostly(SCHEMA | st.sampled_from(["[" * 5000, nested_json(3000)])),
    "guided_regex": mostly(TEXT | st.sampled_from(["(a|b)*c", "[", "(?P<x>a)", "a{99999}",
                                                   "((((((((a*)*)*)*)*)*)*)*)", "\\"])),
    "guided_choice": mostly(st.lists(TEXT, max_size=4)),
    "guided_grammar": mostly(TEXT | st.sampled_from(["start: 'a'", "root ::= \"x\"", "::="])),
}
TOOL = st.fixed_dictionaries({"type": mostly(st.just("function"))}, optional={
    "function": mostly(st.fixed_dictionaries({"name": mostly(TEXT)}, optional={
        "description": VALUE, "parameters": SCHEMA | DEEP_900})),
    "name": TEXT, "parameters": SCHEMA, "input_schema": SCHEMA | DEEP_900})
TOOLS = {
    "tools": mostly(st.lists(TOOL, max_size=3)),
    "tool_choice": mostly(st.sampled_from(["none", "auto", "required", "any"])
                          | st.fixed_dictionaries({"type": TEXT}, optional={
                              "function": st.fixed_dictionaries({"name": TEXT}), "name": TEXT})),
    "chat_template_kwargs": mostly(st.dictionaries(st.sampled_from(
        ["enable_thinking", "chat_template", "add_generation_prompt", "tools"]) | TEXT, VALUE,
        max_size=3)),
    "reasoning_effort": mostly(st.sampled_from(["low", "medium", "high", "none"])),
}
BLOCK = st.fixed_dictionaries({"type": mostly(st.sampled_from(
    ["text", "image_url", "image", "tool_use", "tool_result", "input_text", "output_text",
     "thinking"]))}, optional={"text": mostly(TEXT), "image_url": VALUE, "source": VALUE,
                               "id": VALUE, "name": VALUE, "input": VALUE, "content": VALUE,
                               "tool_use_id": VALUE, "cache_control": VALUE})
CONTENT = mostly(TEXT | st.lists(BLOCK, max_size=3), 4)
TOOL_CALL = st.fixed_dictionaries({"id": mostly(TEXT), "type": mostly(st.just("function")),
                                   "function": mostly(st.fixed_dictionaries(
                                       {"name": mostly(TEXT), "arguments": mostly(TEXT)}))})


def messages(roles: list[str]) -> Any:
    msg = st.fixed_dictionaries({"role": mostly(st.sampled_from(roles), 4)}, optional={
        "content": CONTENT, "tool_calls": mostly(st.lists(TOOL_CALL, max_size=2)),
        "name": VALUE, "tool_call_id": VALUE, "reasoning_content": VALUE})
    return mostly(st.lists(msg, min_size=1, max_size=4), 6)


CHAT_ROLES = ["system", "developer", "user", "assistant", "tool", "function", "bot"]
ANTHROPIC_ROLES = ["user", "assistant", "system"]
TOKEN_IDS = st.lists(st.integers(-3, 600) | BIG, min_size=1, max_size=8)
ENDPOINT_FIELDS: dict[str, dict[str, Any]] = {
    "chat": {"messages": messages(CHAT_ROLES), "max_tokens": LIMIT,
             "max_completion_tokens": VALUE, "logprobs": mostly(st.booleans()),
             "top_logprobs": mostly(st.integers(-1, 25)), "model": mostly(st.just("tiny")),
             **SAMPLING, **STRUCTURED, **TOOLS},
    "completions": {"prompt": mostly(TEXT | TOKEN_IDS | st.lists(TEXT | TOKEN_IDS, max_size=3), 5),
                    "max_tokens": LIMIT, "echo": mostly(st.booleans()),
                    "logprobs": mostly(st.integers(-1, 7)), "suffix": VALUE,
                    "best_of": mostly(st.integers(0, 3)), "model": VALUE, **SAMPLING,
                    **STRUCTURED},
    "responses": {"input": mostly(TEXT | messages(["user", "system", "developer", "assistant"])
                                  | st.lists(st.fixed_dictionaries({"type": mostly(
                                      st.sampled_from(["message", "function_call",
                                                       "function_call_output", "reasoning"]))},
                                      optional={"role": VALUE, "content": CONTENT,
                                                "call_id": VALUE, "output": VALUE,
                                                "name": VALUE, "arguments": VALUE}),
                                      max_size=3), 5),
                  "instructions": mostly(TEXT), "max_output_tokens": LIMIT,
                  "previous_response_id": mostly(st.just("resp_missing") | TEXT, 1),
                  "store": mostly(st.booleans()), "text": mostly(st.fixed_dictionaries(
                      {"format": st.fixed_dictionaries({"type": mostly(st.sampled_from(
                          ["text", "json_object", "json_schema"]))}, optional={
                          "schema": SCHEMA, "name": TEXT})})),
                  "reasoning": mostly(st.fixed_dictionaries({}, optional={"effort": TEXT})),
                  "model": VALUE, **SAMPLING, **TOOLS},
    "messages": {"messages": messages(ANTHROPIC_ROLES), "max_tokens": LIMIT,
                 "system": mostly(TEXT | st.lists(BLOCK, max_size=2)),
                 "stop_sequences": mostly(st.lists(TEXT, max_size=3)),
                 "thinking": mostly(st.fixed_dictionaries({"type": mostly(st.sampled_from(
                     ["enabled", "disabled"]))}, optional={"budget_tokens": VALUE})),
                 "model": VALUE, "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
                 "top_k": SAMPLING["top_k"], "stream": SAMPLING["stream"],
                 "metadata": VALUE, **TOOLS},
}
ENDPOINT_FIELDS["count_tokens"] = {k: v for k, v in ENDPOINT_FIELDS["messages"].items()
                                   if k not in ("stream", "max_tokens")}
REQUIRED = {"chat": ["messages"], "completions": ["prompt"], "responses": ["input"],
            "messages": ["messages"], "count_tokens": ["messages"]}
USER_TURN = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1,
                                                                              max_size=40)})
BASES = {
    "chat": st.fixed_dictionaries({"messages": st.lists(USER_TURN, min_size=1, max_size=1)}),
    "completions": st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)
                                          | st.lists(st.integers(3, 511), min_size=1, max_size=8)}),
    "responses": st.fixed_dictionaries({"input": st.text(min_size=1, max_size=40)}),
    "messages": st.fixed_dictionaries({"messages": st.lists(USER_TURN, min_size=1, max_size=1)}),
}
BASES["count_tokens"] = BASES["messages"]
# always sent (an absent limit means "up to the context": seconds per call on this model)
LIMITS = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens",
          "messages": "max_tokens"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages",
         "count_tokens": "/v1/messages/count_tokens"}
ENDPOINTS = [*PATHS, "models"]


@dataclass
class Call:
    """One request the fuzzer sends: method, path, raw body bytes."""
    endpoint: str
    method: str
    path: str
    body: bytes | None = None

    def show(self, limit: int = 300) -> str:
        text = (self.body or b"").decode("utf-8", "backslashreplace")
        return f"{self.method} {self.path} {text[:limit]}{'...' if len(text) > limit else ''}"


def quote(text: str) -> str:
    return quote_from_bytes(text.encode("utf-8", "surrogatepass"), safe="")


def encode(body: Any, ascii_only: bool) -> bytes:
    """JSON bytes; lone surrogates survive as \\ud800 escapes, or as invalid UTF-8."""
    text = json.dumps(body, ensure_ascii=ascii_only)
    for marker, deep in DEEP_JSON.items():
        text = text.replace(json.dumps(marker, ensure_ascii=ascii_only), deep)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def calls(draw: Any, endpoint: str) -> Call:
    if endpoint == "models":
        query = draw(st.dictionaries(TEXT, TEXT, max_size=3))
        path = draw(st.sampled_from(["/v1/models", "/v1/responses/{}", "/v1/responses/{}"]))
        method = "DELETE" if path.startswith("/v1/responses") and draw(st.booleans()) else "GET"
        ident = draw(st.sampled_from(["resp_missing", "x" * 300, "%00", "..%2f..%2fetc", "é"])
                     | st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1,
                               max_size=40))
        path = path.format(ident)
        if query:
            path += "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items())
        return Call(endpoint, method, path)
    fields = ENDPOINT_FIELDS[endpoint]
    shape = draw(st.sampled_from(["valid_base"] * 5 + ["plausible"] * 4 + ["top_level", "broken"]))
    if shape == "top_level":   # valid JSON that is not an object
        return Call(endpoint, "POST", PATHS[endpoint], encode(draw(VALUE), draw(st.booleans())))
    body: dict[str, Any] = {}
    if shape == "valid_base":   # a valid request, then a few fields drawn as below
        body = draw(BASES[endpoint])
    for name in REQUIRED[endpoint]:
        if shape != "valid_base" and draw(st.integers(0, 9)):    # occasionally left out
            body[name] = draw(fields[name])
    if endpoint in LIMITS:
        body[LIMITS[endpoint]] = draw(SMALL_MAX if shape == "valid_base" else LIMIT)
    optional = sorted(set(fields) - {LIMITS.get(endpoint)} - set(REQUIRED[endpoint]))
    if shape == "valid_base":   # plausible values of a few fields (reaching the engine),
        for name in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
            body[name] = draw(plausible(fields[name]))
        if draw(st.booleans()):   # and then perhaps one field of any value
            body[draw(st.sampled_from(optional))] = draw(VALUE)
    else:
        for name in draw(st.lists(st.sampled_from(optional), max_size=6, unique=True)):
            body[name] = draw(fields[name])
    for _ in range(draw(st.integers(0, 1))):   # an unknown field
        body[draw(TEXT)] = draw(VALUE)
    raw = encode(body, draw(st.booleans()))
    if shape == "broken":   # cut, doubled or corrupted JSON
        how = draw(st.sampled_from(["cut", "trailing", "nan", "bytes"]))
        raw = {"cut": raw[:max(1, len(raw) // 2)], "trailing": raw + b"}{",
               "nan": raw.replace(b"1", b"NaN", 1), "bytes": raw[:1] + b"\xff\xfe" + raw[1:]}[how]
    return Call(endpoint, "POST", PATHS[endpoint], raw)


class Enough(Exception):
    """Raised inside the generator to stop it (time is up)."""


def produce(endpoint: str, n: int, put: Any, done: threading.Event,
            seed: int | None = None) -> None:
    """Draw up to `n` calls for `endpoint` with hypothesis and hand each to `put`, until `done`
    is set (no database, no shrinking: a bad answer is reported with its whole body). One
    thread per endpoint runs beside the senders, so drawing overlaps sending."""
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(calls(endpoint))
    def collect(call: Call) -> None:
        if done.is_set():
            raise Enough
        put(call)
    if seed is not None:
        collect = hypothesis.seed(seed)(collect)
    try:
        collect()
    except Enough:
        pass


# -- checking answers ------------------------------------------------------------------------
def error_shape_problem(endpoint: str, status: int, data: Any) -> str | None:
    """Why `data` is not the protocol's error body (None when it is)."""
    anthropic = endpoint in ("messages", "count_tokens")
    if anthropic:
        ok = (isinstance(data, dict) and data.get("type") == "error"
              and isinstance(data.get("error"), dict)
              and isinstance(data["error"].get("type"), str)
              and isinstance(data["error"].get("message"), str))
    else:
        err = data.get("error") if isinstance(data, dict) else None
        ok = (isinstance(err, dict) and isinstance(err.get("message"), str)
              and isinstance(err.get("type"), str)
              and (err.get("param") is None or isinstance(err.get("param"), str))
              and "code" in err)
    if not ok:
        return f"{status} body is not the {'Anthropic' if anthropic else 'OpenAI'} error shape"
    message = data["error"]["message"]
    if EXCEPTION_TEXT.search(message):
        return f"{status} message carries exception text: {message[:200]!r}"
    return None


def sse_errors(text: str) -> list[Any]:
    """The error payloads a 200 event stream carried."""
    found = []
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            found.append({"unparsable": line[:200]})
            continue
        if isinstance(data, dict) and (data.get("type") == "error" or "error" in data
                                       and data.get("error") is not None
                                       and data.get("object") != "response"):
            found.append(data)
    return found


@dataclass
class Outcome:
    call: Call
    status: int            # HTTP status; 599 for a transport failure or timeout
    problem: str | None    # why this answer breaks the contract, or None
    seconds: float = 0.0
    started: float = 0.0   # time.time() when it was sent


def send(client: httpx.Client, call: Call, timeout_s: float = 60.0) -> Outcome:
    started = time.time()
    o = _send(client, call, timeout_s)
    o.started = started
    return o


def _send(client: httpx.Client, call: Call, timeout_s: float) -> Outcome:
    t0 = time.perf_counter()
    try:
        r = client.request(call.method, call.path, content=call.body, timeout=timeout_s,
                           headers={"content-type": "application/json"} if call.body else None)
    except httpx.HTTPError as e:
        return Outcome(call, 599, f"no answer: {e!r}", time.perf_counter() - t0)
    took = time.perf_counter() - t0
    if r.status_code >= 500:
        return Outcome(call, r.status_code, f"{r.status_code}: {r.text[:300]}", took)
    if r.status_code >= 400:
        try:
            data = r.json()
        except ValueError:
            return Outcome(call, r.status_code, f"{r.status_code} body is not JSON: "
                           f"{r.text[:200]!r}", took)
        return Outcome(call, r.status_code, error_shape_problem(call.endpoint, r.status_code,
                                                                data), took)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        # bad input is refused before a stream starts: any error event is a failure
        for err in sse_errors(r.text):
            return Outcome(call, 200, f"stream failed: {json.dumps(err)[:300]}", took)
        return Outcome(call, 200, None, took)
    try:
        r.json()
    except ValueError:
        return Outcome(call, r.status_code, f"{r.status_code} body is not JSON", took)
    return Outcome(call, r.status_code, None, took)


# -- the bystander and the /health poller ------------------------------------------------------
BYSTANDER = {"model": "tiny", "stream": True, "temperature": 0, "max_tokens": 24,
             "logit_bias": NO_EOS,
             "messages": [{"role": "user", "content": "A bystander asks for a long, steady answer."}]}


def stream_text(client: httpx.Client, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the streamed text, None) or (None, why it failed)."""
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return None, f"status {r.status_code}: {r.read()[:200]!r}"
            parts: list[str] = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return None, f"stream error: {json.dumps(data)[:300]}"
                for choice in data.get("choices", []):
                    parts.append(choice.get("delta", {}).get("content") or "")
            return "".join(parts), None
    except (httpx.HTTPError, ValueError) as e:
        return None, f"no answer: {e!r}"


@dataclass
class Bystander:
    """Repeats one greedy stream until stopped; every run must equal the solo run."""
    base_url: str
    expected: str
    runs: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url) as client:
            while not self.stop.is_set():
                text, why = stream_text(client, BYSTANDER)
                self.runs += 1
                if why is not None:
                    self.failures.append(why)
                elif text != self.expected:
                    self.failures.append(f"output differs from solo: {text!r} != "
                                         f"{self.expected!r}")


@dataclass
class HealthPoller:
    base_url: str
    interval_s: float = 0.05
    worst_s: float = 0.0
    polls: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = client.get("/health", timeout=30)
                    if r.status_code != 200:
                        self.failures.append(f"/health {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(f"/health: {e!r}")
                self.worst_s = max(self.worst_s, time.perf_counter() - t0)
                self.polls += 1
                self.stop.wait(self.interval_s)


@dataclass
class Campaign:
    outcomes: list[Outcome]
    bystander: Bystander
    health: HealthPoller
    seconds: float

    def statuses(self) -> Counter[int]:
        return Counter(o.status for o in self.outcomes)

    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem is not None]


def fuzz(base_url: str, per_endpoint: int, seconds: float, workers: int = WORKERS,
         seed: int | None = None) -> Campaign:
    """About `per_endpoint` generated calls per endpoint, sent from `workers` threads as they
    are drawn, until all are sent or `seconds` pass, beside a bystander and a /health poller."""
    with httpx.Client(base_url=base_url) as client:
        expected, why = stream_text(client, BYSTANDER)
    assert why is None, f"the bystander's solo run failed: {why}"
    bystander = Bystander(base_url, expected)
    health = HealthPoller(base_url)
    threads = [threading.Thread(target=x.run, daemon=True) for x in (bystander, health)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    deadline = t0 + seconds
    calls_: queue.Queue[Call | None] = queue.Queue(maxsize=4 * workers)
    done = threading.Event()

    def put(call: Call) -> None:
        while not done.is_set():
            try:
                calls_.put(call, timeout=0.2)
                return
            except queue.Full:
                pass

    finished = threading.Semaphore(0)

    def producer(endpoint: str) -> None:
        try:
            for attempt in range(3):   # hypothesis is not thread-safe: a draw running beside
                try:                   # the other endpoints' may raise inside hypothesis;
                    produce(endpoint, per_endpoint, put, done,   # draw again, a new seed
                            None if seed is None else seed + attempt)
                    return
                except Exception as e:
                    print(f"producer {endpoint}: hypothesis raised {e!r}; drawing again")
        finally:
            finished.release()

    def closer() -> None:   # every worker stops once every producer is done
        for _ in ENDPOINTS:
            finished.acquire()
        for _ in range(workers):
            put(None)
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def worker() -> None:
        with httpx.Client(base_url=base_url) as client:
            while time.monotonic() < deadline:
                try:
                    call = calls_.get(timeout=0.2)
                except queue.Empty:
                    continue
                if call is None:
                    return
                o = send(client, call)
                with lock:
                    outcomes.append(o)
    gens = [threading.Thread(target=producer, args=(e,), daemon=True) for e in ENDPOINTS]
    gens.append(threading.Thread(target=closer, daemon=True))
    for g in gens:
        g.start()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: worker(), range(workers)))
    took = time.monotonic() - t0
    done.set()
    for g in gens:
        g.join(30)
    time.sleep(0.5)   # let the bystander's current run finish beside the last calls
    for x in (bystander, health):
        x.stop.set()
    for t in threads:
        t.join(150)
    return Campaign(outcomes, bystander, health, took)


def report(c: Campaign, limit: int = 20) -> str:
    by_endpoint = Counter((o.call.endpoint, o.status) for o in c.outcomes)
    lines = [f"{len(c.outcomes)} calls in {c.seconds:.1f} s; statuses {dict(sorted(c.statuses().items()))}",
             "by endpoint: " + ", ".join(f"{e}/{s}: {n}" for (e, s), n in sorted(by_endpoint.items())),
             f"bystander: {c.bystander.runs} runs, {len(c.bystander.failures)} failures",
             f"/health: {c.health.polls} polls, worst {c.health.worst_s * 1000:.1f} ms, "
             f"{len(c.health.failures)} failures"]
    for o in c.problems()[:limit]:
        lines.append(f"  [{o.call.endpoint}] {o.problem}\n      <- {o.call.show()}")
    lines += [f"  bystander: {f}" for f in c.bystander.failures[:limit]]
    return "\n".join(lines)


# -- the test -------------------------------------------------------------------------------
def test_fuzzed_bodies_get_4xx_in_protocol_shape_and_spare_the_bystander(server_factory: Any) -> None:
    server = server_factory("scheduler=continuous", "cache=ram")
    c = fuzz(server.base_url, FUZZ_EXAMPLES, FUZZ_SECONDS)
    summary = report(c)
    print(summary)
    sent = Counter(o.call.endpoint for o in c.outcomes)
    assert all(sent[e] >= 50 for e in ENDPOINTS), f"too few calls reached some endpoint: {sent}"
    assert not c.problems(), summary
    assert c.bystander.runs >= 3 and not c.bystander.failures, summary
    # the server is still whole: a plain request answers as before
    with httpx.Client(base_url=server.base_url) as client:
        text, why = stream_text(client, BYSTANDER)
    assert why is None and text == c.bystander.expected
