#!/usr/bin/env bash
# MLX's CUDA graph cache under pipeserve's engine (run by the device tool after .gpu-b/install.sh;
# files under $OUT): scripts/ttft_probe.py, the engine alone, per variant
#   fuse:     a graph cache of 8 with MLX's thrashing check on (as MLX ships it): its lifetime
#             miss counter passes twice the capacity, and every later miss raises
#   nofuse:   the same cache with pipeserve's default (the check off): the steps run on
#   default:  MLX's cache size, cold 16k prompts then bursts of 32 and 128
#   big:      the same with a cache of 4000 graphs: whether the default one thrashes
# Usage: scripts/h200_graph_cache.sh [SIZE=medium]   (VARIANTS: a subset, space-separated)
set -uo pipefail
size=${1:-medium}; out=${OUT:-graph-out}; mkdir -p "$out"
model=(model=tiny model.size="$size" model.dtype=bfloat16 model.compute_dtype=checkpoint
       model.cache_dir=/tmp/models server.cuda_graphs=true)   # the graphs, as MLX ships them
for v in ${VARIANTS:-fuse nofuse default big}; do
  args=(--cold 16384,16384,16384,16384 --burst 32,128 --reps 3 --timeline --library none)
  envs=()
  case $v in
    fuse) envs=(MLX_CUDA_GRAPH_CACHE_SIZE=8 MLX_ENABLE_CACHE_THRASHING_CHECK=1)
          args=(--cold none --burst 32 --reps 2 --library none) ;;
    nofuse) envs=(MLX_CUDA_GRAPH_CACHE_SIZE=8) args=(--cold none --burst 32 --reps 2 --library none) ;;
    default) ;;
    big) envs=(MLX_CUDA_GRAPH_CACHE_SIZE=4000) ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  env "${envs[@]}" timeout 200 python3 scripts/ttft_probe.py "${args[@]}" -- "${model[@]}" \
    > "$out/probe-$v.jsonl" 2> "$out/probe-$v.err"
  echo "== $v (${envs[*]}): exit $?"
  grep -o "Cache thrashing[^\"]*" "$out/probe-$v.err" "$out/probe-$v.jsonl" | sort | uniq -c | head -3
  grep -c "step failed\|Traceback" "$out/probe-$v.err"
  python3 - "$out/probe-$v.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    w = d.get("what")
    if w == "engine burst":
        print(f"burst {d['streams']} lb={d['logit_bias']} rep={d['rep']} ttft={d['ttft_p50_s']} "
              f"wall={d['wall_s']} agg={d['agg_tok_s']}")
    elif w == "timeline" and "streams" in d and d.get("rep") == 0:
        ev = [e for e in d["events"] if e[0] == "launch"][:2]
        print("   launches (ms, rows, prompt rows):", [(e[2], e[3], e[4]) for e in ev])
    elif w == "engine cold prompt":
        print(w, d["i"], d["ttft_s"])
PY
done
