"""Autocast's weight casts one kernel each against one multi-tensor copy, inside a CUDA graph.

Run on the device (from the repo root):
    python benchmarks/scripts/gpu_cast_batches.py swin_t resnet50 bert mobilenet_v3_large

For each model, the weights and biases of its Linear and Conv2d layers (what bf16 autocast casts
before each matmul and convolution), cast float32 -> bf16 four ways, each captured in one CUDA
graph and replayed 200 times (the microseconds per replay): ``copy_`` into kept buffers one by
one, ``.to`` one by one, one ``torch._foreach_copy_`` into kept buffers, and fresh buffers plus one
``_foreach_copy_`` (what ``schedule/batched_casts.py`` makes the program do). Also how many kernels
the foreach copy launches (the profiler's CUDA events).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torchvision
from gpu_rnn_graphs import captured_replay  # the script's sibling: one CUDA graph of fn, replayed


def cast_inputs(name: str) -> list[torch.Tensor]:
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        model: torch.nn.Module = BertForMaskedLM(BertConfig())
    else:
        model = getattr(torchvision.models, name)()
    model = model.cuda()
    return [p for mod in model.modules() if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d))
            for p in mod.parameters(recurse=False)]


def graph_us(fn: Callable[[], object], reps: int = 200) -> float:
    replay = captured_replay(fn)
    for _ in range(10):
        replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def four_ways(params: list[torch.Tensor]) -> list[Callable[[], object]]:
    """The casts of ``params`` one kernel each (copy_, .to) and in one foreach copy (kept, fresh)."""
    kept = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]

    def each_copy() -> None:
        for out, p in zip(kept, params):
            out.copy_(p)

    def each_to() -> list[torch.Tensor]:
        return [p.to(torch.bfloat16) for p in params]

    def foreach() -> None:
        torch._foreach_copy_(kept, params)

    def foreach_fresh() -> list[torch.Tensor]:
        out = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        torch._foreach_copy_(out, params)
        return out

    return [each_copy, each_to, foreach, foreach_fresh]


def main(names: list[str]) -> None:
    for name in names:
        params = cast_inputs(name)
        ways = four_ways(params)
        times = [graph_us(f) for f in ways]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ways[2]()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        moved_mb = sum(p.numel() for p in params) * 6 / 1e6
        print(f"{name}: {len(params)} casts, {moved_mb:.1f} MB moved; graph replay us: copy_ each {times[0]:.1f}, "
              f".to each {times[1]:.1f}, foreach {times[2]:.1f}, foreach+alloc {times[3]:.1f}; foreach kernels "
              f"{len(kernels)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["swin_t", "resnet50", "bert", "mobilenet_v3_large"])
