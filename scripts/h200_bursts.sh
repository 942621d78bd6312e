#!/usr/bin/env bash
# Bursts of 32 and 128 arrivals alone on an H200 (run by the device tool after .gpu-b/install.sh):
# bench.py's ttft workload without cold prompts, both engine placements, the step trace on, the
# library's BatchGenerator beside the first run; py-spy (non-blocking, per thread) samples the
# process-core server's API process, whose event loop sets the arrival spread. Then the same
# bursts once per scheduler setting in VARIANTS (space-separated; each "a=b,c=d" one run).
# Each run's bursts read by request_log_bursts.py --steps. Files under $OUT/bursts-<size>.
# Usage: SIZE=medium|large VARIANTS="scheduler.arrival_window_ms=15 scheduler.arrival_gap_ms=0"
#        scripts/h200_bursts.sh
set -uo pipefail
size=${SIZE:-medium}; out=${OUT:-bench-out}/bursts-$size; mkdir -p "$out"
model="model=tiny model.size=$size model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models scheduler.step_trace=true"
python3 -c "from pipeserve.model.tiny.text import ensure_model; ensure_model('qwen3', '$size', 'bfloat16', '/tmp/models')"
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
run() {   # $1: name; the rest: overrides
  local name=$1; shift
  # shellcheck disable=SC2086
  timeout 200 python3 bench.py bench.workload=ttft $model 'bench.ttft_cold=[]' \
    bench.ttft_first_burst=0 'bench.cores=[thread,process]' bench.out="$out/$name" "$@" 2>&1 \
    | grep "^| pipe\|^| mlx\|bench:"
  # the client's side of each burst: when it had written its requests, any it sent again, and
  # the server's own TTFT p50 of the same requests
  cat "$out/$name"/memory.jsonl "$out/$name"/core-process/memory.jsonl 2>/dev/null \
    | python3 -c "import json, sys; [print(d['scenario'], d.get('client_sent_ms_last'), d.get('client_retries'), d.get('server_ttft_p50_s')) for d in map(json.loads, sys.stdin)]"
  for log in "$out/$name"/pipeserve.log "$out/$name"/core-process/pipeserve.log; do
    [ -f "$log" ] || continue
    python3 scripts/request_log_bursts.py --gap 0.012 --steps "$log" > "$log.bursts.jsonl" 2>&1
    python3 - "$log.bursts.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if d.get("requests", 0) >= 8:
        steps = [(s[0], s[1], s[2], round(s[4].get("launch", 0), 1)) for s in d["steps"][:3]]
        print(sys.argv[1].split("/")[-3:-1], d["requests"], d["arrival_spread_s"], d["ttft_p50_s"], steps)
PY
  done
}
if [ -x "$spy" ]; then   # the process core's API process, once it is up
  ( for _ in $(seq 300); do p=$(pgrep -f "serve.py.*server.isolate=true" | head -1)
      [ -n "$p" ] && break; sleep 0.2; done
    [ -n "$p" ] && "$spy" record --nonblocking --threads -r 1000 -f raw -d 120 -p "$p" \
      -o "$out/spy-process-api.txt" > /dev/null 2>&1 ) &
fi
run base bench.batch_generator=true
wait
for v in ${VARIANTS:-}; do
  # shellcheck disable=SC2086
  run "$(echo "$v" | tr ',=' '__' | sed 's/scheduler\.//g')" bench.bare_loop=false ${v//,/ }
done
