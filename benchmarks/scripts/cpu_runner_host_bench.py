"""Host time of the CUDA-graph runner's call on the CPU, the replay itself stubbed out.

    python benchmarks/scripts/cpu_runner_host_bench.py [N]

A program of N parameters (default 320, ResNet-50's parameters and buffers) plus one batch input,
with parameter-only values (``FrozenValues``) as a frozen inference program has, run through
``CudaGraphRunner`` on the tests' CPU stand-in for CUDA graphs (``tests/support/cudagraph_fakes.py``)
whose replay does nothing: what remains is the runner's own work before and after a replay (the
address checks, the frozen values' check, the input copy, handing out the output). Prints
microseconds per call (median of 7 runs of 2,000 calls) and the two checks alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from cudagraph_fakes import FakeGraphs  # noqa: E402 - the tests' stand-in

from ember.runtime.cudagraphs.runner import CudaGraphRunner  # noqa: E402
from ember.runtime.frozen import FrozenValues  # noqa: E402


class NoReplay(FakeGraphs):
    def replay(self, graph: object, args: list) -> None:
        pass


def per_call_us(fn, calls: int = 2000, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(n: int) -> None:
    params = [torch.randn(8) for _ in range(n)]
    frozen = FrozenValues()
    inputs = tuple(range(n))

    def prepare(*ps: torch.Tensor) -> tuple:
        return (torch.stack(ps[:4]).sum(0),)

    def run(args: list) -> torch.Tensor:
        (w,) = frozen(prepare, *args[:n])
        out = args[n] * w
        args.clear()
        return out

    def refresh_frozen(args: list, addresses_known: bool = False) -> bool:
        if not hasattr(frozen, "get"):  # Ember before 702082b (PYTHONPATH at an older source)
            return frozen.refresh(prepare, *[args[i] for i in inputs])
        return frozen.refresh(prepare, [args[i] for i in inputs], addresses_known)

    refresh_frozen.inputs = inputs  # type: ignore[attr-defined]
    run.refresh_frozen = refresh_frozen  # type: ignore[attr-defined]
    runner = CudaGraphRunner(run, "bench", backend=NoReplay())
    x = torch.randn(8)
    for _ in range(5):
        runner(params + [torch.randn(8)])
    assert runner.replays >= 2, runner.status
    print(f"N={n}: runner call {per_call_us(lambda: runner(params + [x])):.1f} us; "
          f"frozen check {per_call_us(lambda: refresh_frozen(params + [x])):.1f} us "
          f"(versions only {per_call_us(lambda: refresh_frozen(params + [x], True)):.1f}); "
          f"runner check {per_call_us(lambda: runner._check(params + [x])):.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 320)
