#!/usr/bin/env bash
# Issue 16's GPU figures on an H200 (run by the device tool after .gpu-b/install.sh):
# 8 and 16 concurrent streams spread over 0 (the base model), 1, 4 and 8 adapters in mixed
# batches, then gather against grouping per decode step. Usage: scripts/h200_lora_bench.sh [SIZE]
#   SIZE: medium (0.6B shape, default) | large (8B shape)
set -euo pipefail
python3 -c "import aiohttp" 2>/dev/null || { echo "bench.py's client needs aiohttp: stash its wheels with ../shared/device/prepare.sh, EXTRA_WHEELS='aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna'"; exit 3; }
size=${1:-medium}
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
out=${OUT:-bench-out}/lora-$size
python3 bench.py -m model.size="$size" model.dtype=bfloat16 model.compute_dtype=checkpoint \
  bench.streams=8,16 bench.max_tokens=64 bench.bare_loop=false bench.adapters=0,1,4,8 \
  bench.out="$out"
grep "^| pipeserve" "$out"/results.md | sort -u | cut -d'|' -f2,4,8,10,15 || true
python3 scripts/lora_gather_vs_group.py --size "$size" --rows 16 --adapters 1,4,8
