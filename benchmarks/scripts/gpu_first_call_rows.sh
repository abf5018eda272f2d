#!/usr/bin/env bash
# First training calls of several models against Inductor's default mode, one model per bench run
# (each run: every backend's cold and warm first call in new processes, `ember bench --first-call`),
# each with its own time limit, so that one slow model cannot take the others' rows with it.
#   [BACKENDS=ember-whole-step,inductor] [LIMIT=300] bash benchmarks/scripts/gpu_first_call_rows.sh "resnet50 bert"
# Results under $OUT/first_calls/: first_call_MODEL.json and .txt, summary.txt (one line per row).
set -u
MODELS=${1:-"resnet50 bert"}
OUT=${OUT:-out}/first_calls
mkdir -p "$OUT"
export PYTHONPATH=src
for model in $MODELS; do
  start=$(date +%s)
  timeout "${LIMIT:-300}" python -m ember bench "$model" --mode train --first-call \
    --backend "${BACKENDS:-ember-whole-step,inductor}" --json "$OUT/first_call_$model.json" \
    > "$OUT/first_call_$model.txt" 2>&1
  echo "$model: rc $? in $(( $(date +%s) - start )) s" >> "$OUT/summary.txt"
  python - "$OUT/first_call_$model.json" >> "$OUT/summary.txt" 2>/dev/null <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("results", []):
    print(f"  {r['model']} {r['backend']} {r.get('cache')} first_call_s {r.get('first_call_s')}")
PY
done
cat "$OUT/summary.txt"
