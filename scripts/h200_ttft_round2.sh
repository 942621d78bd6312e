#!/usr/bin/env bash
# Time to first token on an H200 after the kernel warm-up (run by the device tool after
# .gpu-b/install.sh), 8B shape, bf16, one MLX kernel cache for the whole call:
#  1. bench.py's ttft workload at the server's defaults, from an empty kernel cache (the
#     warm-up builds them): first burst, four cold 16k prompts and a 4k one, 32/128 bursts;
#  2. a second launch on the now warm kernel cache (launch to ready), 32k and 64k prompts;
#  3. the engine alone on a 64k prompt, its time split by part, beside mlx-lm's prefill.
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
out=${OUT:-bench-out}
export MLX_PTX_CACHE_DIR=$(mktemp -d)
model="model=tiny model.size=large model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models"
# shellcheck disable=SC2086
timeout 260 python3 bench.py bench.workload=ttft $model bench.ttft_first_burst=32 \
  bench.out="$out/8b" 2>&1 | tail -20
# shellcheck disable=SC2086
timeout 200 python3 bench.py bench.workload=ttft $model model.max_context=65600 \
  bench.ttft_first_burst=32 'bench.ttft_cold=[32768,65536,4096]' 'bench.ttft_bursts=[]' \
  bench.out="$out/long" 2>&1 | tail -10
# shellcheck disable=SC2086
timeout 120 python3 scripts/ttft_probe.py --cold 65536 --prefix 16 -- $model \
  model.max_context=65600 2>&1 | tee "$out/probe-64k.jsonl" | cut -c1-700
