"""The engine process's pipe writer (pipeserve/pool/child.py Sender) over a real multiprocessing
pipe: a step's message is on the pipe when the engine thread's send returns, a parent that reads
nothing never holds a sender up, and whatever the path each message took, the parent reads every
one whole and in the order it was sent."""
from __future__ import annotations

import threading

from pipeserve.pool import child, codec
from pipeserve.pool.proxy import SPAWN


def _read_all(conn, n: int) -> list[dict]:
    return [codec.loads(conn.recv_bytes()) for _ in range(n)]


def test_a_step_message_is_readable_when_send_returns() -> None:
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    for i in range(50):
        sender.send({"op": "ev", "i": i})
        assert parent.poll(0), f"message {i} was not on the pipe when send returned"
        assert codec.loads(parent.recv_bytes()) == {"op": "ev", "i": i}
    sender.close()


def test_a_parent_reading_nothing_holds_no_sender_up_and_loses_nothing() -> None:
    """Far more than the pipe holds (small steps, 200 kB messages, a 2 MB reply past the direct
    size), sent from three threads while the parent reads nothing: every send returns, then the
    parent reads each thread's messages whole and in its order."""
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    sizes = {"engine": 0, "main": 200_000, "grammar": 2_000_000}
    counts = {"engine": 400, "main": 30, "grammar": 3}

    def send(name: str) -> None:
        for i in range(counts[name]):
            sender.send({"op": "ev", "who": name, "i": i, "pad": "x" * sizes[name]})
    threads = [threading.Thread(target=send, args=(name,)) for name in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = _read_all(parent, sum(counts.values()))
    for name, n in counts.items():
        mine = [m for m in got if m["who"] == name]
        assert [m["i"] for m in mine] == list(range(n))
        assert all(len(m["pad"]) == sizes[name] for m in mine)
    sender.close()
    assert not parent.poll(0)


def test_one_thread_sees_its_order_kept_across_the_queue_and_the_direct_path() -> None:
    """A big message queues behind the pipe's room; the small ones after it must not overtake
    it, and once the parent has read the backlog, sends go out directly again."""
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    sender.send({"op": "ev", "i": 0, "pad": "x" * 3_000_000})
    for i in range(1, 20):
        sender.send({"op": "ev", "i": i})
    assert [m["i"] for m in _read_all(parent, 20)] == list(range(20))
    sender.close()   # the thread has written the backlog: direct writes are open again
    sender2 = child.Sender(child_end)
    sender2.send({"op": "ev", "i": 20})
    assert parent.poll(0) and codec.loads(parent.recv_bytes())["i"] == 20
    sender2.close()


def test_a_parent_that_is_gone_fails_no_send() -> None:
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    parent.close()
    for i in range(5):
        sender.send({"op": "ev", "i": i})
    sender.send({"op": "reply", "pad": "x" * 3_000_000})
    sender.close()
