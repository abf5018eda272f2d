#!/usr/bin/env bash
# GPU matmul implementations tuned for training steps, then the first-call rows that go with them.
#   bash benchmarks/scripts/gpu_tune_matmuls.sh "bert swin_t" 150
# Per model: gpu_tune.py --library-only (untuned steps, `ember tune`'s matmul sites within the
# budget, tuned steps, a second tune) under its own time limit. Results under $OUT/tune_matmuls/.
set -u
MODELS=${1:-"bert"}
BUDGET=${2:-150}
OUT=${OUT:-out}/tune_matmuls
mkdir -p "$OUT"
export PYTHONPATH=src
for model in $MODELS; do
  timeout "${LIMIT:-420}" python benchmarks/scripts/gpu_tune.py --models "$model" --budget "$BUDGET" \
    --library-only --json "$OUT/gpu_tune_$model.json" > "$OUT/gpu_tune_$model.txt" 2>&1
  echo "$model: rc $?" >> "$OUT/summary.txt"
  tail -n 40 "$OUT/gpu_tune_$model.txt" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
