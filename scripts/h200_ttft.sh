#!/usr/bin/env bash
# Time to first token on an H200 (run by the device tool after .gpu-b/install.sh): bench.py's
# ttft workload on the generated Qwen3-shaped bf16 model of each size, then the engine alone
# (scripts/ttft_probe.py) with its per-part split of the same cold prompts.
# Usage: scripts/h200_ttft.sh "SIZES" [bench overrides...]
#   e.g. scripts/h200_ttft.sh "large medium" bench.ttft_first_burst=32
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
sizes=${1:-large}; shift || true
out=${OUT:-bench-out}
model="model=tiny model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models"
for size in $sizes; do
  echo "== $size"
  # shellcheck disable=SC2086
  python3 bench.py bench.workload=ttft $model model.size="$size" bench.out="$out/ttft-$size" "$@" \
    2>&1 | tail -25
  # shellcheck disable=SC2086
  python3 scripts/ttft_probe.py --prefix 16 --library none -- $model model.size="$size" \
    2>&1 | tee "$out/ttft-probe-$size.jsonl" | cut -c1-400
done
