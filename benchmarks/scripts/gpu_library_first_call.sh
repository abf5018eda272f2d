#!/usr/bin/env bash
# Library first calls across host threads (library_first_call_probe.py), alternating openings,
# each in its own new process. Lines go to $OUT/library_first_call.txt.
#   bash benchmarks/scripts/gpu_library_first_call.sh "resnet50 bert" [OPENINGS]
set -u
MODELS=${1:-"resnet50 bert"}
OPENINGS=${2:-"main thread busy thread main"}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src
for model in $MODELS; do
  for opening in $OPENINGS; do
    timeout 120 python benchmarks/scripts/library_first_call_probe.py "$model" --opening "$opening" \
      2>&1 | tail -1 | tee -a "$OUT/library_first_call.txt"
  done
done
