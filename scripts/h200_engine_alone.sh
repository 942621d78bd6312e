#!/usr/bin/env bash
# Issue 26's engine-alone table on an H200 (run by the device tool after .gpu-b/install.sh):
# the engine driven without HTTP next to mlx-lm's bare loop and BatchGenerator, one process per
# model shape, on the generated Qwen3-shaped bf16 models, 76-token prompts, 128 output tokens.
# Usage: scripts/h200_engine_alone.sh "SIZES" STREAMS [engine_alone.py args...]
#   e.g. scripts/h200_engine_alone.sh "large medium" 1,32,128 --profile 1
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
sizes=${1:-large medium}; streams=${2:-1,32,128}; shift 2 || true
out=${OUT:-bench-out}
for size in $sizes; do
  echo "== $size"
  python3 scripts/engine_alone.py --streams "$streams" "$@" -- model=tiny model.size="$size" \
    model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models \
    2>&1 | tee "$out/engine-alone-$size.txt" | grep -v "^\s*$"
done
