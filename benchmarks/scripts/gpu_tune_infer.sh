#!/usr/bin/env bash
# Inference at batch 1 after `ember tune` (library choices: attention backends, matmuls; kernel
# configurations), against the same bench without tuning, model by model:
#   bash benchmarks/scripts/gpu_tune_infer.sh "bert resnet50" 60
# Per model: `ember tune MODEL --mode infer --batch 1 --precision bf16` within the budget into a
# fresh cache, then `ember bench` of the whole-call program and Inductor with CUDA graphs with that
# cache (tuned) and with EMBER_TUNING=0 in another (untuned), each step under its own time limit.
# Results under $OUT/tune_infer/: MODEL_tune.txt, MODEL_tuned.json/.txt, MODEL_untuned.json/.txt.
set -u
MODELS=${1:-"bert"}
BUDGET=${2:-60}
OUT=${OUT:-out}/tune_infer
mkdir -p "$OUT"
export PYTHONPATH=src
for model in $MODELS; do
  cache=$(mktemp -d)
  EMBER_CACHE_DIR=$cache timeout "${TUNE_LIMIT:-240}" python -m ember tune "$model" --device cuda --mode infer \
    --batch 1 --precision bf16 --budget "$BUDGET" > "$OUT/${model}_tune.txt" 2>&1
  echo "$model tune: rc $?" >> "$OUT/summary.txt"
  for arm in tuned untuned; do
    tuning=1; dir=$cache
    [ "$arm" = untuned ] && tuning=0 && dir=$(mktemp -d)  # (no program or warm start of the tuned arm)
    EMBER_TUNING=$tuning EMBER_CACHE_DIR=$dir timeout "${BENCH_LIMIT:-180}" python -m ember bench "$model" \
      --mode infer --batch 1 --backend ember-whole-call,ember,inductor-cudagraphs \
      --json "$OUT/${model}_$arm.json" > "$OUT/${model}_$arm.txt" 2>&1
    echo "$model $arm: rc $?" >> "$OUT/summary.txt"
    grep -E "ember|inductor" "$OUT/${model}_$arm.txt" | tail -n 6 >> "$OUT/summary.txt"
  done
  tail -n 12 "$OUT/${model}_tune.txt" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
