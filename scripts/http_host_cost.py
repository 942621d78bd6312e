"""The HTTP side's host cost of one streaming chat request, stage by stage, in one process with
nothing else running: the real request stages of the generated tiny model (parse, chat
template and tokenize, admission, the first SSE frame) and the per-token output path
(detokenize, output chain, chunk, SSE frame, stream log), driven by a scripted engine
(tests/http/scripted.py) so no model runs. Microseconds per request and per token event.

    python scripts/http_host_cost.py --requests 400
    python scripts/http_host_cost.py --output-lengths 100,1000,8000   # µs a token, long outputs
    python scripts/http_host_cost.py --requests 20 --prompt-tokens 16384 --long \
        model.path=/path/to/a/model   # a 16k prompt as chat text and as token ids, its tokenizer

--long: the request stages of one long prompt sent both ways (a chat whose last user message
makes it --prompt-tokens long; /v1/completions with that many token ids, as bench.py's ttft
workload sends its repeats), and each request's TTFT in the request log (the server's own
clock: handler start to first token) through the app with the scripted engine, which answers
at once: what the HTTP side adds to a long prompt's first token.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeserve.core.events import Finished, TokenDelta  # noqa: E402
from pipeserve.core.stream import RequestStream  # noqa: E402
from pipeserve.http.api.openai_chat import parse_chat  # noqa: E402
from pipeserve.http.api.openai_shape import ChatShape  # noqa: E402
from pipeserve.http.api import openai_http  # noqa: E402
from pipeserve.http.api.generation import Generation  # noqa: E402
from pipeserve.http.api.http import read_body, sse_data  # noqa: E402
from pipeserve.request import FinishReason  # noqa: E402
from tests.conftest import make_config  # noqa: E402
from tests.http.scripted import InProcess, tokenizer_side  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
TEXT = ""   # the user message: grown (calibrate) until the chat prompt has --prompt-tokens


class FakeHttp:
    """What read_body reads of a Sanic request."""

    def __init__(self, body: bytes) -> None:
        self.body = body


def body_bytes(i: int, max_tokens: int) -> bytes:
    return orjson.dumps({"model": "tiny", "stream": True, "max_tokens": max_tokens,
                         "temperature": 0, "logit_bias": {"7": -100, str(11 + i % 50): 1},
                         "messages": [{"role": "user", "content": f"{i} {TEXT}" if TEXT else ""}]})


def per_call(fn: Callable[[int], Any], n: int, rounds: int = 5) -> float:
    """µs per call of fn(i), i in range(n), after a warm-up of 20: the quickest of `rounds`
    rounds (the machine is shared: the slower rounds measure the neighbours)."""
    for i in range(20):
        fn(i)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def calibrate(front: Any, want: int) -> str:
    """A user message whose chat prompt renders to about `want` tokens (as the burst's): the
    fewest words that reach it, found by doubling then bisecting."""
    def tokens(words: int) -> int:
        body = orjson.loads(body_bytes(0, 1))
        body["messages"][0]["content"] = text(words)
        req = openai_http._choice_request(parse_chat(body), "calibrate", "chat", 0, None)
        return len(front.tokenize.encoder.encode_text(
            front.tokenize.prompt.render_text(req.inputs), False, "messages"))

    def text(words: int) -> str:
        return " ".join(WORDS[i % len(WORDS)] for i in range(words))

    high = 1
    while tokens(high) < want:
        high *= 2
    low = high // 2
    while low + 1 < high:
        mid = (low + high) // 2
        low, high = (mid, high) if tokens(mid) < want else (low, mid)
    return text(high)


def measure(app: Any, loop: asyncio.AbstractEventLoop, n: int, tokens: int,
            prompt_tokens: int = 76) -> dict[str, float]:
    global TEXT
    ctx = app.ctx
    front = ctx.front
    TEXT = calibrate(front, prompt_tokens)
    bodies = [body_bytes(i, tokens) for i in range(n + 20)]
    parsed = [parse_chat(read_body(FakeHttp(b))) for b in bodies]
    reqs = [openai_http._choice_request(p, f"chatcmpl-{i}", "chat", 0, None)
            for i, p in enumerate(parsed)]
    out: dict[str, float] = {}
    out["parse (JSON body, fields)"] = per_call(
        lambda i: parse_chat(read_body(FakeHttp(bodies[i]))), n)
    toks = [loop.run_until_complete(front.tokenize(front.normalise(r))) for r in reqs]
    fresh = [openai_http._choice_request(p, f"chatcmpl-t{i}", "chat", 0, None)
             for i, p in enumerate(parsed)]
    # the pool's parent holds no weights: unless its engine publishes that the model's cache
    # rewinds, every chat's history end is rendered and encoded a second time
    front.tokenize.session_checkpoints = True
    out["chat template + tokenize, history end marked (process core before)"] = per_call(
        lambda i: loop.run_until_complete(front.tokenize(front.normalise(fresh[i]))), n)
    front.tokenize.session_checkpoints = False
    out["chat template + tokenize (thread core; process core after)"] = per_call(
        lambda i: loop.run_until_complete(front.tokenize(front.normalise(fresh[i]))), n)
    admitted = [loop.run_until_complete(front.admission(r)) for r in toks[:20]]
    out["admission"] = per_call(lambda i: loop.run_until_complete(front.admission(toks[i])), n)
    shape = ChatShape("chatcmpl-x", "tiny", front.token_info, "fp_x")
    out["first SSE frame (role chunk)"] = per_call(
        lambda i: sse_data(shape.chunk({"role": "assistant", "content": ""}, index=0)), n)
    del admitted
    ids = front.tokenize.encoder.encode(TEXT * 4)[:tokens]
    out.update(stream_cost(app, loop, reqs, toks, ids, shape, parsed, n))
    return out


class SocketResponse:
    """The connection's end as the stream log sees it: each `send` one write to a socket
    (a local socket pair, drained by `drain`), counted."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.theirs.setblocking(False)
        self.writes = 0

    async def send(self, data: bytes, end_stream: bool | None = None) -> None:
        self.writes += 1
        self.ours.sendall(data)

    def drain(self) -> None:
        try:
            while self.theirs.recv(1 << 20):
                pass
        except BlockingIOError:
            pass


def stream_cost(app: Any, loop: asyncio.AbstractEventLoop, reqs: list[Any], toks: list[Any],
                ids: list[int], shape: Any, parsed: list[Any], n: int) -> dict[str, float]:
    """The output path of whole streams (role chunk, a frame per token, the finish chunk,
    [DONE]) from events the engine posts one step at a time (the loop keeps up) or all at
    once (the loop fell behind), written to a socket; per token: the difference to one-token
    streams."""
    store, conn = app.ctx.streams, SocketResponse()

    async def one(i: int, count: int, steps: bool) -> None:
        req = toks[i]
        stream = RequestStream(loop)
        events: list[Any] = [TokenDelta(req.request_id, [t]) for t in ids[:count]]
        events.append(Finished(req.request_id, FinishReason.LENGTH, req.num_prompt_tokens,
                               count, 0, extras={"batch_size_max": 1}))
        if steps:   # one step message a loop pass; the last token comes with Finished
            batches = [[e] for e in events[:-2]] + [events[-2:]]

            def post(k: int) -> None:
                for event in batches[k]:
                    stream._put(event)
                if k + 1 < len(batches):
                    loop.call_soon(post, k + 1)
            loop.call_soon(post, 0)
        else:
            for event in events:
                stream._put(event)
        gen = Generation(app.ctx, req, stream, True)
        log = store.open(f"s-{i}-{count}-{time.perf_counter_ns()}", False)
        follow = loop.create_task(log.follow(conn, -1, 60.0, primary=True))
        await asyncio.sleep(0)
        await openai_http._stream(log, [gen], None, shape, parsed[i], True)
        log.end()
        await follow
        conn.drain()

    out: dict[str, float] = {}
    for steps, how in ((True, "a step at a time"), (False, "all at once")):
        conn.writes = 0
        one_token = per_call(lambda i: loop.run_until_complete(one(i, 1, steps)), n, 1)
        many = per_call(lambda i: loop.run_until_complete(one(i, len(ids), steps)), n, 1)
        writes = conn.writes / (2 * (n + 20))
        out[f"stream of 1 token, events {how}"] = one_token
        out[f"per token event, events {how} ({len(ids)} - 1 tokens, difference)"] = \
            (many - one_token) / (len(ids) - 1)
        out[f"writes a request ({len(ids)} and 1 tokens, mean), events {how}"] = writes
    return out


def output_cost(app: Any, loop: asyncio.AbstractEventLoop, lengths: list[int],
                rounds: int = 3) -> dict[str, float]:
    """µs a token of a Generation's own output path (detokenize, stop strings, output chain,
    the text kept for the response) over a whole output of each length, its events all
    there: whether the cost a token grows with the output."""
    ctx = app.ctx
    front = ctx.front
    body = orjson.loads(body_bytes(0, max(lengths)))
    body["stop"] = ["never in this text"]
    req = openai_http._choice_request(parse_chat(body), "chatcmpl-long", "chat", 0, None)
    req = loop.run_until_complete(front.tokenize(front.normalise(req)))
    text = " ".join(WORDS) + ". "
    ids = list(front.tokenize.tokenizer.encode(text * (max(lengths) // 8 + 1),
                                               add_special_tokens=False))[:max(lengths)]

    async def one(count: int) -> None:
        stream = RequestStream(loop)
        for t in ids[:count]:
            stream._put(TokenDelta(req.request_id, [t]))
        stream._put(Finished(req.request_id, FinishReason.LENGTH, req.num_prompt_tokens, count,
                             0, extras={"batch_size_max": 1}))
        await Generation(ctx, req, stream, True).run()

    out = {}
    for count in lengths:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            loop.run_until_complete(one(count))
            best = min(best, time.perf_counter() - t0)
        out[f"output path a token, {count} tokens out"] = best / count * 1e6
    return out


def long_prompt(app: Any, proc: Any, n: int, prompt_tokens: int) -> dict[str, float]:
    """µs per request of each request stage for one long prompt (a chat of four messages whose
    last user message carries the length; the same length as token ids to /v1/completions),
    then each case's TTFT through the app as the request log has it: the chat cold (a new
    system prompt every time), repeated exactly, and as the next turn (this answer and a short
    user message after it); the ids sent again."""
    import logging
    import random

    from pipeserve.http.api.openai_completions import parse_completion

    loop, front = proc.loop, app.ctx.front
    tok = front.tokenize
    text = calibrate(front, prompt_tokens)
    half = len(text) // 2

    def chat(k: int, turn: str = "") -> dict[str, Any]:
        messages = [{"role": "system", "content": f"You are agent {k}."},
                    {"role": "user", "content": text[:half]},
                    {"role": "assistant", "content": "Read it."},
                    {"role": "user", "content": text[half:]}]
        if turn:
            messages += [{"role": "assistant", "content": "Hello there, friend."},
                         {"role": "user", "content": turn}]
        return {"model": "tiny", "stream": True, "max_tokens": 4, "temperature": 0,
                "messages": messages}

    rng = random.Random(0)
    ids = [rng.randrange(3, min(tok.vocab_size, 500)) for _ in range(prompt_tokens)]
    ids_body = orjson.dumps({"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0.0,
                             "stream": True, "stream_options": {"include_usage": True},
                             "logit_bias": {}})
    chat_body = orjson.dumps(chat(0))
    out: dict[str, float] = {"chat prompt tokens": len(tok.encoder.encode_text(
        tok.prompt.render_text(parse_chat(orjson.loads(chat_body)).inputs), False, "messages")),
        "chat body bytes": len(chat_body), "ids body bytes": len(ids_body)}
    count = iter(range(1, 1 << 30))

    def request(body: bytes, endpoint: str = "chat") -> Any:
        parse = parse_chat if endpoint == "chat" else parse_completion
        return openai_http._choice_request(parse(read_body(FakeHttp(body))),
                                           f"x-{next(count)}", endpoint, 0, None)

    out["chat: parse (JSON body, fields)"] = per_call(
        lambda i: parse_chat(read_body(FakeHttp(chat_body))), n)
    out["chat: volatile spans"] = per_call(lambda i: front.normalise(request(chat_body)), n) \
        - out["chat: parse (JSON body, fields)"]
    rendered = tok.prompt.render_text(request(chat_body).inputs)
    out["chat: template"] = per_call(lambda i: tok.prompt.render_text(request(chat_body).inputs),
                                     n) - out["chat: parse (JSON body, fields)"]
    out["chat: encode (the rendered text, from scratch)"] = per_call(
        lambda i: tok.encoder.encode_text(rendered, False, "messages"), n)
    out["chat: tokenize stage (render, encode, marks; as served)"] = per_call(
        lambda i: loop.run_until_complete(tok(front.normalise(request(chat_body)))), n) \
        - out["chat: parse (JSON body, fields)"] - out["chat: volatile spans"]
    fresh = [orjson.dumps(chat(10_000 + i)) for i in range(n + 20)]   # a new system prompt
    out["chat: tokenize stage, a new chat each time"] = per_call(
        lambda i: loop.run_until_complete(tok(front.normalise(request(fresh[i])))), n) \
        - out["chat: parse (JSON body, fields)"] - out["chat: volatile spans"]
    toks = [loop.run_until_complete(tok(front.normalise(request(chat_body))))
            for _ in range(n + 20)]
    out["admission"] = per_call(lambda i: loop.run_until_complete(front.admission(toks[i])), n)
    out["ids: parse (JSON body, fields)"] = per_call(
        lambda i: parse_completion(read_body(FakeHttp(ids_body))), n)
    out["ids: tokenize stage (check the ids)"] = per_call(
        lambda i: loop.run_until_complete(tok(request(ids_body, "completions"))), n) \
        - out["ids: parse (JSON body, fields)"]

    ttft: list[float] = []

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) == "request":
                ttft.append(record.ttft_s)

    handler = Log()
    logger = logging.getLogger("pipeserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def served(body: bytes, path: str) -> None:
        async def go(client: Any) -> None:
            r = await client.post(path, content=body,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]
        proc.run(go)

    def case(name: str, bodies: Callable[[int], bytes], path: str) -> None:
        for i in range(3):
            served(bodies(i), path)
        ttft.clear()
        for i in range(n):
            served(bodies(3 + i), path)
        out[f"TTFT {name} (request log, median)"] = sorted(ttft)[len(ttft) // 2] * 1e6

    try:
        case("chat, cold", lambda i: orjson.dumps(chat(1000 + next(count))), "/v1/chat/completions")
        case("chat, exact repeat", lambda i: chat_body, "/v1/chat/completions")
        case("chat, next turn", lambda i: orjson.dumps(chat(0, f"And {next(count)} more?")),
             "/v1/chat/completions")
        case("ids, exact repeat", lambda i: ids_body, "/v1/completions")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=76)
    p.add_argument("--output-lengths", default="",
                   help="comma-separated output lengths: measure only the output path a token")
    p.add_argument("--long", action="store_true",
                   help="a --prompt-tokens prompt as chat text and as token ids, and its TTFT")
    p.add_argument("overrides", nargs="*", help="serve overrides (model.path=... a tokenizer)")
    args = p.parse_args()
    cfg = make_config("scheduler.max_batch=128", "admission.max_queue=512",
                      f"model.cache_dir={Path(tempfile.gettempdir()) / 'pipeserve-host-cost'}",
                      *args.overrides)
    model = tokenizer_side(cfg)   # room for the prompt whatever the model's own context
    model = replace(model, max_context=max(model.max_context, 2 * args.prompt_tokens + 1024))
    proc = InProcess(cfg, model)
    try:
        app = next(a for a in __import__("sanic").Sanic._app_registry.values()
                   if a.ctx.front is not None)
        if args.long:
            rows = long_prompt(app, proc, args.requests, args.prompt_tokens)
        elif args.output_lengths:
            lengths = [int(n) for n in args.output_lengths.split(",")]
            rows = output_cost(app, proc.loop, lengths)
        else:
            rows = measure(app, proc.loop, args.requests, args.tokens, args.prompt_tokens)
    finally:
        proc.close()
    for name, us in rows.items():
        print(f"| {name} | {us:,.1f} |")


if __name__ == "__main__":
    main()
