#!/usr/bin/env bash
# `ember tune` on this CPU (its whole-model check included), then inference bs1 fp32: eager,
# Inductor and tuned Ember in one process, and untuned / tuned Ember alone in alternating processes.
#   benchmarks/scripts/cpu_tune_bench.sh OUTDIR [MODEL ...]     (from the repo root)
# TUNE_BUDGET (seconds per model, default 120). On a bigger host, pin it to the cores to measure:
#   OMP_NUM_THREADS=2 taskset -c 0,1 benchmarks/scripts/cpu_tune_bench.sh OUTDIR
set -euo pipefail
out=$1; shift
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(resnet50 bert mobilenet_v3)
mkdir -p "$out"
export EMBER_CACHE_DIR=$out/cache PYTHONPATH=src
common=(--mode infer --device cpu --precision fp32 --batch 1)
for m in "${models[@]}"; do
  /usr/bin/time -f "tune $m wall %e s" python -m ember tune "$m" "${common[@]}" --budget "${TUNE_BUDGET:-120}" 2>&1 | tee "$out/tune_$m.txt"
done
python -m ember tune --export "$out/tuning_db_export.json"
uptime | tee "$out/load.txt"
python -m ember bench "${models[@]}" "${common[@]}" --iters 20 --json "$out/tuned_with_peers.json"
for run in 1 2; do
  uptime | tee -a "$out/load.txt"
  EMBER_TUNING=0 python -m ember bench "${models[@]}" "${common[@]}" --iters 20 --backend ember --json "$out/untuned_run$run.json"
  python -m ember bench "${models[@]}" "${common[@]}" --iters 20 --backend ember --json "$out/tuned_run$run.json"
done
# A second tune of each model: answered by the database, the whole-model verdict noted.
for m in "${models[@]}"; do
  /usr/bin/time -f "second tune $m wall %e s" python -m ember tune "$m" "${common[@]}" --budget "${TUNE_BUDGET:-120}" 2>&1 | tail -3 | tee -a "$out/second_tune.txt"
done
