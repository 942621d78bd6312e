"""Load time and decode speed of Gemma 3 270M Q4_K_M: `serve.py model=gemma3` against
`mlx_lm.server` on the same converted directory (docs/gguf.md, "Speed").

    python scripts/gguf_speed.py pipeserve [TOKENS]
    python scripts/gguf_speed.py mlx [TOKENS]

Starts the server on 127.0.0.1, times process start -> ready and -> first streamed token of the
first request (mlx_lm.server loads the model on that request), then streams a second greedy
completion of TOKENS (128) tokens and reports its decode rate (tokens after the first over the
time they took). Stops the server it started. Needs the converted model in the model cache
(one launch of `serve.py model=gemma3` puts it there)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "The history of the city of Paris begins"


def wait(url: str, t0: float, proc: subprocess.Popen, limit_s: float = 600) -> float:
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("server not ready")


def stream(port: int, model: str, tokens: int) -> tuple[float, float, int, str]:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times: list[float] = []
    text = ""
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
                text += event["choices"][0]["text"]
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]), len(times), text


def main() -> None:
    from pipeserve.model.embedded import gemma3 as embedded_gemma3
    from pipeserve.model.cache import cache_root

    which = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    directory = cache_root(None) / embedded_gemma3.DIR_NAME
    port = 18400 + (which == "mlx")
    if which == "pipeserve":
        cmd = [sys.executable, "serve.py", "model=gemma3", f"server.port={port}",
               "hydra.run.dir=runs/gguf_speed"]
        health, model = f"http://127.0.0.1:{port}/health", "gemma3"
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(directory), "--port", str(port)]
        health, model = f"http://127.0.0.1:{port}/v1/models", str(directory)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = wait(health, t0, proc)
        cold_ttft, _, _, _ = stream(port, model, 8)
        ttft, rate, n, text = stream(port, model, tokens)
        print(json.dumps({"server": which, "ready_s": round(ready, 1),
                          "start_to_first_token_s": round(ready + cold_ttft, 1),
                          "warm_ttft_s": round(ttft, 2), "decode_tok_s": round(rate, 2),
                          "tokens": n, "text": text[:60]}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
