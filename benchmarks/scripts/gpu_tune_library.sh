#!/usr/bin/env bash
# GPU library choices (matmuls, depthwise convolutions) tuned for training steps, model by model.
#   bash benchmarks/scripts/gpu_tune_library.sh "bert swin_t" 150
# Per model: gpu_tune.py --library-only (untuned steps, `ember tune`'s library sites within the
# budget, tuned steps, a second tune) under its own time limit. Results under $OUT/tune_library/.
set -u
MODELS=${1:-"bert"}
BUDGET=${2:-150}
OUT=${OUT:-out}/tune_library
mkdir -p "$OUT"
export PYTHONPATH=src
for model in $MODELS; do
  timeout "${LIMIT:-420}" python benchmarks/scripts/gpu_tune.py --models "$model" --budget "$BUDGET" \
    --library-only --json "$OUT/gpu_tune_$model.json" > "$OUT/gpu_tune_$model.txt" 2>&1
  echo "$model: rc $?" >> "$OUT/summary.txt"
  tail -n 40 "$OUT/gpu_tune_$model.txt" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
