"""The engine process's pipe writer (pipeserve/pool/child.py Sender) over a real multiprocessing
pipe: a parent that reads nothing never holds a sender (the engine thread) up, and the parent
reads every message whole and in the order each thread sent it."""
from __future__ import annotations

import threading

from pipeserve.pool import child, codec
from pipeserve.pool.proxy import SPAWN


def _read_all(conn, n: int) -> list[dict]:
    return [codec.loads(conn.recv_bytes()) for _ in range(n)]


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


def test_small_messages_do_not_overtake_a_big_one_sent_before_them() -> None:
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    sender.send({"op": "ev", "i": 0, "pad": "x" * 3_000_000})
    for i in range(1, 20):
        sender.send({"op": "ev", "i": i})
    assert [m["i"] for m in _read_all(parent, 20)] == list(range(20))
    sender.close()


def test_a_parent_that_is_gone_fails_no_send() -> None:
    parent, child_end = SPAWN.Pipe()
    sender = child.Sender(child_end)
    parent.close()
    for i in range(5):
        sender.send({"op": "ev", "i": i})
    sender.send({"op": "reply", "pad": "x" * 3_000_000})
    sender.close()
