"""Does the host's work between steps overlap the device's? One decode loop shaped like the
engine's (build step N+1's graph, async_eval it, then read step N back and do X ms of host
Python), at B rows, for X = 0, 2, 4, 8 ms: if the step period stays at max(device, host) the
host work is hidden; if it grows by X, the device waits for the host. Also: whether
mx.async_eval releases the GIL (a counting thread's progress while it runs).
    python scripts/overlap_probe.py MODEL_DIR [ROWS...]"""
import json, sys, threading, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache

path, rows_list = sys.argv[1], [int(a) for a in sys.argv[2:]] or [1, 32]
model, _ = load(path)
vocab = model.args.vocab_size


def busy(ms):
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


count = [0, True]


def counter():
    while count[1]:
        count[0] += 1


for B in rows_list:
    for X in (0, 2, 4, 8):
        cache = [KVCache() for _ in model.layers]
        prompt = mx.random.randint(0, vocab, (B, 76))
        logits = model(prompt, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        t_ae = t_read = 0.0
        stamps = []
        for i in range(70):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            t0 = time.perf_counter()
            mx.async_eval(nxt)
            t1 = time.perf_counter()
            y.tolist()
            t2 = time.perf_counter()
            busy(X)
            if i >= 10:
                t_ae += t1 - t0
                t_read += t2 - t1
                stamps.append(t2)
            y = nxt
        n = len(stamps)
        period = (stamps[-1] - stamps[0]) / (n - 1)
        print(json.dumps({"rows": B, "host_ms": X, "period_ms": round(period * 1e3, 2),
                          "async_eval_ms": round(t_ae / n * 1e3, 2),
                          "read_wait_ms": round(t_read / n * 1e3, 2)}), flush=True)
    # GIL: a counting thread during async_eval vs during a GIL-free sleep of the same length
    cache = [KVCache() for _ in model.layers]
    y = mx.argmax(model(mx.random.randint(0, vocab, (B, 76)), cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    count[:] = [0, True]
    th = threading.Thread(target=counter, daemon=True)
    th.start()
    in_ae = in_sleep = 0
    t_ae = 0.0
    for i in range(30):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        c0, t0 = count[0], time.perf_counter()
        mx.async_eval(nxt)
        c1, t1 = count[0], time.perf_counter()
        y.tolist()
        t_ae += t1 - t0
        in_ae += c1 - c0
        c2 = count[0]
        time.sleep(t1 - t0)
        in_sleep += count[0] - c2
        y = nxt
    count[1] = False
    th.join()
    print(json.dumps({"rows": B, "gil": "counter increments during async_eval vs an equal sleep",
                      "async_eval_ms": round(t_ae / 30 * 1e3, 2), "during_async_eval": in_ae,
                      "during_sleep": in_sleep}), flush=True)
