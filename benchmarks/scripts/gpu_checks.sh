#!/usr/bin/env bash
# The standing device checks, by name, each under its own time limit (run from the repo root):
#   bash benchmarks/scripts/gpu_checks.sh                      # every check, in the order below
#   bash benchmarks/scripts/gpu_checks.sh correctness suite    # the named checks only
#   bash benchmarks/scripts/gpu_checks.sh --list               # the names and their limits
# Results go under $OUT (default ./gpu_checks_out): NAME.log, and NAME.json where the check writes one.
# A check that runs past its limit is stopped; the others still run. Exit status 1 if any failed.
set -u
OUT=${OUT:-gpu_checks_out}
export PYTHONPATH=src PYTHONFAULTHANDLER=1

# name | seconds | command (what it checks)
CHECKS=(
  # bf16 against fp32 eager, forward and every gradient, the seed models
  "correctness|240|python benchmarks/scripts/gpu_correctness.py --json $OUT/correctness.json"
  # training with CUDA graphs against eager, step by step
  "cudagraph_check|150|python benchmarks/scripts/gpu_cudagraph_check.py --only train --json $OUT/cudagraph_check.json"
  # the seed suite's first part against eager and Inductor (one model per process); gpu_suite.py --list shows the others
  "suite|570|python benchmarks/scripts/gpu_suite.py --group 1 --budget 560 --out $OUT/suite"
  # whole-step programs (optimizers, schedulers, scalers, accumulation) against an eager loop
  "whole_step|180|python benchmarks/scripts/gpu_whole_step.py --part checks --json $OUT/whole_step.json"
  # dropout and attention dropout inside captured graphs
  "rng_capture|150|python benchmarks/scripts/gpu_rng_capture.py --skip-bert --json $OUT/rng_capture.json"
  # dropout inside activation checkpoints: the recompute's mask, the backward compiled, CUDA graphs
  "checkpoint_dropout|120|python benchmarks/scripts/gpu_checkpoint_dropout.py --json $OUT/checkpoint_dropout.json"
  # the shared op lowerings in compiled Triton against eager
  "lowering_check|120|python benchmarks/scripts/gpu_lowering_check.py"
  # the device prefetcher: input starvation with and without it
  "data_prefetch|240|python benchmarks/scripts/data_prefetch_bench.py --json $OUT/data_prefetch.json"
  # bart's gradients at the zoo's full size, Ember's variants against eager
  "bart_grads|240|python benchmarks/scripts/gpu_bart_grads.py"
  # host time per training step under Ember's per-graph mode (cProfile)
  "host_profile|200|python benchmarks/scripts/gpu_host_profile.py densenet121 resnet50 --backend ember --steps 15 --out $OUT/host"
  # Ember's tiled matmul (split K) and attention kernel against cuBLAS and the SDPA backends, bert batch-1 shapes
  "generated_vs_library|150|python benchmarks/scripts/gpu_generated_vs_library.py --json $OUT/generated_vs_library.json"
  # batch-1 inference kernels, Ember against Inductor with CUDA graphs
  "infer_profile|200|python benchmarks/scripts/gpu_profile.py resnet50 bert --mode infer --batch 1 --steps 20 --backend ember,inductor-cudagraphs --no-trace --out $OUT/infer"
)

if [[ ${1:-} == "--list" ]]; then
  for entry in "${CHECKS[@]}"; do IFS='|' read -r name limit _ <<< "$entry"; printf '%-16s %4ss\n' "$name" "$limit"; done
  exit 0
fi

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
git rev-parse --short HEAD 2>/dev/null

wanted=" $* "
failed=0
ran=0
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name limit command <<< "$entry"
  if [[ $# -gt 0 && $wanted != *" $name "* ]]; then continue; fi
  ran=$((ran + 1))
  start=$SECONDS
  # shellcheck disable=SC2086  # the command is a word list on purpose
  timeout "$limit" $command > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-16s rc=%-3s %4ds (limit %ss)\n' "$name" "$rc" "$((SECONDS - start))" "$limit"
  tail -n 20 "$OUT/$name.log"
  [[ $rc -ne 0 ]] && failed=1
done
if [[ $ran -eq 0 ]]; then echo "no check named: $*  (see --list)" >&2; exit 2; fi
exit "$failed"
