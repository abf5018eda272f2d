"""The CUDA-graph runners' own host work per training step of a torchvision model, on the CPU.

    python benchmarks/scripts/cpu_training_runner_bench.py densenet121 resnet50 [--steps 20]

Per-graph Ember (``ember.compile``, target aten, CUDA graphs on) trains the model at batch 2 on
32x32 images with SGD and momentum, its forward and backward programs going through
``CudaGraphRunner`` on the tests' CPU stand-in for CUDA graphs (``tests/support/cudagraph_fakes.py``),
whose replay runs the program. Timers around the runner's call, its ``_check`` and the stand-in's
replay give, per step, the runner's own work (call minus replay): the address checks, the held-
output and overwrite checks, the copies in and the outputs handed out. On a GPU the same work
is host time before and after each replay.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from cudagraph_fakes import FakeGraphs, graphs_on_cpu_rule  # noqa: E402 - the tests' stand-in

import ember  # noqa: E402
from ember.instruments import instrument  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_host_layers import wrap_timer  # noqa: E402 - the script's sibling: a timer around a named function

LAYERS = ["ember.runtime.cudagraphs.runner:CudaGraphRunner.__call__",
          "ember.runtime.cudagraphs.runner:CudaGraphRunner._check", "cudagraph_fakes:FakeGraphs.replay"]


def measure(name: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    backend = FakeGraphs()
    with instrument(cudagraph_device=backend, capture_rule=graphs_on_cpu_rule):
        compiled = ember.compile(model, target="aten", cudagraphs=True, cache=False)

        def step() -> None:
            torch.nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(4):
            step()
        times: dict[str, list[float]] = defaultdict(list)
        wrapped = [w for p in LAYERS if (w := wrap_timer(p, times)) is not None]
        try:
            wall = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                wall.append(time.perf_counter() - t0)
        finally:
            for owner, attr, original in wrapped:
                setattr(owner, attr, original)
        statuses = [g.cudagraph for g in compiled._ember_backend.log.graphs]
    times = {k.rsplit(".", 1)[-1]: v for k, v in times.items()}  # __call__, _check, replay (microseconds)
    per_step = {k: sum(v) / steps / 1e3 for k, v in times.items()}
    return {"model": name, "steps": steps, "step_ms_median": statistics.median(wall) * 1e3,
            "runner_own_ms_per_step": per_step["__call__"] - per_step["replay"], "check_ms_per_step": per_step["_check"],
            "runner_calls_per_step": len(times["__call__"]) / steps, "graphs": statuses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for name in args.models:
        row = measure(name, args.steps)
        print(f"{name}: runner's own work {row['runner_own_ms_per_step']:.3f} ms a step "
              f"(its _check {row['check_ms_per_step']:.3f}; {row['runner_calls_per_step']:.0f} runner calls), "
              f"step {row['step_ms_median']:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
