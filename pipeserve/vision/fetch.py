"""Remote images (media.allow_remote_media=true): one http(s) GET with a wall-clock and byte
cap, no redirects followed, and the host's every address checked first — loopback, private,
link-local, multicast and reserved addresses are refused unless media.allow_private_media.
Blocking: runs on the preparation pool, never on the event loop. No MLX."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from pipeserve.errors import InvalidRequest


def fetch(url: str, where: str, limits: Any, what: str = "image", max_bytes: int | None = None,
          key: str = "media.max_image_mb") -> bytes:
    """The URL's body; `what` (image, video) names it in errors, `max_bytes` (server `key`)
    caps it (default: limits.max_image_bytes)."""
    cap = limits.max_image_bytes if max_bytes is None else max_bytes
    if not limits.allow_remote:
        raise InvalidRequest(f"{where} is a remote {what} URL; this server takes {what}s as "
                             "data: URLs only (media.allow_remote_media=false)", param=where)
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
                    "link-local address; remote media come only from public hosts "
                    "(media.allow_private_media=false)", param=where)
    deadline = time.monotonic() + limits.fetch_timeout_s
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=limits.fetch_timeout_s)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"User-Agent": "pipeserve", "Accept": f"{what}/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise InvalidRequest(f"{where}: fetching the {what} answered HTTP {resp.status} "
                                 "(redirects are not followed)", param=where)
        chunks, total = [], 0
        while True:
            if time.monotonic() > deadline:
                raise InvalidRequest(f"{where}: fetching the {what} took longer than "
                                     f"{limits.fetch_timeout_s} s (media.media_fetch_timeout_s)",
                                     param=where)
            chunk = resp.read1(65536)   # what has arrived: the deadline bounds a slow sender
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > cap:
                raise InvalidRequest(f"{where}: the remote {what} is larger than {cap} bytes "
                                     f"({key})", param=where)
            chunks.append(chunk)
    except (OSError, http.client.HTTPException) as e:
        raise InvalidRequest(f"{where}: fetching the {what} failed ({type(e).__name__}: "
                             f"{str(e)[:160]})", param=where) from e
    finally:
        conn.close()
