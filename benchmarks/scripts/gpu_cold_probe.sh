#!/usr/bin/env bash
# Where cold first calls go on a GPU: for each model, a cold process (empty Ember, Triton and
# Inductor caches) timed plainly, then another cold process under cProfile. AB_ENV: cold processes
# with those assignments alternating with plain ones (MODEL_cold_ab_N.txt, MODEL_cold_plain_N.txt);
# AB_SRC: the same with the "ab" processes running that source folder (another commit's src/).
#   [BACKEND=ember-whole-step] [AB_ENV="EMBER_X=0" | AB_SRC=base/src] [PROFILE=0] bash benchmarks/scripts/gpu_cold_probe.sh "bert resnet50" [EXTRA ENV...]
# Results under $OUT/cold_probe/: MODEL_cold*.txt, summary.txt.
set -u
MODELS=${1:-"bert resnet50"}
BACKEND=${BACKEND:-ember-whole-step}
shift || true
OUT=${OUT:-out}/cold_probe
mkdir -p "$OUT"
export PYTHONPATH=src EMBER_WARM_START=1 "$@"
summary() { grep -E "first call done|collections|first run|stages|beside|meanwhile" "$1" | sed "s#^#$(basename "$1" .txt): #" >> "$OUT/summary.txt"; }
kinds="cold"
[ -n "${AB_ENV:-}${AB_SRC:-}" ] && kinds="cold_ab_1 cold_plain_1 cold_ab_2 cold_plain_2"
[ "${PROFILE:-1}" = 1 ] && kinds="$kinds cold_cprofile"
for model in $MODELS; do
  for kind in $kinds; do
    caches=$(mktemp -d)
    export EMBER_CACHE_DIR=$caches/ember TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton
    extra=()
    [ "$kind" = cold_cprofile ] && extra=(--profile "$caches/p.prof" --top 70)
    (case $kind in cold_ab_*) [ -n "${AB_ENV:-}" ] && export $AB_ENV; [ -n "${AB_SRC:-}" ] && export PYTHONPATH=$AB_SRC;; esac
     timeout 240 python benchmarks/scripts/warm_first_call_profile.py "$model" train "$BACKEND" --device cuda "${extra[@]}" \
       > "$OUT/${model}_$kind.txt" 2>&1)
    summary "$OUT/${model}_$kind.txt"
    rm -rf "$caches"
  done
done
cat "$OUT/summary.txt"
