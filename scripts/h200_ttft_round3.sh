#!/usr/bin/env bash
# Time to first token on an H200, round 3 (run by the device tool after .gpu-b/install.sh):
#   bf16: bench.py's ttft workload at the defaults from an empty kernel cache, ten cold 16k
#         prompts in a row and a 4k one, bursts of 32 and 128 with and without logit_bias,
#         through both engine core placements (thread, process), a repeat and a new turn on a
#         cached 16k prefix, bursts sharing a cached 2048-token head, beside the library; then the
#         engine alone on four cold 16k prompts and bursts of 32 and 128, its time split by
#         part.
#   q4:   the 4-bit 8B, kernel warm-up on, twice on one kernel cache: launch to ready and the
#         first burst from an empty cache, then again on the warm one.
#   shared: the cached-head bursts alone, memory gate at 0.9 and off (admission.memory_high_water).
#   long: 32k and 64k prompts beside the library (its own call: bf16's bench and probe take
#         about 540 s of the device's 600 s a call).
# Usage: scripts/h200_ttft_round3.sh bf16|q4|long|shared   (SIZE=medium: the 0.6B shape, files
# under $OUT/0.6b instead of $OUT/8b; EXTRA: more overrides for every server, e.g.
# EXTRA=server.stall_report_ms=50)
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
kind=${1:-bf16}
out=${OUT:-bench-out}
export MLX_PTX_CACHE_DIR=$(mktemp -d)
size=${SIZE:-large}; tag=8b; [ "$size" = medium ] && tag=0.6b
model="model=tiny model.size=$size model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models ${EXTRA:-}"
cold="bench.ttft_cold=[16384,16384,16384,16384,16384,16384,16384,16384,16384,16384,4096]"
# the model made in a process of its own, which exits: whatever MLX keeps of making it is never
# beside the servers measured (round 10: the bench had made it and held ~42 GB of the device)
python3 -c "from pipeserve.model.tiny.text import ensure_model; ensure_model('qwen3', '$size', 'bfloat16', '/tmp/models')"
if [ "$kind" = bf16 ]; then
  # shellcheck disable=SC2086
  timeout 450 python3 bench.py bench.workload=ttft $model bench.ttft_first_burst=32 "$cold" \
    'bench.cores=[thread,process]' bench.ttft_shared_head=2048 bench.out="$out/$tag" 2>&1 | tail -48
  grep -h "kernel warm-up:\|ready:" "$out"/$tag/pipeserve*.log | cut -c1-1500
  cat "$out"/$tag/memory.jsonl "$out"/$tag/core-process/memory.jsonl 2>/dev/null | cut -c1-400
  find "$MLX_PTX_CACHE_DIR" -name '*.ptx' -printf '%TT %s %P\n' | sort > "$out/$tag/ptx.txt"
  # shellcheck disable=SC2086
  timeout 150 python3 scripts/ttft_probe.py --cold 16384,16384,16384,16384 --prefix 16 --burst 32,128 --timeline --repeat \
    --shared-head 2048 -- \
    $model 2>&1 | tee "$out/probe-16k.jsonl" | cut -c1-900
elif [ "$kind" = shared ]; then
  # bursts of 32 and 128 on a cached 2048-token head, both cores, with the memory gate at its
  # default and off: memory.jsonl per server (peak, memory_waits), stacks of slow scenarios
  for high in 0.9 0; do
    # shellcheck disable=SC2086
    timeout 260 python3 bench.py bench.workload=ttft $model 'bench.ttft_cold=[]' \
      bench.ttft_first_burst=0 bench.ttft_shared_head=2048 'bench.cores=[thread,process]' \
      admission.memory_high_water=$high bench.batch_generator=false bench.bare_loop=false \
      bench.out="$out/shared-$high" 2>&1 | grep "^| pipe"
    tail -n 2 "$out/shared-$high/memory.jsonl" "$out/shared-$high/core-process/memory.jsonl" \
      | cut -c1-700
  done
elif [ "$kind" = long ]; then
  # shellcheck disable=SC2086
  timeout 300 python3 bench.py bench.workload=ttft $model model.max_context=65700 \
    'bench.ttft_cold=[32768,65536,4096]' 'bench.ttft_bursts=[]' bench.out="$out/long" 2>&1 \
    | tail -12
else
  for launch in empty-kernel-cache warm-kernel-cache; do
    echo "== q4 $launch"
    # shellcheck disable=SC2086
    timeout 280 python3 bench.py bench.workload=ttft $model bench.quantize_bits=4 \
      bench.ttft_first_burst=32 'bench.ttft_cold=[4096]' 'bench.ttft_bursts=[32]' \
      bench.out="$out/q4-$launch" 2>&1 | tail -14
    grep -h "kernel warm-up:\|ready:" "$out/q4-$launch/pipeserve.log" | cut -c1-1500
    # what MLX compiled, when: the kernel modules a 4-bit launch builds
    find "$MLX_PTX_CACHE_DIR" -name '*.ptx' -printf '%TT %s %P\n' | sort | tail -40 > "$out/q4-$launch/ptx.txt"
    wc -l < "$out/q4-$launch/ptx.txt"; grep -i "qmm\|gather" "$out/q4-$launch/ptx.txt" | head -20
  done
fi
