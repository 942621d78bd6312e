#!/usr/bin/env bash
# Issue 14's GPU table on an H200 (run by the device tool after .gpu-b/install.sh):
# pipeserve, mlx_lm.server and mlx-lm's BatchGenerator side by side on one generated
# Qwen3-shaped bf16 model, 72-79-token prompts (bench.prompt_words=25 with the generated
# models' tokenizer; 56 words, used before, are 162-174 tokens), 128 output tokens,
# all streams arriving together. Usage: scripts/h200_core_bench.sh SIZE STREAMS [extra overrides]
#   SIZE: large (8B shape) | medium (0.6B shape); STREAMS: e.g. 1,32,128
set -euo pipefail
python3 -c "import aiohttp" 2>/dev/null || { echo "bench.py's client needs aiohttp: stash its wheels with ../shared/device/prepare.sh, EXTRA_WHEELS='aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna'"; exit 3; }
size=${1:-large}; streams=${2:-1,32,128}; shift 2 || true
python3 -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu" \
  || { echo "MLX with a GPU is not importable here: run .gpu-b/install.sh first"; exit 3; }
# one folder per size and stream list: a second run in the same call keeps the first one's logs
out=${OUT:-bench-out}/core-$size-${streams//,/-}
python3 bench.py -m model.size="$size" model.dtype=bfloat16 model.compute_dtype=checkpoint \
  bench.streams="$streams" bench.max_tokens=128 bench.prompt_words=25 \
  bench.mlx_lm=true bench.batch_generator=true bench.out="$out" "$@"
cat "$out"/results.md 2>/dev/null || find "$out" -name 'results.md' -exec cat {} +
# scheduler.step_trace=true among the overrides: each side's steps summarized (how many carried
# prompts, a decode step's wall and parts), through HTTP per burst, the engine alone per batch
for f in "$out"/pipeserve*.log "$out"/engine-alone-*.log; do
  { [ -f "$f" ] && grep -q "step: at=" "$f"; } || continue
  echo "== steps: $(basename "$f")"
  case "$f" in
    *engine-alone-*) python3 scripts/request_log_bursts.py --steps-only "$f" ;;
    *) python3 scripts/request_log_bursts.py --steps "$f" \
         | python3 -c 'import json, sys; [print(json.dumps({k: v for k, v in json.loads(line).items() if k != "steps"})) for line in sys.stdin]' ;;
  esac
done
