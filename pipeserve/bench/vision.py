"""bench.workload=vision: N client streams, each sending chat requests with its own image, against
pipeserve serving a vision-language model (its image rows batched continuously), beside
mlx-vlm's own generate on the same model directory and images (one request at a time, as
mlx_vlm.generate runs). Rows in bench.py's table. Called by bench.py's run_bench."""
from __future__ import annotations

import asyncio
import base64
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from pipeserve.bench.server import ROOT, Process, _free_port, _peak_rss_mb
from pipeserve.bench.tables import _row
from pipeserve.bench.workload import _session

QUESTION = "Describe this picture in detail."


def images(n: int, size: tuple[int, int] = (224, 224)) -> list[bytes]:
    """n different deterministic PNGs (smooth colour fields: cheap to decode, unlike noise)."""
    import numpy as np
    from PIL import Image

    out = []
    for i in range(n):
        y, x = np.mgrid[0:size[1], 0:size[0]]
        rgb = np.stack([(x * (i + 1)) % 256, (y * (i + 3)) % 256, ((x + y) * (i + 5)) % 256], -1)
        buf = io.BytesIO()
        Image.fromarray(rgb.astype("uint8")).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _message(image: bytes) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


async def _one(client: Any, url: str, model: str, image: bytes, max_tokens: int,
               eos_bias: dict[str, float]) -> dict[str, Any]:
    body = {"model": model, "messages": _message(image), "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": eos_bias}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    end = float("nan")
    async with client.post(url, data=orjson.dumps(body),
                           headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise SystemExit(f"bench: {url} answered {r.status}: {(await r.text())[:500]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                if ch.get("finish_reason"):
                    end = now
                elif (ch.get("delta") or {}).get("content") is not None:
                    stamps.append(now)
    return {"t0": t0, "stamps": stamps, "end": end,
            "tokens": usage.get("completion_tokens", len(stamps)),
            "prompt_tokens": usage.get("prompt_tokens")}


async def drive(base_url: str, model: str, b: Any, pictures: list[bytes],
                eos_bias: dict[str, float]) -> dict[str, Any]:
    url = f"{base_url}/v1/chat/completions"
    async with _session(b.streams, b.timeout_s) as client:
        if b.warmup:
            await _one(client, url, model, pictures[-1], 8, eos_bias)

        async def stream(k: int) -> list[dict[str, Any]]:
            return [await _one(client, url, model, pictures[k], b.max_tokens, eos_bias)
                    for _ in range(b.requests_per_stream)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(k) for k in range(b.streams)))
                   for r in rs]
        wall = time.perf_counter() - t0
    return _metrics(results, wall)


def _metrics(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The dict _row reads, from per-request stamps."""
    timed = [r for r in results if r["stamps"] and r["end"] == r["end"]]
    ttft = [r["stamps"][0] - r["t0"] for r in timed]
    span = (max(r["end"] for r in timed) - min(r["stamps"][0] for r in timed)) if timed else 0.0
    ptoks = [r["prompt_tokens"] for r in timed if r["prompt_tokens"] is not None]
    return {"requests": len(results), "errors": 0, "tokens": sum(r["tokens"] for r in results),
            "wall": wall, "ttft": ttft,
            "itl": [(y - x) * 1000 for r in timed for x, y in zip(r["stamps"], r["stamps"][1:])],
            "per_stream": [(r["tokens"] - 1) / (r["end"] - r["stamps"][0]) for r in timed
                           if r["end"] > r["stamps"][0]],
            "decode_agg": sum(r["tokens"] - 1 for r in timed) / span if span > 0 else float("nan"),
            "prompt_tokens": statistics.mean(ptoks) if ptoks else float("nan"),
            "prefill": statistics.mean(p / t for p, t in zip(ptoks, ttft)) if ptoks else float("nan")}


def mlx_vlm_generate(model_dir: Path, b: Any, pictures: list[bytes], eos: list[int]) -> dict[str, Any]:
    """mlx-vlm's own stream_generate, one request after another (what mlx_vlm.generate does)."""
    from mlx_vlm import load, stream_generate
    from PIL import Image

    model, processor = load(str(model_dir))
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    bias = {i: -100.0 for i in eos}

    def one(picture: bytes, max_tokens: int) -> dict[str, Any]:
        t0, stamps, prompt_tokens = time.perf_counter(), [], None
        for r in stream_generate(model, processor, prompt, image=[Image.open(io.BytesIO(picture))],
                                 max_tokens=max_tokens, temperature=0.0, logit_bias=bias):
            stamps.append(time.perf_counter())
            prompt_tokens = r.prompt_tokens
        stamps = stamps[:max_tokens]   # its loop yields one token past max_tokens
        return {"t0": t0, "stamps": stamps, "end": stamps[-1], "tokens": len(stamps),
                "prompt_tokens": prompt_tokens}
    if b.warmup:
        one(pictures[-1], 8)
    t0 = time.perf_counter()
    results = [one(pictures[k], b.max_tokens) for k in range(b.streams)
               for _ in range(b.requests_per_stream)]
    return _metrics(results, time.perf_counter() - t0)


def run(b: Any, model: str, overrides: list[str], model_dir: Path, out: Path,
        eos: list[int]) -> list[Any]:
    pictures = images(b.streams + 1)   # one per stream, and one for the warm-up
    eos_bias = {str(i): -100.0 for i in eos}
    port = _free_port()
    serve = [sys.executable, str(ROOT / "serve.py"), *overrides, f"model.path={model_dir}",
             f"model.name={model}", f"server.port={port}", "server.host=127.0.0.1",
             "server.max_body_mb=64", f"hydra.run.dir={out / 'serve-run'}"]
    ours = Process(serve, out / "pipeserve.log")
    rows = []
    try:
        ours.wait_http(f"http://127.0.0.1:{port}/health")
        m = asyncio.run(drive(f"http://127.0.0.1:{port}", model, b, pictures, eos_bias))
        rows.append(_row("pipeserve", b, m, _peak_rss_mb(ours.proc.pid),
                               " ".join(overrides)))
    finally:
        ours.stop()
    if b.mlx_lm:   # the peer: for this workload mlx-vlm's generate, in this process
        m = mlx_vlm_generate(model_dir, b, pictures, eos)
        rows.append(_row("mlx-vlm generate (serial)", b, m, float("nan"), " ".join(overrides)))
    return rows
