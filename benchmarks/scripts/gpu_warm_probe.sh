#!/usr/bin/env bash
# Where warm first calls go on a GPU: for each model, one cold process (it fills the caches), then
# warm processes with the constants-load probe, and one under cProfile or torch.profiler.
#   [BACKEND=ember-whole-step] [TORCH_PROFILE=0] [AB_ENV="EMBER_X=0"] bash benchmarks/scripts/gpu_warm_probe.sh "bert resnet50" [EXTRA ENV ASSIGNMENTS...]
# Results under $OUT/warm_probe/: MODEL_cold.txt, MODEL_warm_N.txt, MODEL_warm_cprofile.txt,
# MODEL_warm_torch_profile.txt, and a summary line per process in summary.txt. AB_ENV: two more warm
# processes with those assignments (MODEL_warm_ab_N.txt), alternating with two plain ones.
set -u
MODELS=${1:-"bert resnet50"}
BACKEND=${BACKEND:-ember}
TORCH_PROFILE=${TORCH_PROFILE:-1}
shift || true
OUT=${OUT:-out}/warm_probe
mkdir -p "$OUT"
export PYTHONPATH=src EMBER_WARM_START=1 "$@"
summary() { grep -E "first call done|warm start: loaded|beside the load|meanwhile|constants load|modules first imported|first run|cubin launches" "$1" | sed "s#^#$(basename "$1" .txt): #" >> "$OUT/summary.txt"; }
for model in $MODELS; do
  caches=$(mktemp -d)
  export EMBER_CACHE_DIR=$caches/ember TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton
  run() { timeout "$1" python benchmarks/scripts/warm_first_call_profile.py "$model" train "$BACKEND" --device cuda "${@:3}" > "$OUT/$2.txt" 2>&1; summary "$OUT/$2.txt"; }
  run 240 "${model}_cold"
  run 90 "${model}_warm_1" --probe-load
  run 90 "${model}_warm_2" --probe-load
  run 90 "${model}_warm_cprofile" --profile "$caches/p.prof" --top 60
  if [ -n "${AB_ENV:-}" ]; then
    for i in 1 2; do
      (export $AB_ENV; run 90 "${model}_warm_ab_$i" --probe-load)
      run 90 "${model}_warm_plain_$i" --probe-load
    done
  fi
  [ "$TORCH_PROFILE" = 1 ] && run 90 "${model}_warm_torch_profile" --torch-profile --top 30
  rm -rf "$caches"
done
cat "$OUT/summary.txt"
