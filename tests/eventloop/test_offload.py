"""The media pool's threads (pipeserve/eventloop/offload.py): a refused preparation lets go of
what its frames held as soon as the refusal reaches the awaiting handler, not at the next
garbage collection (the GC is paused while media are prepared)."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.offload import MediaPool


class Held:
    """A large object a decoder's frames hold (a half-read image, its chunks)."""

    def __init__(self) -> None:
        self.pixels = bytearray(50_000_000)


def test_a_refused_preparation_frees_what_its_frames_held() -> None:
    refs: list[weakref.ref[Held]] = []

    def prepare() -> None:
        image = Held()
        refs.append(weakref.ref(image))
        raise InvalidRequest("messages[0].content[0]: refused", param="messages[0].content[0]")

    async def run() -> None:
        pool = MediaPool(workers=1, max_queue=1)
        with pytest.raises(InvalidRequest) as e:
            await pool.run(prepare)
        assert e.value.__traceback__ is not None   # the refusal keeps its traceback
        assert refs[0]() is None   # but not the frames' locals

    was = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(run())
    finally:
        if was:
            gc.enable()
