#!/usr/bin/env bash
# The kernel warm-up's A/B on an H200 (run by the device tool after .gpu-b/install.sh): the
# first burst after launch without and with scheduler.kernel_warmup, each launch with an empty
# MLX kernel cache of its own (MLX_PTX_CACHE_DIR; a fresh machine's state), beside the ttft
# workload's cold prompts and bursts and the library's figures.
# Usage: [WARMUP="false true"] scripts/h200_kernel_warmup.sh bf16|q4 [bench overrides...]
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
kind=${1:-bf16}; shift || true
out=${OUT:-bench-out}
model="model=tiny model.size=large model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models"
q4=""
[ "$kind" = q4 ] && q4="bench.quantize_bits=4"   # the same 8B through mlx_lm's own converter
for w in ${WARMUP:-false true}; do   # WARMUP="true": the warm-up launch alone
  echo "== $kind kernel_warmup=$w"
  # shellcheck disable=SC2086
  MLX_PTX_CACHE_DIR=$(mktemp -d) python3 bench.py bench.workload=ttft $model \
    scheduler.kernel_warmup=$w $q4 bench.out="$out/$kind-warmup-$w" "$@" 2>&1 | tail -22
done
