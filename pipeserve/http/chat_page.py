"""GET /: the browser chat page (one self-contained HTML file in the package: no build step, no
CDN). It talks to /v1/models and /v1/chat/completions like any client, so it needs no route of
its own beyond serving the file. `server.chat_page=false` answers GET / with a 404."""
from __future__ import annotations

from importlib.resources import files

import sanic
from sanic.exceptions import NotFound
from sanic import HTTPResponse, Sanic

PAGE = files("pipeserve.http").joinpath("static/chat.html")
ICON = files("pipeserve.http").joinpath("static/favicon.svg")


def add_chat_page(app: Sanic, enabled: bool) -> None:
    if not enabled:   # GET / is a 404, as any unknown path (HEAD / stays: agents probe it)
        @app.get("/", name="no_chat_page")
        async def no_page(http: sanic.Request) -> HTTPResponse:
            raise NotFound("the chat page is off (server.chat_page=false)")
        return
    body = PAGE.read_bytes()   # read once at startup; a few KB
    icon = ICON.read_bytes()

    @app.get("/favicon.svg")
    @app.get("/favicon.ico", name="favicon_ico")   # browsers ask for it without a <link>
    async def favicon(http: sanic.Request) -> HTTPResponse:
        return HTTPResponse(icon, content_type="image/svg+xml",
                            headers={"Cache-Control": "max-age=86400"})

    @app.get("/")
    async def chat_page(http: sanic.Request) -> HTTPResponse:
        return HTTPResponse(body, content_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "Content-Security-Policy": "default-src 'self'; "
                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                     # never framed by another site (clickjacking)
                                     "frame-ancestors 'none'",
                                     "X-Frame-Options": "DENY"})
