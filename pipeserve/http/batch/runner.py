"""BatchRunner: runs each open batch's lines through the server's own endpoints, over HTTP to
the server itself, so a line is answered by the handler a live request gets (validation,
admission, generation, the response body) and nothing else. Lines go at the least urgent
priority class (the `x-pipeserve-priority` header; a line's own `priority` wins), at most
`server.batch_concurrency` of them are in flight across all batches, and one is sent only
while the engine has a row to spare (nothing queues, and one row stays free for a live
request), so live requests keep the engine's rows and their place at the head of the queue. A 429 or 503 (queue full, loading, draining) is retried after its
Retry-After. Event loop; disk I/O on threads."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable

import httpx
import orjson

from pipeserve.http.batch import lines as L
from pipeserve.http.batch.files import FileStore
from pipeserve.http.batch.store import OPEN, BatchStore

log = logging.getLogger("pipeserve")
# httpx logs every request at INFO: the lines' own request log lines say it all already
logging.getLogger("httpx").setLevel(logging.WARNING)
RETRY_S = 5.0   # the longest wait before a refused (429, 503) line is sent again
IDLE_POLL_S = 0.05   # how often a held line looks again for room in the engine


class BatchRunner:
    def __init__(self, files: FileStore, store: BatchStore, base_url: str,
                 headers: dict[str, str], concurrency: int,
                 room: Callable[[int], bool] | None = None) -> None:
        self.files, self.store = files, store
        self.room = room   # whether the engine has a row to spare, given the lines in flight
        self.inflight = 0
        self.base_url, self.headers = base_url, headers
        self.slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.cancelling: set[str] = set()
        self.locks: dict[str, asyncio.Lock] = {}
        self.client: httpx.AsyncClient | None = None

    def start(self, batch_id: str) -> None:
        if batch_id not in self.tasks:
            self.tasks[batch_id] = asyncio.create_task(self._run(batch_id))

    async def resume(self, serves: Callable[[list[str]], bool]) -> None:
        """Pick up every batch a previous run left open, unless its lines went to a model this
        server does not serve (another server on the same directory created it)."""
        for batch in await asyncio.to_thread(self.store.list):
            if not serves(batch.get("_models", [])):
                log.info("batch %s: its lines go to %s, not served here; left open for the "
                         "server that serves it", batch["id"], ", ".join(batch["_models"]))
            elif batch["status"] == "cancelling":
                await self._cancelled(batch["id"])
            elif batch["status"] in OPEN:
                log.info("batch %s: resuming (%s)", batch["id"], batch["status"])
                self.start(batch["id"])

    async def cancel(self, batch_id: str) -> None:
        """Stop sending lines, stop those in flight, and finish as cancelled with what is done."""
        task = self.tasks.get(batch_id)
        if task is None:   # not running here: ended here unless another server runs it
            await self._cancelled(batch_id)
            return
        self.cancelling.add(batch_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Server stop: the batches stay open on disk, to go on after the restart."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    async def _run(self, batch_id: str) -> None:
        claim = None
        try:
            claim = await asyncio.to_thread(self.store.claim, batch_id)
            if claim is None:
                log.info("batch %s: another server on server.files_dir runs it", batch_id)
                return
            await self._lines(batch_id)
        except asyncio.CancelledError:
            if batch_id in self.cancelling:
                await self._finish_cancelled(batch_id)
        except Exception as e:   # a fault of this batch only: it fails, the server serves on
            log.exception("batch %s failed", batch_id)
            batch = await asyncio.to_thread(self.store.get, batch_id)
            batch["errors"] = {"object": "list", "data": [
                {"code": "server_error", "message": f"{type(e).__name__}: {e}"[:500],
                 "param": None, "line": None}]}
            await self._finish(batch, "failed", {})
        finally:
            if claim is not None:
                claim.close()
            self.tasks.pop(batch_id, None)
            self.locks.pop(batch_id, None)
            self.cancelling.discard(batch_id)

    async def _lines(self, batch_id: str) -> None:
        """Send every line not finished yet; then write the output and error files."""
        batch = await asyncio.to_thread(self.store.get, batch_id)
        data = await asyncio.to_thread(self.files.content, batch["input_file_id"])
        if data is None:
            raise RuntimeError(f"the input file {batch['input_file_id']} was deleted")
        todo = await asyncio.to_thread(L.parse, data, batch["endpoint"])
        done = await asyncio.to_thread(self.store.results, batch_id)
        if batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            await asyncio.to_thread(self.store.save, batch)
        left = [line for line in todo if line.index not in done]
        tasks: set[asyncio.Task[None]] = set()
        try:
            for line in left:
                await self.slots.acquire()
                await self._room()
                if time.time() >= batch["expires_at"]:
                    self.slots.release()
                    break
                task = asyncio.create_task(self._one(batch, line))
                tasks.add(task)
                self.inflight += 1   # counted now: the task has not reached the engine yet
                task.add_done_callback(lambda t: self._done(tasks, t))
            await asyncio.gather(*tasks)
        finally:   # cancelled: the lines in flight stop (their requests are aborted)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        done = await asyncio.to_thread(self.store.results, batch_id)
        expired = len(done) < len(todo)
        await self._finish(batch, "expired" if expired else "completed", done, todo)

    async def _cancelled(self, batch_id: str) -> None:
        """End as cancelled a batch no task of this server runs, if no other server does."""
        claim = await asyncio.to_thread(self.store.claim, batch_id)
        if claim is None:
            return
        try:
            await self._finish_cancelled(batch_id)
        finally:
            claim.close()

    async def _finish_cancelled(self, batch_id: str) -> None:
        batch = await asyncio.to_thread(self.store.get, batch_id)
        done = await asyncio.to_thread(self.store.results, batch_id)
        await self._finish(batch, "cancelled", done)

    def _done(self, tasks: set[asyncio.Task[None]], task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        self.inflight -= 1
        self.slots.release()

    async def _room(self) -> None:
        """Wait until the engine has a row to spare (`room`): batch lines fill idle capacity
        only."""
        while self.room is not None and not self.room(self.inflight):
            await asyncio.sleep(IDLE_POLL_S)

    async def _one(self, batch: dict[str, Any], line: L.Line) -> None:
        """One line: sent, and its result stored and counted."""
        if line.body is None:
            ok, out = False, L.error_line(line, line.code or "invalid_request", line.message or "")
        else:
            status, rid, body = await self._send(batch["endpoint"], line.body)
            ok, out = 200 <= status < 300, L.response_line(line, status, rid, body)
        async with self.locks.setdefault(batch["id"], asyncio.Lock()):
            await asyncio.to_thread(self.store.append, batch["id"], line.index, ok, out)
            batch["request_counts"]["completed" if ok else "failed"] += 1
            await asyncio.to_thread(self.store.save, batch)

    async def _send(self, url: str, body: dict[str, Any]) -> tuple[int, str, Any]:
        """POST the body to this server; a refusal a retry can cure (429, 503) waits and
        goes again. The status, a request id and the JSON body the client would have got."""
        if self.client is None:
            self.client = httpx.AsyncClient(
                base_url=self.base_url, headers=self.headers, timeout=None,
                limits=httpx.Limits(max_connections=self.concurrency + 1))
        payload = orjson.dumps(body)
        while True:
            try:
                r = await self.client.post(url, content=payload,
                                           headers={"content-type": "application/json"})
            except httpx.TransportError:   # the listener is not up yet, or going down
                await asyncio.sleep(RETRY_S)
                continue
            if r.status_code not in (429, 503):
                break
            await asyncio.sleep(min(RETRY_S, float(r.headers.get("retry-after", 1) or 1)))
        try:
            answer = r.json()
        except ValueError:
            answer = {"error": {"message": r.text[:1000], "type": "server_error"}}
        # the id the server's request log line names (chatcmpl-…, resp_…), when the body has one
        rid = answer.get("id") if isinstance(answer, dict) and not answer.get("error") else None
        return r.status_code, rid or f"req_{uuid.uuid4().hex}", answer

    async def _finish(self, batch: dict[str, Any], status: str,
                      done: dict[int, tuple[bool, dict[str, Any]]],
                      todo: list[L.Line] | None = None) -> None:
        """Write the output file (answered lines, in input order) and the error file (the
        others; lines an expired batch never sent, as `batch_expired`), then the end state."""
        now = int(time.time())
        if status != "failed":
            batch.update(status="finalizing", finalizing_at=now)
            await asyncio.to_thread(self.store.save, batch)
        outs = [done[i][1] for i in sorted(done) if done[i][0]]
        errs = [done[i][1] for i in sorted(done) if not done[i][0]]
        if status == "expired":
            errs += [L.error_line(x, "batch_expired", "the batch expired before this line "
                                  "ran") for x in todo or [] if x.index not in done]
        name = batch["id"]
        for key, rows, suffix in (("output_file_id", outs, "output"), ("error_file_id", errs,
                                                                       "errors")):
            if rows:
                data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
                made = await asyncio.to_thread(self.files.create, data,
                                               f"{name}_{suffix}.jsonl", "batch_output")
                batch[key] = made["id"]
        batch["request_counts"] = {"total": batch["request_counts"]["total"],
                                   "completed": len(outs), "failed": len(errs)}
        batch["usage"] = L.usage(outs)
        batch.update(status=status, **{f"{status}_at": int(time.time())})
        await asyncio.to_thread(self.store.save, batch)
        log.info("batch %s %s: %d completed, %d failed", name, status, len(outs), len(errs))
