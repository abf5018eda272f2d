"""One generated kernel run on its own: inputs from its graph's shapes, the check of a candidate
against the default configuration's output, and timing.

Every candidate is checked before it may be chosen: the default kernel and the candidate run on
the same fresh random inputs (new for every kernel), and every output must match within the
dtype's tolerance (NaN where the reference has NaN). Outputs start as NaN (float) or a sentinel,
so a candidate that skips elements fails too. Timing: on CUDA one CUDA graph of back-to-back
launches per candidate (launch noise removed), the candidates' graphs replayed in turn; on CPU the
median of ``perf_counter`` timings after a warm-up, candidates in turn too.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ember.codegen.kernel_source import KernelSource
from ember.runtime import library_warmup
from ember.targets import Target

# Test seam: called as hook(kernel, outputs) after a *candidate* (not the reference) runs; a test
# corrupts outputs here to show that a wrong candidate is rejected and recorded as failed.
_OUTPUT_HOOKS: list[Callable[[KernelSource, list[torch.Tensor]], None]] = []


@contextlib.contextmanager
def candidate_output_hook(hook: Callable[[KernelSource, list[torch.Tensor]], None]) -> Iterator[None]:
    _OUTPUT_HOOKS.append(hook)
    try:
        yield
    finally:
        _OUTPUT_HOOKS.remove(hook)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.bfloat16,):
        return 2e-2, 2e-2
    if dtype == torch.float16:
        return 5e-3, 5e-3
    return 1e-4, 1e-5  # float32: a different block size sums in a different order


class KernelRun:
    """Arguments and launching for kernels of one group (default and candidates share the arguments)."""

    def __init__(self, default: KernelSource, target: Target, kernel_dir: Path, seed: int) -> None:
        self.target, self.kernel_dir = target, kernel_dir
        self.device = torch.device("cuda" if target.runs_on_cuda else "cpu")
        gen = torch.Generator().manual_seed(seed)
        self.inputs = [self._input(a.meta["val"], gen) for a in default.args[:default.n_inputs]]
        self.n_outputs = len(default.args) - default.n_inputs
        self.out_meta = [a.meta["val"] for a in default.args[default.n_inputs:]]

    def _input(self, val: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        storage = _storage_numel(val)
        if val.dtype.is_floating_point:
            base = torch.randn(storage, generator=gen).to(val.dtype)
        elif val.dtype == torch.bool:
            base = torch.rand(storage, generator=gen) < 0.5
        else:
            base = torch.randint(0, 2, (storage,), generator=gen).to(val.dtype)
        return base.to(self.device).as_strided(tuple(val.shape), tuple(val.stride()))

    def fresh_outputs(self) -> list[torch.Tensor]:
        outs = []
        for val in self.out_meta:
            fill = float("nan") if val.dtype.is_floating_point else (True if val.dtype == torch.bool else 77)
            base = torch.full((_storage_numel(val),), fill, dtype=val.dtype, device=self.device)
            outs.append(base.as_strided(tuple(val.shape), tuple(val.stride())))
        return outs

    def launcher(self, ks: KernelSource) -> Callable[[list[torch.Tensor]], None]:
        """A function running ``ks`` (and its partial-result kernels) into the given outputs."""
        if ks.backend == "cpu":
            fn = self.target.load(ks, self.kernel_dir)
            return lambda outs: fn(*self.inputs, *outs)
        fns = [(self.target.load(k, self.kernel_dir), k) for k in ks.launch_order()]
        workspace = (torch.empty(ks.workspace, dtype=torch.float32, device=self.device) if ks.workspace else None)

        def run(outs: list[torch.Tensor]) -> None:
            extra = [workspace] if workspace is not None else []
            for fn, k in fns:
                fn[(k.grid,)](*self.inputs, *outs, *extra, **k.meta)
        return run

    def outputs_of(self, ks: KernelSource, candidate: bool) -> list[torch.Tensor]:
        outs = self.fresh_outputs()
        self.launcher(ks)(outs)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if candidate:
            for hook in list(_OUTPUT_HOOKS):
                hook(ks, outs)
        return outs


def _storage_numel(val: torch.Tensor) -> int:
    if val.numel() == 0:
        return 1
    return 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()) if size > 0)


def mismatch(reference: list[torch.Tensor], got: list[torch.Tensor]) -> str:
    """Why ``got`` differs from ``reference`` ("" when every output matches)."""
    for i, (ref, out) in enumerate(zip(reference, got)):
        if ref.dtype.is_floating_point:
            rtol, atol = _tolerance(ref.dtype)
            if ref.dtype == torch.float32 and ref.numel():
                # A long reduction summed in another order moves a result near zero by about
                # eps * sqrt(n) * the size of its terms, which no per-element rtol covers (resnet50's
                # batch-norm gradient sums over 401,408 elements failed 1e-5): allow an error of
                # 1e-5 of the output's largest magnitude, far below what a wrong kernel gives.
                atol = max(atol, 1e-5 * float(ref.abs().nan_to_num(0.0, 0.0, 0.0).max()))
            if not torch.allclose(out.float(), ref.float(), rtol=rtol, atol=atol, equal_nan=True):
                bad = ~torch.isclose(out.float(), ref.float(), rtol=rtol, atol=atol, equal_nan=True)
                return (f"output {i}: {int(bad.sum())} of {ref.numel()} elements differ "
                        f"(max abs diff {float((out.float() - ref.float()).abs().nan_to_num(float('inf')).max()):.3g})")
        elif not torch.equal(out, ref):
            return f"output {i}: {int((out != ref).sum())} of {ref.numel()} elements differ"
    return ""


def _cuda_graph_times(runs: list[Callable[[], None]], budget_s: float, rounds: int) -> list[float]:
    """Per run: a CUDA graph of enough back-to-back launches to take about its share of the
    budget per replay (launch overhead removed), replayed once per round in turn with the others;
    the median over rounds of (replay time / launches). triton's do_bench_cudagraph replays one
    graph ten times with ``rep`` milliseconds each: a 0.2 s budget became 2 s per candidate."""
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_replay_ms = max(0.5, budget_s * 1e3 / (rounds * len(runs)))
    graphs: list[tuple[torch.cuda.CUDAGraph, int]] = []
    with torch.cuda.stream(stream):
        for run in runs:
            run()  # warm-up: loads the kernel, allocates nothing later launches need
            start.record()
            for _ in range(3):
                run()
            end.record()
            end.synchronize()
            launches = max(1, min(2000, int(per_replay_ms / max(start.elapsed_time(end) / 3, 1e-4))))
            graph = torch.cuda.CUDAGraph()
            library_warmup.join_all()  # a global-mode capture: no other thread may touch the device
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(launches):
                    run()
            graphs.append((graph, launches))
        samples: list[list[float]] = [[] for _ in runs]
        for _ in range(rounds):
            for i, (graph, launches) in enumerate(graphs):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                samples[i].append(start.elapsed_time(end) / launches)
    return [statistics.median(s) for s in samples]


def _event_times(runs: list[Callable[[], None]], budget_s: float, rounds: int) -> list[float]:
    """Per run: the median over rounds of (device time of back-to-back calls / calls), the runs
    taken in turn each round, nothing captured. For whole compiled models: a model replays CUDA
    graphs of its own, and capturing its calls into another graph recorded an empty graph (torch's
    warning, bert's whole-model check on an H100); the host time it spends per call is part of what
    its user pays too."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_round_ms = max(0.5, budget_s * 1e3 / (rounds * len(runs)))
    calls = []
    for run in runs:
        run()  # warm-up
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        calls.append(max(1, min(200, int(per_round_ms / max(start.elapsed_time(end), 1e-3)))))
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls[i]):
                run()
            end.record()
            end.synchronize()
            samples[i].append(start.elapsed_time(end) / calls[i])
    return [statistics.median(s) for s in samples]


def time_interleaved_ms(runs: list[Callable[[], None]], device: torch.device, budget_s: float = 0.2,
                        rounds: int = 5, capture: bool = True) -> list[float]:
    """The times of ``runs`` (ms), measured in turn so that a burst of load from elsewhere on a
    shared machine falls on every candidate alike: ``rounds`` rounds, each timing every run a few
    times and keeping its fastest; the result per run is the median of its rounds. On the GPU each
    run is captured into a CUDA graph of back-to-back calls (launch overhead removed); ``capture``
    False times the calls uncaptured (whole compiled models, ``_event_times``)."""
    if not runs:
        return []
    if device.type == "cuda" and not capture:
        return _event_times(runs, budget_s, rounds)
    if device.type == "cuda":
        try:
            return _cuda_graph_times(runs, budget_s, rounds)
        except Exception:  # noqa: BLE001 - capture not possible here: plain event timing, one by one
            from triton.testing import do_bench
            torch.cuda.synchronize()
            return [float(do_bench(run, warmup=5, rep=max(10, int(budget_s * 1000 / len(runs))))) for run in runs]
    once = []
    for run in runs:
        run()  # warm-up
        t0 = time.perf_counter()
        run()
        once.append(max(time.perf_counter() - t0, 1e-7))
    reps = [int(min(50, max(1, budget_s / rounds / t))) for t in once]
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            best = float("inf")
            for _ in range(reps[i]):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
            samples[i].append(best)
    return [statistics.median(s) * 1e3 for s in samples]
