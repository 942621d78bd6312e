#!/usr/bin/env bash
# Does the host core matter on an H200 (run by the device tool after .gpu-b/install.sh)? The
# machine's CPU/GPU topology, scripts/placement_probe.py (mlx-lm's bare loop pinned to each CPU
# set, alone and beside a busy SMT sibling), then one-stream bursts through both engine
# placements, each rep's time printed, to see whether their speed is bimodal. Files under $OUT.
# Usage: scripts/h200_placement.sh [SIZE=medium]
set -uo pipefail
size=${1:-medium}; out=${OUT:-placement-out}; mkdir -p "$out"
(lscpu | grep -i "numa\|model name\|^cpu(s)\|thread\|socket"; nvidia-smi topo -m) > "$out/topo.txt" 2>&1
cat "$out/topo.txt"
timeout 200 python3 scripts/placement_probe.py --size "$size" --cache-dir /tmp/models \
  --tokens 256 --reps 3 | tee "$out/probe.jsonl"
for placement in thread process; do
  port=$((18930 + RANDOM % 500)); log="$out/serve-$placement.log"
  extra=(); [ $placement = process ] && extra=(server.isolate=true)
  python3 serve.py model=tiny model.size="$size" model.dtype=bfloat16 \
    model.compute_dtype=checkpoint model.cache_dir=/tmp/models "${extra[@]}" \
    server.port=$port > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  echo "== $placement core, one stream"
  python3 scripts/http_burst.py --url "http://127.0.0.1:$port" --n 1 --reps 12 --max-tokens 256 \
    2>&1 | tee "$out/burst-$placement.txt" | grep -o "rep [0-9]*:.*all done [0-9.]* s" \
    | sed 's/first token min.*all done/all done/' | tr '\n' ' '; echo
  kill $pid; wait $pid 2>/dev/null
done
