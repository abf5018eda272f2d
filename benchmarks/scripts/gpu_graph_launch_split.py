"""What a CUDA graph's launch costs the host, and whether cutting one graph into several lets the
device start sooner.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_graph_launch_split.py --json $OUT/graph_launch_split.json

A step of ``K`` small kernels (in-place multiply-adds on one buffer) is captured as one graph and
as the same kernels cut into graphs of the given sizes (``--cuts``: the first graphs' kernel
counts, the last takes the rest), all in one memory pool. For each: the host time of launching
the step (the ``replay`` calls until they return), the step synchronised after each launch
(host time before the device starts + the device's time), and steps launched back to back
without synchronising (the device's time). A launch that costs the host time per kernel node
shows in the first; if the device starts only once a graph's launch returns, the synchronised
step falls when the first graph is small.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def capture(kernels: int, x: torch.Tensor, pool: object) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for _ in range(kernels // 2):
            x.mul_(0.999).add_(0.001)
    return g


def graphs_for(cuts: list[int], total: int, x: torch.Tensor) -> list[torch.cuda.CUDAGraph]:
    pool = torch.cuda.graph_pool_handle()
    sizes = [*cuts, total - sum(cuts)]
    return [capture(n, x, pool) for n in sizes]


def time_step(graphs: list[torch.cuda.CUDAGraph], steps: int) -> dict:
    host, sync = [], []
    for _ in range(5):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    for _ in range(steps):
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        sync.append((time.perf_counter() - t0) * 1e6)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        for g in graphs:
            g.replay()
    end.record()
    end.synchronize()
    return {"host_us": statistics.median(host), "sync_us": statistics.median(sync),
            "pipelined_us": start.elapsed_time(end) * 1e3 / steps}


class _StampedGraph:
    """A captured graph whose ``replay`` notes when it was called and when it returned."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.called, self.returned = graph, 0.0, 0.0

    def replay(self) -> None:
        self.called = time.perf_counter()
        self.graph.replay()
        self.returned = time.perf_counter()


def _profile_calls(step: object, batches: list, calls: int, name: str) -> None:
    """cProfile over ``calls`` synchronised step calls: the functions with the most own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for i in range(calls):
        prof.enable()
        step(*batches[i % 2])
        prof.disable()
        torch.cuda.synchronize()
    print(f"-- {name}: cProfile of {calls} step calls (own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def _guard_parts(whole: object) -> dict:
    """The replay guard's parts timed alone on this host (medians of 21 rounds of 500 calls, us per
    call): the parameter-address pass, the train-flag pass, and the train-flag check as a list of
    the modules' ``training`` attributes (what the flag pass replaced). (The whole ``holds`` is not
    timed here: called outside the bench's step wrapper it returned at its first checks.)"""
    from itertools import chain

    from ember.train.replay_guard import _DATA_PTR, _TRAINING

    g = whole.fast
    modules = whole.modules or []
    flags = list(map(_TRAINING, modules))
    parts = {
        "addresses": lambda: list(map(_DATA_PTR, chain.from_iterable(g.group_params))) == g.ptrs,
        "train flags": g.training.hold,
        "train flags as a list": lambda: list(map(_TRAINING, modules)) == flags,
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(21):
        for k, f in parts.items():
            t = time.perf_counter()
            for _ in range(500):
                f()
            times[k].append((time.perf_counter() - t) * 1e6 / 500)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["parameters"], out["modules"] = len(g.ptrs), len(modules)
    return out


def whole_step_launch(name: str, steps: int, profile_calls: int = 0) -> dict:
    """The launch of a bench model's captured whole training step (``ember-whole-step``): the host
    time of ``replay()`` alone, and of the whole step call, each synchronised; the step call cut at
    the launch (host work before ``replay()``, the launch, the work after it); and the graph's own
    device time (replays back to back between CUDA events)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_host_profile import bench_step

    step, batches = bench_step(name, "ember-whole-step")
    for i in range(12):
        step(*batches[i % 2])
    torch.cuda.synchronize()
    phase = step.whole_step.cuda.graphs["full"]
    graph = phase.graph
    launch, alone, call, sync, before, after = [], [], [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        graph.replay()
        launch.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        alone.append((time.perf_counter() - t0) * 1e6)
    stamped = phase.graph = _StampedGraph(graph)
    whole, checks = step.whole_step.cuda, []
    check = whole._check

    def timed_check(*args):  # the replay guard's share of the time before the launch
        t = time.perf_counter()
        why = check(*args)
        checks.append((time.perf_counter() - t) * 1e6)
        return why

    full_check, full_checks = whole._full_check, [0]

    def counted_full_check(*args):  # calls the last replay's guard did not answer
        full_checks[0] += 1
        return full_check(*args)

    whole._check, whole._full_check = timed_check, counted_full_check
    try:
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(*batches[i % 2])
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            call.append((t1 - t0) * 1e6)
            sync.append((t2 - t0) * 1e6)
            before.append((stamped.called - t0) * 1e6)
            after.append((t1 - stamped.returned) * 1e6)
    finally:
        phase.graph = graph
        del whole._check, whole._full_check
    guard = _guard_parts(whole)
    if profile_calls:
        _profile_calls(step, batches, profile_calls, name)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    med = statistics.median
    r = {"model": name, "replay_launch_us": med(launch), "replay_sync_us": med(alone),
         "graph_device_us": start.elapsed_time(end) * 1e3 / 20, "step_call_us": med(call),
         "step_sync_us": med(sync), "before_launch_us": med(before), "after_launch_us": med(after),
         "check_us": med(checks[-steps:]), "full_checks": full_checks[0], "guard_parts_us": guard,
         "status": step.whole_step.cuda.describe()}
    print(f"{name}: before replay() {r['before_launch_us']:.1f} us (check {r['check_us']:.1f}), replay() {r['replay_launch_us']:.1f}, after "
          f"{r['after_launch_us']:.1f}; step host time {r['step_call_us']:.1f}, synchronised step {r['step_sync_us']:.1f}, "
          f"replay alone synchronised {r['replay_sync_us']:.1f}, graph on the device {r['graph_device_us']:.1f}; "
          f"{r['full_checks']} of {steps} checks past the guard; guard parts (us, medians of 21 rounds of 500): "
          + ", ".join(f"{k} {v:.1f}" for k, v in guard.items()), flush=True)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="200,700,1500", help="kernels per step")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of the buffer each kernel updates")
    parser.add_argument("--cuts", default="none;16;64;16,200", help="';'-separated: the first graphs' kernel counts")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--models", default="", help="comma-separated bench models: time the launch of their "
                        "captured whole training step too")
    parser.add_argument("--profile-calls", type=int, default=0, help="also cProfile this many step calls per model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_rows = [whole_step_launch(name, args.steps, args.profile_calls) for name in args.models.split(",") if name]
    x = torch.randn(args.numel, device="cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, buffer of {args.numel} float32")
    print(f"{'kernels':>8} {'cuts':>10} {'graphs':>6} {'host us':>9} {'sync us':>9} {'device us':>10}")
    for total in (int(k) for k in args.kernels.split(",")):
        for cut_text in args.cuts.split(";"):
            cuts = [] if cut_text == "none" else [int(c) for c in cut_text.split(",")]
            if sum(cuts) >= total:
                continue
            graphs = graphs_for(cuts, total, x)
            r = {"kernels": total, "cuts": cuts, "graphs": len(graphs), **time_step(graphs, args.steps)}
            rows.append(r)
            print(f"{total:>8} {cut_text:>10} {len(graphs):>6} {r['host_us']:>9.1f} {r['sync_us']:>9.1f} "
                  f"{r['pipelined_us']:>10.1f}", flush=True)
            del graphs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "whole_step": model_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
