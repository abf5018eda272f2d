"""Host time per call, layer by layer: where a batch-1 call spends its microseconds.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_host_layers.py bert resnet50 --mode infer --batch 1 --out $OUT
    PYTHONPATH=src python benchmarks/scripts/gpu_host_layers.py resnet50 --mode train --batch 128 \
        --backend ember-whole-step --out $OUT

For each model and backend (bf16 autocast, the bench's own step): the median host time of the
whole step call (until it returns, before the synchronisation) and the synchronised step time over
``--steps`` steps with no profiler attached; then the same steps again with the functions named in
``LAYERS`` wrapped by a timer (``perf_counter`` on entry and exit, no tracing of anything else),
each layer's median microseconds per step. The wrappers cost about 0.3 us each; a layer's time
includes the layers it calls. One JSON row per run in ``host_layers.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_host_profile import bench_step, each_case, time_steps  # noqa: E402 - the script's sibling

LAYERS = {
    "ember": [
        "torch.nn.modules.module:Module._wrapped_call_impl",  # the compiled model's call, all of it
        "ember.capture.backend:ShapePolicy.__enter__",
        "ember.capture.backend:ShapePolicy.__exit__",
        "ember.runtime.program:CompiledGraph.__call__",
        "ember.runtime.cudagraphs.runner:CudaGraphRunner.__call__",
        "ember.runtime.cudagraphs.runner:CudaGraphRunner._check",
        "ember.runtime.cudagraphs.runner:CudaGraphRunner._replay",
        "ember.runtime.cudagraphs.device:CudaBackend.replay",
        "ember.runtime.frozen:FrozenValues.__call__",  # the program's check (before a replay too, until 702082b)
        "ember.runtime.frozen:FrozenValues.get",  # the check since: before a replay through refresh, not __call__
        "torch._functorch._aot_autograd.runtime_wrappers:call_func_at_runtime_with_args",
        "torch.cuda.graphs:CUDAGraph.replay",
    ],
    "ember-whole-step": [
        "ember.train.step:TrainStep.__call__",
        "ember.train.capture:CudaWholeStep.run",
        "ember.train.capture:CudaWholeStep._check",
        "ember.train.capture:CudaWholeStep._full_check",
        "ember.train.capture:CudaWholeStep._replay",
        "ember.train.capture:CudaWholeStep._restore_grads",
        "torch.cuda.graphs:CUDAGraph.replay",
    ],
    "inductor-cudagraphs": [
        "torch.nn.modules.module:Module._wrapped_call_impl",
        "torch._functorch._aot_autograd.runtime_wrappers:call_func_at_runtime_with_args",
        "torch._inductor.cudagraph_trees:CUDAGraphTreeManager.run",
        "torch._inductor.cudagraph_trees:CUDAGraphNode.run",
        "torch.cuda.graphs:CUDAGraph.replay",
    ],
}


def wrap_timer(path: str, totals: dict[str, list[float]]) -> tuple[object, str, object] | None:
    """Replace ``module:Class.attr`` by a timing wrapper; (owner, attr, original) or None."""
    module_name, _, qual = path.partition(":")
    try:
        owner: object = importlib.import_module(module_name)
        *parents, attr = qual.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    except (ImportError, AttributeError, KeyError):
        return None
    if not callable(original) or isinstance(original, (staticmethod, classmethod)):
        return None
    sink = totals[qual]

    @functools.wraps(original)
    def timed(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append((time.perf_counter() - t0) * 1e6)
    setattr(owner, attr, timed)
    return owner, attr, original


def measure(name: str, backend: str, mode: str, batch: int | None, steps: int) -> dict:
    step, batches = bench_step(name, backend, mode, batch)
    for i in range(8):
        step(*batches[i % 2])
    torch.cuda.synchronize()
    host, wall = ([t * 1e6 for t in ts] for ts in time_steps(step, batches, steps))
    totals: dict[str, list[float]] = defaultdict(list)
    wrapped = [w for p in LAYERS.get(backend, []) if (w := wrap_timer(p, totals)) is not None]
    layered_host = []
    try:
        for i in range(steps):
            before = {k: len(v) for k, v in totals.items()}
            t0 = time.perf_counter()
            step(*batches[i % 2])
            layered_host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            for k, v in totals.items():  # per step: the sum of this step's calls of the layer
                n = before.get(k, 0)
                v[n:] = [sum(v[n:])] if len(v) > n else [0.0]
    finally:
        for owner, attr, original in wrapped:
            setattr(owner, attr, original)
    return {"model": name, "mode": mode, "backend": backend, "batch": batch,
            "host_us_median": statistics.median(host), "step_us_median": statistics.median(wall),
            "layered_host_us_median": statistics.median(layered_host),
            "layers_us_median": {k: statistics.median(v) for k, v in totals.items() if v}, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,inductor-cudagraphs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mode", default="infer", choices=["train", "infer"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default="host_layers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    def one(name: str, backend: str) -> tuple[dict, str]:
        row = measure(name, backend, args.mode, args.batch, args.steps)
        lines = [f"== {name} {args.mode} bs{args.batch} {backend}: host {row['host_us_median']:.1f} us, "
                 f"step {row['step_us_median']:.1f} us; with timers host {row['layered_host_us_median']:.1f}"]
        lines += [f"   {v:9.1f} us  {k}" for k, v in row["layers_us_median"].items()]
        return row, "\n".join(lines)

    each_case(args.models, args.backend, one, out / "host_layers.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
