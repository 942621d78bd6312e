"""Shared by the media tests: a real HTTP server on 127.0.0.1 serving fixed responses (the
remote-URL fetch tests), a video encoder (PyAV), the "rows in one batch equal each alone"
check that must see the rows share a step, a JPEG and a PNG slow to decode for their size, and
the client side of a tiny_vlm server: a greedy
answer, its tokens' bytes, the reference's tokens spelt the same way, and a metric's value."""
from __future__ import annotations

import http.server
import io
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai

Route = tuple[int, dict[str, str], bytes]   # status, headers, body


@contextmanager
def local_server(routes: dict[str, Route]) -> Iterator[str]:
    """Serve `routes` (path -> response; any other path: the first route) on 127.0.0.1 until
    the block ends; yields the base URL."""
    first = next(iter(routes.values()))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, headers, body = routes.get(self.path, first)
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def encode_video(frames: int, fps: int, size: tuple[int, int] = (64, 48), *,
                 seed: int | None = None, codec: str = "libx264", fmt: str = "mp4",
                 rotation: int = 0) -> bytes:
    """A video of random frames (each its own picture, so sampling matters); `seed` defaults
    to one derived from frames and fps."""
    import av
    import numpy as np

    buf = io.BytesIO()
    rng = np.random.default_rng(frames * 100 + fps if seed is None else seed)
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        if rotation:
            s.set_display_rotation(rotation)
        for _ in range(frames):
            arr = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def assert_batched_equals_alone(run_round: Callable[[], list[Any]], alone: list[Any],
                                to_bytes: Callable[[Any], Any], rounds: int = 4) -> None:
    """Each concurrent round's answers equal each row's answer alone, and in at least one
    round the rows shared a step (arrival timing varies under load: up to `rounds` tries)."""
    for _ in range(rounds):
        batched = run_round()
        assert [to_bytes(r) for r in batched] == alone
        if max(r.usage.model_extra["pipeserve"]["batch_size"] for r in batched) > 1:
            return
    raise AssertionError(f"the rows never shared a step in {rounds} concurrent rounds")


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def async_client(server: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                              timeout=60)


def greedy(server: Any, messages: list[dict[str, Any]], max_tokens: int = 16) -> Any:
    return client(server).chat.completions.create(model="tiny_vlm", messages=messages,
                                                  max_tokens=max_tokens, temperature=0,
                                                  logprobs=True)


def served_bytes(resp: Any) -> list[list[int]]:
    return [list(t.bytes) for t in resp.choices[0].logprobs.content]


def token_bytes(tokenizer: Any, ids: list[int]) -> list[list[int]]:
    """Each token's bytes, as the OpenAI logprobs `bytes` field spells them (byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):   # GPT-2's byte <-> printable-character table
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return [[table[c] for c in tokenizer.convert_ids_to_tokens(i)] for i in ids]


def metric(server: Any, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each marker segment of a JPEG, a scan's entropy-coded data
    counted in its SOS segment."""
    i, out = 2, []
    while i < len(data) and data[i + 1] != 0xD9:
        end = i + 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
        if data[i + 1] == 0xDA:   # entropy-coded data runs to the next non-RST marker
            while data[end] != 0xFF or data[end + 1] == 0 or 0xD0 <= data[end + 1] <= 0xD7:
                end += 1
        out.append((data[i + 1], i, end))
        i = end
    return out


def scan_bomb_jpeg(size: tuple[int, int], copies: int) -> bytes:
    """A flat progressive JPEG whose smallest AC scan (23 bytes: one end-of-band run over every
    block) is repeated `copies` times; libjpeg walks all of the image's blocks for each copy,
    so decoding costs time in proportion to the copies, not to the bytes or pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (120, 60, 200)).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    scans = [s for s in _jpeg_segments(data) if s[0] == 0xDA]
    _, start, end = min(scans[1:], key=lambda s: s[2] - s[1])
    return data[:end] + data[start:end] * copies + data[end:]


def chunky_png(chunks: int) -> bytes:
    """A 64x64 PNG with `chunks` empty private chunks before its pixels (12 bytes each): Pillow
    reads every chunk header in Python before it reaches the size of the pixels it decodes."""
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 90)).save(buf, "PNG")
    png = buf.getvalue()
    header_end = 8 + 8 + 13 + 4   # signature, IHDR
    chunk = struct.pack(">I", 0) + b"prVt" + struct.pack(">I", zlib.crc32(b"prVt"))
    return png[:header_end] + chunk * chunks + png[header_end:]
