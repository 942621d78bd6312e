"""Remote images (server.allow_remote_media=true): one http(s) GET with a wall-clock and byte
cap, no redirects followed, and the host's every address checked first — loopback, private,
link-local, multicast and reserved addresses are refused unless server.allow_private_media.
Blocking: runs on the preparation pool, never on the event loop. No MLX."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import InvalidRequest


def fetch(url: str, where: str, limits: Any) -> bytes:
    if not limits.allow_remote:
        raise InvalidRequest(f"{where} is a remote image URL; this server takes images as data: "
                             "URLs only (server.allow_remote_media=false)", param=where)
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        raise InvalidRequest(f"{where} has no host in its URL", param=where)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidRequest(f"{where}: host {host!r} does not resolve ({e})", param=where) from e
    addresses = {info[4][0] for info in infos}
    if not limits.allow_private:
        for addr in addresses:
            ip = ipaddress.ip_address(addr.split("%")[0])
            if not ip.is_global or ip.is_multicast:
                raise InvalidRequest(
                    f"{where}: host {host!r} resolves to {addr}, a loopback, private or "
                    "link-local address; remote images come only from public hosts "
                    "(server.allow_private_media=false)", param=where)
    deadline = time.monotonic() + limits.fetch_timeout_s
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=limits.fetch_timeout_s)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"User-Agent": "pipeserve", "Accept": "image/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise InvalidRequest(f"{where}: fetching the image answered HTTP {resp.status} "
                                 "(redirects are not followed)", param=where)
        chunks, total = [], 0
        while True:
            if time.monotonic() > deadline:
                raise InvalidRequest(f"{where}: fetching the image took longer than "
                                     f"{limits.fetch_timeout_s} s (server.media_fetch_timeout_s)",
                                     param=where)
            chunk = resp.read1(65536)   # what has arrived: the deadline bounds a slow sender
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > limits.max_image_bytes:
                raise InvalidRequest(f"{where}: the remote image is larger than "
                                     f"{limits.max_image_bytes} bytes (server.max_image_mb)",
                                     param=where)
            chunks.append(chunk)
    except (OSError, http.client.HTTPException) as e:
        raise InvalidRequest(f"{where}: fetching the image failed ({type(e).__name__}: "
                             f"{str(e)[:160]})", param=where) from e
    finally:
        conn.close()
