#!/usr/bin/env bash
# Why the 0.6B's first burst of 128 after long prompts prefills slower than later ones (round 14:
# 69, 66, 63, 59 ms over four bursts, the engine alone): scripts/ttft_probe.py's cold prompts then
# bursts of 128, once per variant, each in its own process; the timelines and MLX's memory
# before and after each burst. Run by the device tool after .gpu-b/install.sh; files under $OUT.
# Usage: scripts/h200_burst_probe.sh [SIZE=medium]   (VARIANTS: names below, space-separated;
# shapes: bursts of new and repeated shapes, MLX's CUDA graphs off (server.cuda_graphs=false);
# shapes-graphs: the same with them on, MLX's default)
set -uo pipefail
size=${1:-medium}; out=${OUT:-probe-out}; mkdir -p "$out"
model=(model=tiny model.size="$size" model.dtype=bfloat16 model.compute_dtype=checkpoint
       model.cache_dir=/tmp/models)
cold=16384,16384,16384,16384,4096
for v in ${VARIANTS:-default cleared bigcache nocold}; do
  args=(--cold "$cold" --burst 128 --reps 3 --timeline --library none)
  extra=()
  case $v in
    default) ;;
    cleared) args+=(--clear-after-cold) ;;
    bigcache) extra=(admission.buffer_cache_gb=40) ;;
    nocold) args=(--cold none --burst 128 --reps 3 --timeline --library none) ;;
    shapes|shapes-graphs)   # each shape's first burst against its next: a cost per new shape?
      args=(--cold none --timeline --library none
            --shapes 128x76,128x76,128x70,128x70,120x76,120x76,96x60,96x60,128x76) ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  [ $v = shapes ] && extra=(server.cuda_graphs=false)
  [ $v = shapes-graphs ] && extra=(server.cuda_graphs=true)
  python3 scripts/ttft_probe.py "${args[@]}" -- "${model[@]}" "${extra[@]}" \
    > "$out/probe-$v.jsonl" 2> "$out/probe-$v.err"
  echo "== $v (exit $?)"
  python3 - "$out/probe-$v.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    w = d.get("what")
    if w == "engine burst":
        print(f"burst lb={d['logit_bias']} rep={d['rep']} ttft={d['ttft_p50_s']} "
              f"cache_gb {d['before']['cache_gb']}->{d['cache_gb']} "
              f"active {d['before']['active_gb']}->{d['active_gb']}")
    elif w == "timeline" and "streams" in d:
        ev = [e for e in d["events"] if e[0] == "launch"][:3]
        print("   launches (start, ms, rows, prompt rows):", [(e[1], e[2], e[3], e[4]) for e in ev])
    elif w == "engine shape":
        print("shape", d["shape"], "ttft", d["ttft_p50_s"], d["launches (ms, rows, prompt rows)"])
    elif w in ("engine cold prompt", "clear_cache after cold"):
        print(w, d.get("i", ""), d.get("ttft_s", ""), "cache_gb", d["cache_gb"],
              "active", d["active_gb"])
PY
done
tar czf "$out/../burst-probe.tgz" -C "$out" . 2>/dev/null && mv "$out/../burst-probe.tgz" "$out/"
