#!/usr/bin/env bash
# One device call that checks and times the current tree on the H100 (run from the repo root):
#   bash benchmarks/scripts/gpu_session.sh [PART]     PART 1 (default) to 41; results under $OUT (or ./gpu_session_out)
# Part 1 fits one 10-minute call; parts 2 and 3 are the training suite, one call each.
# Each step has its own time limit, so one slow step cannot take the others' results with it;
# the order is by priority (issue targets first). Writes one JSON per step and a log.
set -u
OUT=${OUT:-gpu_session_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONFAULTHANDLER=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %4ds\n' "$name" "$rc" "$((SECONDS - start))"
  tail -n 60 "$OUT/$name.log" | grep -E '\||first call|kernels on|Triton compiles|Error|error|==| ms ' | tail -n 30
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
git rev-parse --short HEAD 2>/dev/null
PART=${1:-1}
case "$PART" in
1)  # targets of issues #4/#5 that the last call could not finish, plus where cold compile goes
  step compile_profile 120 python benchmarks/scripts/gpu_compile_profile.py resnet50 cyclegan --json "$OUT/compile_profile.json"
  step train_cyclegan_style 170 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --no-progress --json "$OUT/bench_train_cyclegan_style.json"
  step infer_bert_bs1 110 python -m ember.cli bench bert --mode infer --batch 1 --precision bf16 \
    --no-progress --json "$OUT/bench_infer_bert_bs1.json"
  step correctness 150 python benchmarks/scripts/gpu_correctness.py mobilenet_v3 bert style_transfer --json "$OUT/correctness.json"
  ;;
2)  # the training suite, first half (eager, Inductor, Ember in one run), then where vgg16's step goes
  step train_a 450 python -m ember.cli bench resnet50 bert vgg16 mobilenet_v3 --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_a.json"
  step profile_vgg16 120 python benchmarks/scripts/gpu_profile.py vgg16 --backend ember,inductor --no-trace --out "$OUT/profile_a"
  ;;
3)  # the training suite, second half, then where mobilenet_v3's and densenet121's steps go
  step train_b 460 python -m ember.cli bench densenet121 resnet50v2 cyclegan style_transfer --mode train \
    --precision bf16 --iters 20 --no-progress --json "$OUT/bench_train_b.json"
  step profile_b 110 python benchmarks/scripts/gpu_profile.py mobilenet_v3 densenet121 --backend ember --no-trace --out "$OUT/profile_b"
  ;;
4)  # after the convolution-bias and training-attention changes: the models they touch, resnet50's
    # cold compile, where bert's step goes, and the NHWC batch-norm kernels
  step train_c 300 python -m ember.cli bench bert vgg16 cyclegan --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_c.json"
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json"
  step profile_bert 80 python benchmarks/scripts/gpu_profile.py bert --backend ember --no-trace --out "$OUT/profile_c"
  step kernels_nhwc 90 python benchmarks/scripts/kernel_bench.py --cases nhwc --json "$OUT/kernel_bench_nhwc.json"
  ;;
5)  # BERT training with its cuDNN attention backward captured: gradients vs eager with dropout,
    # the step time, where it goes; then peak memory eager vs Ember (reserved included)
  step cudagraph_bert 90 python benchmarks/scripts/gpu_cudagraph_check.py --only train --train-models tiny_transformer \
    --json "$OUT/cudagraph_check.json"
  step train_bert 130 python -m ember.cli bench bert --mode train --precision bf16 --iters 20 --no-progress \
    --json "$OUT/bench_train_bert.json"
  step profile_bert 60 python benchmarks/scripts/gpu_profile.py bert --backend ember --no-trace --out "$OUT/profile_bert"
  step memory 150 python -m ember.cli bench resnet50 vgg16 mobilenet_v3 --mode train --precision bf16 \
    --backend eager,ember --iters 10 --warmup 3 --no-progress --json "$OUT/bench_memory.json"
  ;;
6)  # the pooling decomposition on vgg16; the tiny-BERT CUDA-graph check after refusing memory-efficient
    # attention from capture; peak memory one process per backend; kernels of resnet50's cold compile
  step train_vgg16 200 python -m ember.cli bench vgg16 --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_vgg16.json"
  step cudagraph_tiny 80 python benchmarks/scripts/gpu_cudagraph_check.py --only train --train-models tiny_transformer \
    --json "$OUT/cudagraph_check.json"
  step memory 220 python benchmarks/scripts/gpu_memory.py resnet50 vgg16 bert --backends eager,ember --json "$OUT/memory.json"
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json" \
    --dump "$OUT/kernels"
  ;;
7)  # pointwise max pooling on vgg16; what is live at the memory peak (eager vs Ember); the kernels of
    # resnet50's cold compile (tarred: too many files to fetch one by one); warm start
  step train_vgg16 170 python -m ember.cli bench vgg16 --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_vgg16.json"
  step memory 170 python benchmarks/scripts/gpu_memory.py resnet50 vgg16 --backends eager,ember --trace eager,ember \
    --json "$OUT/memory.json"
  step compile_profile 70 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json" \
    --dump /tmp/ember_kernels
  tar czf "$OUT/kernels_resnet50.tgz" -C /tmp ember_kernels 2>/dev/null
  step warm_start 150 python benchmarks/scripts/gpu_warm_start.py resnet50 bert --json "$OUT/warm_start.json"
  ;;
8)  # resnet50's cold compile with warmed-up workers and lazy pass text; where vgg16's step goes
    # (Ember vs Inductor); what is live at Ember's memory peak on resnet50; bert's warm start
  step compile_profile 70 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json"
  step profile_vgg16 150 python benchmarks/scripts/gpu_profile.py vgg16 --backend ember,inductor --no-trace --out "$OUT/profile_vgg16"
  step memory 90 python benchmarks/scripts/gpu_memory.py resnet50 --backends ember --trace ember --json "$OUT/memory.json"
  step warm_start_bert 110 python benchmarks/scripts/gpu_warm_start.py bert --json "$OUT/warm_start_bert.json"
  ;;
9)  # the training suite, first half, alone (a call's 600 s fit no profile beside it)
  step train_a 560 python -m ember.cli bench resnet50 bert vgg16 mobilenet_v3 --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_a.json"
  ;;
10)  # the training suite, second half, alone
  step train_b 570 python -m ember.cli bench densenet121 resnet50v2 cyclegan style_transfer --mode train \
    --precision bf16 --iters 20 --no-progress --json "$OUT/bench_train_b.json"
  ;;
11)  # what launches the ATen copies of a vgg16 Ember step, with and without CUDA graphs
  step copies_graphs 150 python benchmarks/scripts/gpu_op_sites.py vgg16 --graphs --op aten::copy_
  step copies_nographs 150 python benchmarks/scripts/gpu_op_sites.py vgg16 --op aten::copy_ --dump "$OUT/vgg16_debug"
  ;;
12)  # where resnet50's capture goes (torch's timers, then a cProfile); peak memory with expandable
     # segments in every pool (eager and Ember); where style_transfer's step goes (Ember vs Inductor)
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json"
  step compile_cprofile 100 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_cprofile.json" \
    --cprofile "$OUT/cprofile"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step memory_expandable 200 python benchmarks/scripts/gpu_memory.py \
    resnet50 bert --backends eager,ember --json "$OUT/memory_expandable.json"
  step profile_style 130 python benchmarks/scripts/gpu_profile.py style_transfer --backend ember,inductor --no-trace \
    --out "$OUT/profile_style"
  ;;
13)  # after channels_last padding / instance norm and the pre-sized graph pool: cyclegan and
     # style_transfer speed and correctness, peak memory one process per backend, style_transfer profile
  step train_cyclegan_style 170 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_cyclegan_style.json"
  step memory 200 python benchmarks/scripts/gpu_memory.py resnet50 bert --backends eager,ember --json "$OUT/memory.json"
  step correctness 110 python benchmarks/scripts/gpu_correctness.py cyclegan style_transfer --json "$OUT/correctness.json"
  step profile_style 70 python benchmarks/scripts/gpu_profile.py style_transfer --backend ember --no-trace --out "$OUT/profile_style"
  ;;
14)  # one capture stream for every graph (the backward can reuse the forward's memory), pool
     # pre-sizing on and off; float32 sums generated; cyclegan / style_transfer again
  step train_cyclegan_style 170 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_cyclegan_style.json"
  step memory 120 python benchmarks/scripts/gpu_memory.py resnet50 bert --backends ember --json "$OUT/memory.json"
  EMBER_POOL_PRESIZE=0 step memory_no_presize 120 python benchmarks/scripts/gpu_memory.py resnet50 bert --backends ember \
    --json "$OUT/memory_no_presize.json"
  step profile_style 70 python benchmarks/scripts/gpu_profile.py style_transfer --backend ember --no-trace --out "$OUT/profile_style"
  ;;
15)  # peak memory of the other six seed models, one fresh process per backend
  step memory_rest 580 python benchmarks/scripts/gpu_memory.py vgg16 mobilenet_v3 densenet121 resnet50v2 cyclegan \
    style_transfer --backends eager,ember --json "$OUT/memory_rest.json"
  ;;
16)  # session 7: cold compile in the suite's conditions (Inductor first in the process) for the three
     # models over 1/3; cyclegan memory after releasing the first calls' cached blocks; bert infer bs1;
     # warm start; where resnet50's step goes (Ember vs Inductor)
  step compile_profile 150 python benchmarks/scripts/gpu_compile_profile.py vgg16 resnet50 mobilenet_v3 --after-inductor \
    --json "$OUT/compile_profile.json"
  step memory_cyclegan 80 python benchmarks/scripts/gpu_memory.py cyclegan --backends eager,ember --json "$OUT/memory_cyclegan.json"
  step infer_bert_bs1 100 python -m ember.cli bench bert --mode infer --batch 1 --precision bf16 \
    --no-progress --json "$OUT/bench_infer_bert_bs1.json"
  step warm_start 130 python benchmarks/scripts/gpu_warm_start.py resnet50 bert --json "$OUT/warm_start.json"
  step profile_resnet50 130 python benchmarks/scripts/gpu_profile.py resnet50 --backend ember,inductor --no-trace \
    --out "$OUT/profile_resnet50"
  ;;
17)  # after the asynchronous kernel compile with the backward compiled beside the forward: the three
     # models whose cold compile was over 1/3 (eager, Inductor, Ember in one run, as the suite), cyclegan
     # memory, resnet50's fresh-process compile split
  step train_compile 430 python -m ember.cli bench resnet50 vgg16 mobilenet_v3 --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_compile.json"
  step memory_cyclegan 60 python benchmarks/scripts/gpu_memory.py cyclegan --backends ember --json "$OUT/memory_cyclegan.json"
  step compile_profile 70 python benchmarks/scripts/gpu_compile_profile.py resnet50 --json "$OUT/compile_profile.json"
  ;;
18)  # after pausing the garbage collector during compiles: the three models again; what holds
     # cyclegan's default-pool memory at Ember's peak; GPU correctness vs fp32 eager after the
     # compile-order change
  step train_compile 300 python -m ember.cli bench resnet50 vgg16 mobilenet_v3 --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_compile.json"
  step memory_cyclegan 70 python benchmarks/scripts/gpu_memory.py cyclegan --backends ember --trace ember \
    --json "$OUT/memory_cyclegan.json"
  step correctness 200 python benchmarks/scripts/gpu_correctness.py resnet50 bert mobilenet_v3 cyclegan --json "$OUT/correctness.json"
  ;;
19)  # releasing the first calls' cached blocks: cyclegan memory (one process per backend); vgg16's
     # compile split with the first run; cyclegan / style_transfer speed; warm start (resnet50, bert)
  step memory_cyclegan 80 python benchmarks/scripts/gpu_memory.py cyclegan --backends eager,ember --json "$OUT/memory_cyclegan.json"
  step train_small 240 python -m ember.cli bench vgg16 cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_small.json"
  step warm_start 220 python benchmarks/scripts/gpu_warm_start.py resnet50 bert --json "$OUT/warm_start.json"
  ;;
20)  # why vgg16 / cyclegan kernels compile at launch (which kernels, specialised how); what the
     # default pool's inactive blocks of cyclegan under Ember are
  step compile_profile 150 python benchmarks/scripts/gpu_compile_profile.py vgg16 cyclegan --json "$OUT/compile_profile.json"
  step memory_cyclegan 70 python benchmarks/scripts/gpu_memory.py cyclegan --backends ember --trace ember \
    --json "$OUT/memory_cyclegan.json"
  ;;
21)  # bool pointers precompiled with a tensor: vgg16's launch misses (fresh process)
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py vgg16 --json "$OUT/compile_profile.json"
  ;;
22)  # after deduplicating kernels by launch parameters: vgg16's launch compiles and compile split
     # (fresh process, then after Inductor); cyclegan's default-pool blocks by state and the graphs' status
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py vgg16 --json "$OUT/compile_profile.json"
  step memory_cyclegan 70 python benchmarks/scripts/gpu_memory.py cyclegan --backends ember --trace ember \
    --json "$OUT/memory_cyclegan.json"
  step train_vgg16 150 python -m ember.cli bench vgg16 --mode train --precision bf16 --iters 20 --no-progress \
    --json "$OUT/bench_train_vgg16.json"
  ;;
23)  # first calls in pools of their own: peak memory (fresh process per backend); vgg16's launch
     # compiles after deduplicating by argument dtypes; resnet50's every kernel with its bytes
     # (Ember's sources kept); inference peak memory
  step memory_train 180 python benchmarks/scripts/gpu_memory.py cyclegan style_transfer resnet50 --backends eager,ember \
    --json "$OUT/memory_train.json"
  step compile_profile 80 python benchmarks/scripts/gpu_compile_profile.py vgg16 --json "$OUT/compile_profile.json"
  EMBER_DEBUG_DIR="$OUT/debug_resnet50" step profile_resnet50 200 python benchmarks/scripts/gpu_profile.py resnet50 \
    --backend ember,inductor --keep 0 --top 40 --no-trace --out "$OUT/profile_resnet50"
  find "$OUT/debug_resnet50" -type f ! -path '*/kernels/*' ! -name 'program*' ! -name 'plan.txt' -delete 2>/dev/null
  step memory_infer 120 python benchmarks/scripts/gpu_memory.py cyclegan resnet50 bert --mode infer --backends eager,ember \
    --json "$OUT/memory_infer.json"
  ;;
24)  # Ember's overlapping max-pool kernels and the broadcast-view tile fix: the kernels against
     # ATen's; resnet50 correctness, train speed (eager, Inductor, Ember in one run), every kernel
  step max_pool 60 python benchmarks/scripts/gpu_window_kernels.py --json "$OUT/window_kernels.json"
  step correctness 120 python benchmarks/scripts/gpu_correctness.py resnet50 --json "$OUT/correctness.json"
  step train_resnet50 200 python -m ember.cli bench resnet50 --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_resnet50.json"
  EMBER_DEBUG_DIR="$OUT/debug_resnet50" step profile_resnet50 120 python benchmarks/scripts/gpu_profile.py resnet50 \
    --backend ember --keep 0 --top 30 --no-trace --out "$OUT/profile_resnet50"
  find "$OUT/debug_resnet50" -type f ! -path '*/kernels/*' ! -name 'plan.txt' -delete 2>/dev/null
  ;;
25)  # peak memory of the other five seed models after first calls got pools of their own (fresh
     # process per backend), inference peak memory, and where vgg16's compile goes (cProfile,
     # after a tiny Inductor compile as in the suite)
  step memory_train 330 python benchmarks/scripts/gpu_memory.py vgg16 bert mobilenet_v3 densenet121 resnet50v2 \
    --backends eager,ember --json "$OUT/memory_train.json"
  step memory_infer 130 python benchmarks/scripts/gpu_memory.py bert vgg16 mobilenet_v3 --mode infer --backends eager,ember \
    --json "$OUT/memory_infer.json"
  step compile_cprofile 90 python benchmarks/scripts/gpu_compile_profile.py vgg16 --after-inductor \
    --cprofile "$OUT/cprofile" --json "$OUT/compile_cprofile.json"
  ;;
26)  # what part 25 could not finish: resnet50v2's Ember training peak, and inference peaks
  step memory_train 120 python benchmarks/scripts/gpu_memory.py resnet50v2 --backends ember --json "$OUT/memory_train.json"
  step memory_infer 420 python benchmarks/scripts/gpu_memory.py mobilenet_v3 style_transfer resnet50v2 densenet121 \
    --mode infer --backends eager,ember --json "$OUT/memory_infer.json"
  ;;
27)  # inference graphs in pools of their own (measured, pre-sized, released): inference peaks of
     # the two models over eager's in part 26, then bert infer bs1 latency and inference correctness
  step memory_infer 260 python benchmarks/scripts/gpu_memory.py mobilenet_v3 densenet121 cyclegan resnet50 --mode infer \
    --backends ember --json "$OUT/memory_infer.json"
  step infer_bert_bs1 110 python -m ember.cli bench bert --mode infer --batch 1 --precision bf16 \
    --no-progress --json "$OUT/bench_infer_bert_bs1.json"
  step correctness 150 python benchmarks/scripts/gpu_correctness.py mobilenet_v3 densenet121 --json "$OUT/correctness.json"
  ;;
28)  # cuBLAS workspaces handed back after first calls and captures, moving read-only inputs copied
     # into the graph's pool: inference peaks of the two models over eager's (traced), training
     # peaks and correctness after the change, and vgg16's passes timed one by one (and profiled)
  step memory_infer 240 python benchmarks/scripts/gpu_memory.py mobilenet_v3 densenet121 --mode infer --backends ember \
    --trace ember --json "$OUT/memory_infer.json"
  step compile_passes 80 python benchmarks/scripts/gpu_compile_profile.py vgg16 --after-inductor \
    --profile-passes "$OUT/passes_profile" --json "$OUT/compile_passes.json"
  step memory_train 150 python benchmarks/scripts/gpu_memory.py resnet50 cyclegan --backends ember --json "$OUT/memory_train.json"
  step correctness 110 python benchmarks/scripts/gpu_correctness.py resnet50 mobilenet_v3 --json "$OUT/correctness.json"
  ;;
29)  # the layout pass's incremental sweep: vgg16's cold compile against Inductor's in the suite's
     # setting and its passes; the CUDA-graph training check (pooled input buffers); inference peaks
     # of the six other seed models after part 28's changes
  step train_vgg16 150 python -m ember.cli bench vgg16 --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_vgg16.json"
  step compile_passes 70 python benchmarks/scripts/gpu_compile_profile.py vgg16 --after-inductor --json "$OUT/compile_passes.json"
  step cudagraph_check 150 python benchmarks/scripts/gpu_cudagraph_check.py --json "$OUT/cudagraph_check.json"
  step memory_infer 300 python benchmarks/scripts/gpu_memory.py cyclegan style_transfer resnet50 bert vgg16 resnet50v2 \
    --mode infer --backends ember --json "$OUT/memory_infer.json"
  ;;
30)  # resnet18's training check ("together" failed in part 29): as is, without pooled input buffers,
     # without handing back cuBLAS workspaces; vgg16's precompiled kernels missed at launch after
     # Inductor: which metadata differs between the two compiles (with and without Inductor first)
  step check_now 100 python benchmarks/scripts/gpu_cudagraph_check.py --only train --train-models resnet18 \
    --json "$OUT/check_now.json"
  EMBER_POOLED_INPUTS=0 step check_no_pooled 100 python benchmarks/scripts/gpu_cudagraph_check.py --only train \
    --train-models resnet18 --json "$OUT/check_no_pooled.json"
  EMBER_CLEAR_WORKSPACES=0 step check_no_clear 100 python benchmarks/scripts/gpu_cudagraph_check.py --only train \
    --train-models resnet18 --json "$OUT/check_no_clear.json"
  step compile_after_inductor 70 python benchmarks/scripts/gpu_compile_profile.py vgg16 --after-inductor \
    --json "$OUT/compile_after_inductor.json"
  step compile_alone 70 python benchmarks/scripts/gpu_compile_profile.py vgg16 --json "$OUT/compile_alone.json"
  ;;
31)  # pooled input buffers that clash with inputs in a shared pool move out of it; workers use the
     # parent's ptxas: the CUDA-graph check, vgg16's launch misses after Inductor, vgg16's compile
  step cudagraph_check 150 python benchmarks/scripts/gpu_cudagraph_check.py --json "$OUT/cudagraph_check.json"
  step compile_after_inductor 70 python benchmarks/scripts/gpu_compile_profile.py vgg16 --after-inductor \
    --json "$OUT/compile_after_inductor.json"
  step train_vgg16 150 python -m ember.cli bench vgg16 --mode train --precision bf16 --iters 20 \
    --no-progress --json "$OUT/bench_train_vgg16.json"
  ;;
32)  # the layout pass on the device, node by node (vgg16, resnet50)
  step layout_vgg16 80 python benchmarks/scripts/gpu_layout_timing.py vgg16 --json "$OUT/layout_vgg16.json"
  step layout_resnet50 100 python benchmarks/scripts/gpu_layout_timing.py resnet50 --json "$OUT/layout_resnet50.json"
  ;;
33)  # after pooled input buffers and cuBLAS workspaces handed back: every seed model's training peak
     # under Ember (fresh process each), then bert inference at batch 1
  step memory_train 420 python benchmarks/scripts/gpu_memory.py resnet50 bert vgg16 mobilenet_v3 densenet121 resnet50v2 \
    cyclegan style_transfer --backends ember --json "$OUT/memory_train.json"
  step infer_bert_bs1 110 python -m ember.cli bench bert --mode infer --batch 1 --precision bf16 \
    --no-progress --json "$OUT/bench_infer_bert_bs1.json"
  ;;
34)  # where the time goes (top kernels, library vs generated share), Ember and Inductor, for the two
     # models with the longest Inductor compiles (each its own step: together they passed 110 s)
  for m in mobilenet_v3 densenet121; do
    limit=230; [ "$m" = densenet121 ] && limit=330
    step "profile_$m" "$limit" python benchmarks/scripts/gpu_profile.py "$m" --backend ember,inductor --keep 0 --top 15 \
      --no-trace --out "$OUT/profile_$m"
  done
  ;;
35)  # where the time goes for the other five seed models (resnet50 in session 8)
  for m in resnet50v2 cyclegan vgg16 bert style_transfer; do
    step "profile_$m" 110 python benchmarks/scripts/gpu_profile.py "$m" --backend ember,inductor --keep 0 --top 15 \
      --no-trace --out "$OUT/profile_$m"
  done
  ;;
36)  # reflection padding in Ember's gather kernels: the kernels against ATen's, the two padded models
     # in the suite's setting (eager, Inductor, Ember in one run), their correctness, their cold compile
  step window_kernels 90 python benchmarks/scripts/gpu_window_kernels.py --json "$OUT/window_kernels.json"
  step train_cyclegan_style 200 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_cyclegan_style.json"
  step correctness 150 python benchmarks/scripts/gpu_correctness.py cyclegan style_transfer --json "$OUT/correctness.json"
  step compile_profile 110 python benchmarks/scripts/gpu_compile_profile.py cyclegan style_transfer --after-inductor \
    --json "$OUT/compile_profile.json"
  tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/" && find "$OUT" -type f ! -name results.tgz ! -name '*.log' -delete
  ;;
37)  # where the time goes after part 36 (the profile script no longer counts the optimizer's GPU range twice)
  for m in cyclegan style_transfer vgg16; do
    step "profile_$m" 110 python benchmarks/scripts/gpu_profile.py "$m" --backend ember,inductor --keep 0 --top 15 \
      --no-trace --out "$OUT/profile_$m"
  done
  tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/" && find "$OUT" -type f ! -name results.tgz -delete
  ;;
38)  # style_transfer's cold compile after cyclegan's in one process (22.3 s in part 36, its first run
     # 18.5 s): launch compiles and waits per model, with Ember's padding kernels and with ATen's
  fresh() { export EMBER_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
  fresh; step sequence 200 python benchmarks/scripts/gpu_compile_sequence.py cyclegan style_transfer --json "$OUT/sequence.json"
  fresh; EMBER_REFLECTION_PAD=0 step sequence_aten_pad 200 python benchmarks/scripts/gpu_compile_sequence.py cyclegan \
    style_transfer --json "$OUT/sequence_aten_pad.json"
  ;;
39)  # padding kernels compiled with the graph's kernels (from the layout the passes chose): the two padded
     # models in the suite's setting, cyclegan's launch compiles, and where the time goes (vgg16 too)
  step train_cyclegan_style 200 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_train_cyclegan_style.json"
  step compile_profile 70 python benchmarks/scripts/gpu_compile_profile.py cyclegan --after-inductor --json "$OUT/compile_profile.json"
  for m in cyclegan style_transfer vgg16; do
    step "profile_$m" 100 python benchmarks/scripts/gpu_profile.py "$m" --backend ember,inductor --keep 0 --top 15 \
      --no-trace --out "$OUT/profile_$m"
  done
  tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/" && find "$OUT" -type f ! -name results.tgz -delete
  ;;
40)  # style_transfer's first run took 18.5 s in part 36's and 39's bench (after cyclegan, default cache
     # folders) but not in part 38 (fresh folders named in the environment): the bench as in the suite,
     # with kernel-compile notes, with Ember's padding kernels and with ATen's, caches cleared before each
  clear() { rm -rf ~/.triton/cache ~/.cache/ember /tmp/torchinductor_* 2>/dev/null; }
  clear; DEBUG=1 step bench_debug 220 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 5 --no-progress --json "$OUT/bench_debug.json"
  grep -E "kernel compile of|precompile:" "$OUT/bench_debug.log" | cut -c1-300 | tail -12
  clear; EMBER_REFLECTION_PAD=0 step bench_aten_pad 220 python -m ember.cli bench cyclegan style_transfer --mode train \
    --precision bf16 --iters 5 --no-progress --json "$OUT/bench_aten_pad.json"
  grep -E "│ (cyclegan|style)" "$OUT/bench_aten_pad.log"
  ;;
41)  # the bench of part 40 (20 timed steps) with the compiles at each first call's launches counted
  rm -rf ~/.triton/cache ~/.cache/ember /tmp/torchinductor_* 2>/dev/null
  step bench_launch 220 python -m ember.cli bench cyclegan style_transfer --mode train --precision bf16 \
    --iters 20 --no-progress --json "$OUT/bench_launch.json"
  python -c "import json; [print(r['model'], r['backend'], round(r['compile_s'], 2), json.dumps(r.get('launch_compiles'))[:600]) for r in json.load(open('$OUT/bench_launch.json'))['results']]"
  ;;
esac
