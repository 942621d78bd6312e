#!/usr/bin/env bash
# Round 5 on an H200 (run by the device tool after .gpu-b/install.sh):
#   profile: a 16k exact repeat and a new turn on it, each stage's device time and bytes between
#            barriers (scripts/hit_copies.py), then issue 39's core bench at 32 and 1 streams
#            (both core placements, the engine alone, the library, mlx_lm.server).
# Usage: scripts/h200_round5.sh profile
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
out=${OUT:-bench-out}
mkdir -p "$out"
model="model=tiny model.size=large model.dtype=bfloat16 model.compute_dtype=checkpoint model.cache_dir=/tmp/models"
if [ "${1:-profile}" = profile ]; then
  # shellcheck disable=SC2086
  timeout 170 python3 scripts/hit_copies.py --prefix 16384 --turn 64 -- $model 2>&1 \
    | tee "$out/hit-copies-16k.jsonl" | cut -c1-400
  # shellcheck disable=SC2086
  timeout 390 python3 bench.py -m $model bench.streams=32,1 bench.max_tokens=128 \
    bench.prompt_words=25 bench.mlx_lm=true bench.batch_generator=true \
    'bench.cores=[thread,process]' bench.engine_alone=true bench.out="$out/core" 2>&1 \
    | grep -v "^bench:" | tail -30
fi
