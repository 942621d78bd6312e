"""Remote images (media.allow_remote_media=true): one http(s) GET with a wall-clock and byte
cap, no redirects followed, and the host's every address checked first — loopback, private,
link-local, multicast and reserved addresses are refused unless media.allow_private_media —
then connected to as checked (the host is never resolved twice).
Blocking: runs on the preparation pool, never on the event loop. No MLX."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from pipeserve.errors import InvalidRequest


def fetch(url: str, where: str, limits: Any, what: str = "image", max_bytes: int | None = None,
          key: str = "media.max_image_mb") -> bytes:
    """The URL's body; `what` (image, video) names it in errors, `max_bytes` (server `key`)
    caps it (default: limits.max_image_bytes). The host is resolved once and the connection
    goes to an address that passed the check (a second lookup could answer otherwise: DNS
    rebinding); one deadline covers connect, headers and body."""
    cap = limits.max_image_bytes if max_bytes is None else max_bytes
    if not limits.allow_remote:
        raise InvalidRequest(f"{where} is a remote {what} URL; this server takes {what}s as "
                             "data: URLs only (media.allow_remote_media=false)", param=where)
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:   # a port out of range or not a number
        raise InvalidRequest(f"{where} has an invalid URL ({e})", param=where) from e
    if not host:
        raise InvalidRequest(f"{where} has no host in its URL", param=where)
    addresses = _checked_addresses(host, port, where, limits.allow_private)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=limits.fetch_timeout_s)
    # the TLS name stays the URL's host; only the address connected to is pinned
    conn._create_connection = lambda _addr, timeout, source=None: _connect(  # type: ignore
        addresses, port, timeout, source)
    cut = threading.Event()
    timer = threading.Timer(limits.fetch_timeout_s, _cut_off, (conn, cut))
    timer.daemon = True
    timer.start()
    try:
        return _get(conn, parts, where, what, cap, key, cut)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if cut.is_set():
            raise InvalidRequest(f"{where}: fetching the {what} took longer than "
                                 f"{limits.fetch_timeout_s} s (media.media_fetch_timeout_s)",
                                 param=where) from e
        raise InvalidRequest(f"{where}: fetching the {what} failed ({type(e).__name__}: "
                             f"{str(e)[:160]})", param=where) from e
    finally:
        timer.cancel()
        conn.close()


def _checked_addresses(host: str, port: int, where: str, allow_private: bool) -> list[str]:
    """Every address `host` resolves to, each checked (unless private hosts are allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OverflowError) as e:
        raise InvalidRequest(f"{where}: host {host!r} does not resolve ({e})", param=where) from e
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private:
        for addr in addresses:
            ip = ipaddress.ip_address(addr.split("%")[0])
            if not ip.is_global or ip.is_multicast:
                raise InvalidRequest(
                    f"{where}: host {host!r} resolves to {addr}, a loopback, private or "
                    "link-local address; remote media come only from public hosts "
                    "(media.allow_private_media=false)", param=where)
    return addresses


def _connect(addresses: list[str], port: int, timeout: Any, source: Any) -> socket.socket:
    """A connection to the first of the checked addresses that answers."""
    error: OSError | None = None
    for addr in addresses:
        try:
            return socket.create_connection((addr, port), timeout, source)
        except OSError as e:
            error = e
    assert error is not None
    raise error


def _cut_off(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    """The deadline passed: end the socket under a read that is still waiting (a sender
    trickling headers or body a byte at a time keeps each read under the socket timeout)."""
    cut.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _get(conn: http.client.HTTPConnection, parts: Any, where: str, what: str, cap: int,
         key: str, cut: threading.Event) -> bytes:
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn.request("GET", path, headers={"User-Agent": "pipeserve", "Accept": f"{what}/*"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise InvalidRequest(f"{where}: fetching the {what} answered HTTP {resp.status} "
                             "(redirects are not followed)", param=where)
    chunks, total = [], 0
    while chunk := resp.read1(65536):
        total += len(chunk)
        if total > cap:
            raise InvalidRequest(f"{where}: the remote {what} is larger than {cap} bytes "
                                 f"({key})", param=where)
        chunks.append(chunk)
    if cut.is_set():   # the end of the body may be the deadline's shutdown
        raise TimeoutError("the deadline passed")
    return b"".join(chunks)
