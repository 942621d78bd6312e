"""A background response's task, cancelled the moment it is registered, ends stored as
cancelled: a task that is cancelled before its first step runs none of its code, so its
handlers never store anything. (A restart's cancel raced the resume this way: the response
stayed "in_progress".) The HTTP side in-process, against a scripted engine."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pipeserve.http.api import responses_background
from tests.conftest import make_config
from tests.http.scripted import InProcess, Reply, tokenizer_side


def test_a_task_cancelled_as_soon_as_it_is_registered_is_stored_cancelled(
        tmp_path: Path) -> None:
    cfg = make_config(f"model.cache_dir={tmp_path / 'models'}",
                      f"server.files_dir={tmp_path / 'files'}")
    setup = InProcess(cfg, tokenizer_side(cfg))
    try:
        async def scenario(client):
            app = client._transport.app   # the app InProcess serves over ASGI
            running = app.ctx.background
            create = asyncio.ensure_future(client.post("/v1/responses", json={
                "model": "tiny", "input": "Tell me a story.", "max_output_tokens": 64,
                "background": True}))
            for _ in range(100_000):   # every loop turn, as a poller sees it (bounded)
                if running:
                    break
                await asyncio.sleep(0)
            assert running, (await create).text
            rid = next(iter(running))
            cancelled = await responses_background.cancel(app, rid)   # what POST .../cancel runs
            created = await create
            assert created.status_code == 200 and created.json()["id"] == rid
            polled = await client.get(f"/v1/responses/{rid}")
            return cancelled, polled.json()

        (cancelled, polled), _ = setup.run(
            scenario, script=lambda _req: Reply(text="once upon a time " * 16))
        assert json.loads(cancelled.body)["status"] == "cancelled"
        assert polled["status"] == "cancelled"
    finally:
        setup.close()
