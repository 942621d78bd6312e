#!/usr/bin/env bash
# Issue 27's GPU row on an H200 (run by the device tool after .gpu-b/install.sh; the wheels
# need mlx-vlm, Pillow and pipeserve's newer base deps: EXTRA_WHEELS='mlx-vlm pillow
# sentencepiece ijson gguf' for prepare.sh; move wheels to .gpu-b if .gpu-a passes 64 MiB):
# bench.workload=vision (N streams, each with its own 224x224 PNG, 128 output tokens, EOS
# suppressed) against mlx-vlm's own stream_generate on the same generated VLM directory and
# images, one request at a time. Usage: scripts/h200_vision_bench.sh ARCHS SIZE STREAMS [overrides]
#   ARCHS: e.g. gemma3 (qwen2_5_vl is refused on CUDA: its tower dies with SIGFPE there); SIZE: medium (decoder at Qwen3-0.6B's shape) | large (8B)
set -euo pipefail
archs=${1:-gemma3}; size=${2:-medium}; streams=${3:-1,8,32}; shift 3 || true
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
python3 -c "import mlx_vlm, PIL, aiohttp" || { echo "mlx-vlm, Pillow or aiohttp missing: see the header"; exit 3; }
for arch in $archs; do
  out=${OUT:-bench-out}/vision-$arch-$size
  python3 bench.py -m model=tiny_vlm model.arch="$arch" model.size="$size" model.dtype=bfloat16 \
    model.compute_dtype=checkpoint bench.workload=vision bench.streams="$streams" \
    bench.requests_per_stream=2 bench.max_tokens=128 bench.mlx_lm=true bench.out="$out" "$@"
  find "$out" -name 'results.md' -exec cat {} +
done
