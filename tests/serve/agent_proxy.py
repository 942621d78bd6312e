"""A recording reverse proxy between a coding agent's CLI and a real pipeserve: every request
passes through unchanged (bodies, headers, SSE streamed chunk by chunk) and is kept as
(method, path, status, request JSON) so a test can assert what the agent sent and what it got."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
       "content-encoding", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    body: Any            # the request's JSON (None when it had none or it was not JSON)
    response: bytes      # the response body as the client got it


class Proxy:
    """Listens on 127.0.0.1:<free port>, forwards to `upstream`; `exchanges` in arrival order."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def since(self, start: int) -> list[Exchange]:
        with self._lock:
            return self.exchanges[start:]

    def _record(self, ex: Exchange) -> None:
        with self._lock:
            self.exchanges.append(ex)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"   # the body ends when the connection closes

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                chunks: list[bytes] = []
                with httpx.Client(timeout=httpx.Timeout(1800, connect=10)) as client:
                    with client.stream(self.command, proxy.upstream + self.path,
                                       headers=headers, content=raw) as r:
                        self.send_response(r.status_code)
                        for k, v in r.headers.items():
                            if k.lower() not in HOP:
                                self.send_header(k, v)
                        self.send_header("connection", "close")
                        self.end_headers()
                        for chunk in r.iter_raw():
                            chunks.append(chunk)
                            try:
                                self.wfile.write(chunk)
                                self.wfile.flush()
                            except OSError:   # the client went away: record what it got
                                break
                proxy._record(Exchange(self.command, self.path, r.status_code, body,
                                       b"".join(chunks)))

            do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = _forward

        return Handler
