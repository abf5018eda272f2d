#!/usr/bin/env bash
# Cold and warm first calls of one bench case, code BASE against the working tree, alternating
# processes: BASE checked out in a temporary worktree, each side in its own cache folders.
#   [BACKEND=ember-whole-step] bash benchmarks/scripts/cpu_first_call_ab.sh BASE [MODEL MODE ROUNDS]   (default tiny_transformer train 3, backend ember)
# Cold: empty caches per process. Warm: the caches the side's first cold process left.
set -euo pipefail
base=$1; model=${2:-tiny_transformer}; mode=${3:-train}; rounds=${4:-3}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tmp=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$root" worktree add -q --detach "$tmp/base" "$base"
script="$root/benchmarks/scripts/warm_first_call_profile.py"
run() {  # side src cache
    EMBER_CACHE_DIR=$3/ember TORCHINDUCTOR_CACHE_DIR=$3/inductor TRITON_CACHE_DIR=$3/triton PYTHONPATH=$2 \
        python "$script" "$model" "$mode" "${BACKEND:-ember}" 2>&1 | grep -E "first call done" | sed "s/^ *[0-9.]* s  /$1 /"
}
echo "# $model $mode, base $(git -C "$root" rev-parse --short "$base") against head $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- src || echo ' + uncommitted src')"
for i in $(seq "$rounds"); do
    for side in base head; do
        src=$([ $side = base ] && echo "$tmp/base/src" || echo "$root/src")
        rm -rf "$tmp/cold"; run "$side cold $i:" "$src" "$tmp/cold"
    done
done
for side in base head; do
    src=$([ $side = base ] && echo "$tmp/base/src" || echo "$root/src")
    run "$side fill:" "$src" "$tmp/warm_$side" > /dev/null
done
for i in $(seq "$rounds"); do
    for side in base head; do
        src=$([ $side = base ] && echo "$tmp/base/src" || echo "$root/src")
        run "$side warm $i:" "$src" "$tmp/warm_$side"
    done
done
