#!/usr/bin/env bash
# Issue 43's GPU sweep on an H200 (run by the device tool after .gpu-b/install.sh): every
# drafter against draft=none at 1 to 32 streams, and n-gram lookup where it can win (a
# repetitive workload), so a per-drafter draft.disable_by_batch_size default can be read off.
#   all:   model=qwen (the generated model with an MTP head; EAGLE-3 and DFlash heads generated)
#   ngram: model=tiny model.size=large, draft=none,ngram on the repetitive workload
# Usage: scripts/h200_drafters.sh all|ngram   (each fits one device call)
set -uo pipefail
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
out=${OUT:-bench-out}
if [ "${1:-all}" = all ]; then
  timeout 560 python3 bench.py -m model=qwen model.dtype=bfloat16 model.compute_dtype=checkpoint \
    draft=none,ngram,mtp,eagle3,dflash bench.streams=1,8,32 bench.workload=concurrent \
    bench.max_tokens=64 bench.bare_loop=false bench.out="$out/drafters" 2>&1 | grep -v "^bench:" | tail -30
else
  timeout 560 python3 bench.py -m model=tiny model.size=large model.dtype=bfloat16 \
    model.compute_dtype=checkpoint draft=none,ngram bench.streams=1,2,4,8,16,32 \
    bench.workload=repetitive bench.max_tokens=64 bench.bare_loop=false \
    bench.out="$out/ngram" 2>&1 | grep -v "^bench:" | tail -30
fi
