#!/usr/bin/env bash
# Where each engine placement's engine thread spends a burst on an H200 (run by the device tool
# after .gpu-b/install.sh; py-spy comes with the stashed wheels): the generated 8B served with
# the thread core, then with the core process (server.isolate=true); scripts/http_burst.py sends
# bursts of N streaming requests (128 tokens each) while py-spy samples the process that runs
# the engine thread (native frames, idle included); scripts/gil_waits.py splits the engine
# thread's samples into waiting for the GIL, MLX's calls and Python. Files under $OUT.
# Usage: scripts/h200_gil.sh [N=128] [SECONDS=15]   (PLACEMENTS="thread": one of them; REPS:
# bursts sent, 6 by default: enough to cover SECONDS at 128 streams; one stream wants ~20;
# MAX_TOKENS: each request's tokens out, 128 by default; 4 makes back-to-back bursts, as
# bench.py's ttft workload sends them; GIL=1: sample only the thread holding the GIL, in the
# server process (the core process's parent: its event loop), read by gil_waits.py --holders;
# not paused for its samples)
set -uo pipefail
n=${1:-128}; secs=${2:-15}; out=${OUT:-gil-out}; mkdir -p "$out"
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
[ -x "$spy" ] || { echo "py-spy is missing: copy its wheel into .gpu-a (pip download py-spy)"; exit 3; }
# MODEL: other overrides (a quick check on a CPU: MODEL="model=tiny scheduler.max_batch=128")
read -r -a model <<< "${MODEL:-model=tiny model.size=large model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models scheduler.max_batch=128}"
model+=(admission.max_queue=1024)
for placement in ${PLACEMENTS:-thread process}; do
  port=$((18430 + RANDOM % 500)); log="$out/serve-$placement.log"
  extra=(); [ $placement = process ] && extra=(server.isolate=true)
  python3 serve.py "${model[@]}" "${extra[@]}" server.port=$port > "$log" 2>&1 &
  pid=$!
  python3 - "$port" "$pid" <<'PY' || { echo "the $placement server did not come up"; tail -20 "$log"; kill "$pid"; continue; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(900):   # the 8B's weights are generated on the first launch
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    time.sleep(1)
sys.exit(1)
PY
  python3 scripts/http_burst.py --url "http://127.0.0.1:$port" --n 8 --reps 1 --max-tokens 8 \
    > /dev/null 2>&1   # the shapes, once (and the model loaded)
  target=$pid
  if [ $placement = process ] && [ -z "${GIL:-}" ]; then   # the engine: the member's process
    target=$(grep -o "engine process [0-9]*" "$log" | tail -1 | grep -o "[0-9]*$")
  fi
  python3 scripts/http_burst.py --url "http://127.0.0.1:$port" --n "$n" --reps "${REPS:-6}" \
    --max-tokens "${MAX_TOKENS:-128}" > "$out/burst-$placement.txt" 2>&1 &
  burst=$!
  sleep 1
  # GIL=1: non-blocking and no native frames: a process paused for each sample serves
  # slower while the GPU does not wait, and its loop then looks busier than it is
  mode=(--native --idle -r 200); [ -n "${GIL:-}" ] && mode=(--gil --nonblocking -r 100)
  "$spy" record "${mode[@]}" --threads -d "$secs" -f raw -o "$out/$placement.raw" \
    -p "$target" > "$out/spy-$placement.txt" 2>&1
  wait $burst
  echo "== $placement core: $n streams"
  tail -3 "$out/burst-$placement.txt"
  if [ -n "${GIL:-}" ]; then
    python3 scripts/gil_waits.py --holders "$out/$placement.raw" | tee "$out/gil-$placement.md"
  else
    python3 scripts/gil_waits.py "$out/$placement.raw" | tee "$out/gil-$placement.md"
  fi
  kill "$pid"; wait "$pid" 2>/dev/null
done
