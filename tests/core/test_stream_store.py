"""The resumable-stream store without a server: frames are numbered, the byte cap drops
ended streams oldest first and then only frames every connected reader has sent, ended
streams expire after stream_resume_s, and the gauges follow."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from pipeserve.http.api.resume import StreamStore
from pipeserve.metrics import Metrics


class Sink:
    def __init__(self) -> None:
        self.data = b""

    async def send(self, data: bytes) -> None:
        self.data += data


def frame(i: int) -> bytes:
    return b"data: " + b"x" * 90 + b"%03d\n\n" % i   # 100 bytes + the id line


def test_numbering_cap_and_expiry() -> None:
    async def run() -> None:
        metrics = Metrics(CollectorRegistry())
        store = StreamStore(resume_s=0.2, cap_bytes=1500, metrics=metrics)
        old = store.open("old", resumable=False)
        for i in range(5):
            old.append(frame(i))
        assert old.frames[0].startswith(b"id: 0\n") and old.frames[4].startswith(b"id: 4\n")
        old.end()
        live = store.open("live", resumable=True)
        for i in range(5):
            live.append(frame(i))
        assert "old" in store.logs   # 10 frames fit the cap
        for i in range(5, 10):
            live.append(frame(i))
        assert "old" not in store.logs   # the ended stream went first
        assert metrics.stream_evictions._value.get() == 1
        # a live stream nobody reads keeps every frame (it is its only copy)
        assert live.first == 0 and live.num_frames == 10
        # a reader that has sent everything lets the cap drop what it sent
        sink = Sink()
        reader = asyncio.get_running_loop().create_task(live.follow(sink, -1, 10.0))
        await asyncio.sleep(0.01)
        for i in range(10, 16):   # past the cap again: the 10 frames the reader sent go
            live.append(frame(i))
        await asyncio.sleep(0.01)
        assert live.first == 10 and store.nbytes <= 1500
        ids = [int(line[4:]) for line in sink.data.split(b"\n") if line.startswith(b"id: ")]
        assert ids == list(range(16))   # the reader got every frame, in order
        live.end()
        await reader
        assert metrics.stream_bytes._value.get() == store.nbytes
        await asyncio.sleep(0.3)   # past stream_resume_s: the ended stream is gone
        assert not store.logs and metrics.stream_logs._value.get() == 0
    asyncio.run(run())


def test_a_plain_stream_left_by_its_reader_is_cancelled_a_resumable_one_waits() -> None:
    async def run() -> None:
        store = StreamStore(resume_s=0.2, cap_bytes=1 << 20, metrics=Metrics(CollectorRegistry()))
        for resumable in (False, True):
            log = store.open(f"s{resumable}", resumable)
            log.task = asyncio.get_running_loop().create_task(asyncio.sleep(5))
            reader = asyncio.get_running_loop().create_task(log.follow(Sink(), -1, 10.0))
            await asyncio.sleep(0.01)
            reader.cancel()   # the client left
            await asyncio.gather(reader, return_exceptions=True)
            await asyncio.sleep(0.05)
            assert log.task.cancelled() is (not resumable)
            if resumable:
                await asyncio.sleep(0.25)   # nobody came back within stream_resume_s
                assert log.task.cancelled()
    asyncio.run(run())
