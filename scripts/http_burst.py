"""A burst of streaming chat requests against a running server, all sent at once: when each
one's first content token arrived (seconds after the first request left), and when the burst
ended. The user message is grown until the rendered prompt has --prompt-tokens tokens (through
POST /tokenize); every request carries a logit_bias, as the GPU benchmarks' requests do.

    python scripts/http_burst.py --url http://127.0.0.1:8080 --n 128 --reps 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
import orjson

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()


async def calibrate(session: aiohttp.ClientSession, url: str, model: str, want: int) -> str:
    """A user message whose chat prompt renders to about `want` tokens."""
    text, count = "", 0
    for i in range(4 * want):
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        async with session.post(f"{url}/tokenize", json=body) as r:
            count = (await r.json())["count"]
        if count >= want:
            return text
        text += ("" if not text else " ") + WORDS[i % len(WORDS)]
    return text


async def one(session: aiohttp.ClientSession, url: str, body: bytes, t0: float) -> tuple[float, float, int]:
    """(first content token, end) in seconds after t0, and the content chunks counted."""
    first, chunks = None, 0
    async with session.post(f"{url}/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            delta = orjson.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0, chunks


async def main(args: argparse.Namespace) -> None:
    conn = aiohttp.TCPConnector(limit=args.n + 4)
    async with aiohttp.ClientSession(connector=conn) as session:
        text = await calibrate(session, args.url, args.model, args.prompt_tokens)
        for rep in range(args.reps):
            bodies = [orjson.dumps({
                "model": args.model, "stream": True, "max_tokens": args.max_tokens,
                "temperature": 0, "logit_bias": {"7": -100, str(11 + i % 50): 1},
                "messages": [{"role": "user", "content": f"{i} {rep} {text}"}]})
                for i in range(args.n)]
            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(session, args.url, b, t0) for b in bodies))
            firsts = sorted(g[0] for g in got)
            ends = [g[1] for g in got]
            print(f"rep {rep}: n {args.n} first token min {firsts[0]:.3f} p50 "
                  f"{statistics.median(firsts):.3f} max {firsts[-1]:.3f} s; all done "
                  f"{max(ends):.3f} s; content chunks {sum(g[2] for g in got)}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="tiny")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=76)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    asyncio.run(main(p.parse_args()))
