"""The engine process's channels, measured: one engine step's output message (every row's new
token, pipeserve/pool/codec.py's columnar encoding) sent from a child process to this one over
a multiprocessing pipe or a ZeroMQ PAIR socket (pyzmq, when importable), and a submit → first
step round trip. Prints one table row per (transport, rows). Usage:

    python scripts/transport_probe.py [--steps 3000] [--rows 1,32,128]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

from pipeserve.core.events import TokenDelta
from pipeserve.pool import codec

SPAWN = mp.get_context("spawn")


def step(rows: int, k: int) -> bytes:
    events = [TokenDelta(f"chatcmpl-{i:024x}", [1000 + i + k]) for i in range(rows)]
    return codec.dumps(codec.encode_step(events, 0, rows))


def _pipe_child(conn: Any, rows: int, steps: int) -> None:
    conn.recv_bytes()   # go
    for k in range(steps):
        conn.send_bytes(step(rows, k))
    for _ in range(200):   # round trips: a submit in, one step out
        conn.recv_bytes()
        conn.send_bytes(step(1, 0))


def _zmq_child(addr: str, rows: int, steps: int) -> None:
    import zmq
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(addr)
    sock.recv()
    for k in range(steps):
        sock.send(step(rows, k), copy=False)
    for _ in range(200):
        sock.recv()
        sock.send(step(1, 0))


def _drain(recv: Any, send: Any, steps: int) -> tuple[float, float]:
    submit = codec.dumps({"op": "submit", "req": {"prompt": list(range(76))}})
    send(submit)
    t0 = time.perf_counter()
    for _ in range(steps):
        codec.decode_step(codec.loads(recv()))
    rate = steps / (time.perf_counter() - t0)
    trips = []
    for _ in range(200):
        t1 = time.perf_counter()
        send(submit)
        codec.decode_step(codec.loads(recv()))
        trips.append(time.perf_counter() - t1)
    return rate, statistics.median(trips) * 1e6


def over_pipe(rows: int, steps: int) -> tuple[float, float]:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_pipe_child, args=(child, rows, steps), daemon=True)
    proc.start()
    try:
        return _drain(parent.recv_bytes, parent.send_bytes, steps)
    finally:
        proc.join(30)


def over_zmq(rows: int, steps: int) -> tuple[float, float]:
    import tempfile

    import zmq
    sock = zmq.Context.instance().socket(zmq.PAIR)
    addr = f"ipc://{tempfile.mkdtemp()}/engine"
    sock.bind(addr)
    proc = SPAWN.Process(target=_zmq_child, args=(addr, rows, steps), daemon=True)
    proc.start()
    try:
        return _drain(sock.recv, sock.send, steps)
    finally:
        proc.join(30)
        sock.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rows", default="1,32,128")
    args = ap.parse_args()
    transports = {"pipe": over_pipe}
    try:
        import zmq  # noqa: F401
        transports["zmq"] = over_zmq
    except ImportError:
        print("pyzmq is not installed: the pipe only")
    print("| transport | rows | bytes/step | steps/s | tokens/s | round trip p50 (us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, run in transports.items():
            rate, trip = run(rows, args.steps)
            print(f"| {name} | {rows} | {len(step(rows, 0))} | {rate:,.0f} | "
                  f"{rate * rows:,.0f} | {trip:.0f} |", flush=True)


if __name__ == "__main__":
    main()
