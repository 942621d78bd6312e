"""The API and admin keys: which key a request presented and whether it is the right one.
Event loop."""
from __future__ import annotations

import hashlib
import hmac

import sanic
from sanic import Sanic

from pipeserve.errors import Unauthorized


def presented_key(http: sanic.Request) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>` or `x-api-key` (Anthropic)."""
    auth = http.headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else http.headers.get("x-api-key")


def key_ok(http: sanic.Request, key: str) -> bool:
    """Constant time: digests of equal length compared with hmac.compare_digest, so neither
    a right prefix nor the key's length shows in the timing."""
    presented = presented_key(http)
    if presented is None:
        return False
    return hmac.compare_digest(hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest(),
                               hashlib.sha256(key.encode("utf-8")).digest())


def require_admin(app: Sanic, http: sanic.Request) -> None:
    """Admin routes (cache flush, adapter mount/unmount) take server.admin_key; when only
    server.api_key is set, they take that (never open while the API is guarded)."""
    server = app.ctx.cfg.server
    name = "admin_key" if server.admin_key else "api_key"
    key = getattr(server, name)
    if key and not key_ok(http, key):
        raise Unauthorized(f"invalid or missing {name.replace('_', ' ')}; send "
                           f"Authorization: Bearer <server.{name}>")
