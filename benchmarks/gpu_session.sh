#!/usr/bin/env bash
# One device call that checks and times the current tree on the H100 (run from the repo root):
#   bash benchmarks/gpu_session.sh            results under $OUT (or ./gpu_session_out)
# Each step has its own time limit, so one slow step cannot take the others' results with it;
# the order is by priority (issue targets first). Writes one JSON per step and a log.
set -u
OUT=${OUT:-gpu_session_out}
mkdir -p "$OUT"
export PYTHONPATH=src
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %4ds\n' "$name" "$rc" "$((SECONDS - start))"
  tail -n 25 "$OUT/$name.log" | grep -E '\|' | tail -n 12
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
git rev-parse --short HEAD 2>/dev/null
step correctness 90 python benchmarks/gpu_correctness.py resnet50 mobilenet_v3 bert style_transfer --json "$OUT/correctness.json"
step train_cyclegan_style 160 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
  --no-progress --json "$OUT/bench_train_cyclegan_style.json"
step infer_bert_bs1 70 python -m ember.cli bench bert --mode infer --batch 1 --precision bf16 \
  --no-progress --json "$OUT/bench_infer_bert_bs1.json"
step train_convnets_ember 140 python -m ember.cli bench resnet50 vgg16 mobilenet_v3 --mode train --precision bf16 \
  --backend eager,ember --iters 20 --no-progress --json "$OUT/bench_train_convnets.json"
step profile_style 50 python benchmarks/gpu_profile.py style_transfer --backend ember --steps 3 --out "$OUT/profile"
