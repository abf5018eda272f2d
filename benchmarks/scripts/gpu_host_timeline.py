"""Where an inference call's host time goes, by segment, without a profiler's overhead.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_host_timeline.py bert llama --out $OUT/timeline.json

For each model (bf16 inference at ``--batch``, default 1, under ``ember.compile``), ``--steps`` steps after a
warm-up, each synchronised; ``time.perf_counter`` stamps at a few points of every call:

- ``enter``: the compiled model's per-call context (Ember's ``ShapePolicy``) is entered: the
  model's own Python and torch's ``OptimizedModule`` call before it;
- ``program``: Ember's program is called: Dynamo's guard check and AOTAutograd's wrappers before it;
- ``runner``: the CUDA-graph runner is called: the program's own wrappers before it;
- ``checked``: the runner's check returned (addresses, held outputs, the pool's hazards);
- ``replay``: the replay begins: the frozen values' check before it;
- ``launched``: the graph has been launched;
- ``returned``: Ember's program returned (outputs handed out);
- ``done``: the step call returned (AOTAutograd's and Dynamo's way back, the model's output object);
- ``synced``: the device finished.

``--peer BACKEND`` times that backend's calls too (its ``start -> done -> synced`` only).
Prints the median of each segment in microseconds and writes every step's stamps to ``--out``.
The launch ends the host work the GPU waits for: ``start -> launched`` is what a synchronised
step adds to the graph's own GPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ember.bench import harness, models
from ember.capture import backend as capture_backend
from ember.runtime import program
from ember.runtime.cudagraphs import runner as runner_module

POINTS = ("start", "enter", "program", "runner", "checked", "replay", "launched", "returned", "done", "synced")
_stamps: dict[str, float] = {}


def _instrument() -> None:
    """Wrap the places a call passes through to stamp the time (first pass only)."""
    policy_enter = capture_backend.ShapePolicy.__enter__

    def enter(self: object) -> None:
        _stamps.setdefault("enter", time.perf_counter())
        policy_enter(self)

    capture_backend.ShapePolicy.__enter__ = enter

    graph_call = program.CompiledGraph.__call__

    def call(self: object, args: list) -> object:
        _stamps.setdefault("program", time.perf_counter())
        out = graph_call(self, args)
        _stamps["returned"] = time.perf_counter()
        return out

    program.CompiledGraph.__call__ = call

    replay = runner_module.CudaGraphRunner._replay

    def timed_replay(self: runner_module.CudaGraphRunner, args: list) -> object:
        _stamps.setdefault("replay", time.perf_counter())
        backend_replay = self.backend.replay

        def launch(graph: object, refs: list) -> None:
            backend_replay(graph, refs)
            _stamps.setdefault("launched", time.perf_counter())

        self.backend.replay = launch
        try:
            return replay(self, args)
        finally:
            del self.backend.replay

    runner_module.CudaGraphRunner._replay = timed_replay

    runner_call = runner_module.CudaGraphRunner.__call__

    def timed_call(self: runner_module.CudaGraphRunner, args: list) -> object:
        _stamps.setdefault("runner", time.perf_counter())
        return runner_call(self, args)

    runner_module.CudaGraphRunner.__call__ = timed_call

    check = runner_module.CudaGraphRunner._check

    def timed_check(self: runner_module.CudaGraphRunner, args: list) -> object:
        why = check(self, args)
        _stamps.setdefault("checked", time.perf_counter())
        return why

    runner_module.CudaGraphRunner._check = timed_check


def timeline(name: str, steps: int, warmup: int, batch: int = 1, backend: str = "ember") -> dict:
    device = torch.device("cuda")
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).eval()
    step, _ = harness._backend_step(case, backend, model, "infer", "bf16", device, None)
    batches = models.make_batches(case, batch, device, count=2)
    rows = []
    for i in range(warmup + steps):
        _stamps.clear()
        _stamps["start"] = time.perf_counter()
        step(*batches[i % 2])
        _stamps["done"] = time.perf_counter()
        torch.cuda.synchronize()
        _stamps["synced"] = time.perf_counter()
        if i >= warmup:
            rows.append(dict(_stamps))
    segments = {}
    for a, b in zip(POINTS, POINTS[1:]):
        spans = [(r[b] - r[a]) * 1e6 for r in rows if a in r and b in r]
        if spans:
            segments[f"{a}->{b}"] = statistics.median(spans)
    whole = [(r["synced"] - r["start"]) * 1e6 for r in rows]
    host = [(r["done"] - r["start"]) * 1e6 for r in rows]
    launched = [(r["launched"] - r["start"]) * 1e6 for r in rows if "launched" in r]
    return {"model": name, "backend": backend, "batch": batch, "steps": steps, "median_us": segments, "step_us": statistics.median(whole), "host_us": statistics.median(host),
            "start_to_launch_us": statistics.median(launched) if launched else None,
            "replays": len(launched), "stamps": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--peer", default=None, help="also time this backend's calls (start, done, synced only)")
    parser.add_argument("--out", default="timeline.json")
    args = parser.parse_args()
    _instrument()
    results = []
    for name in args.models:
        for backend in ["ember"] + ([args.peer] if args.peer else []):
            r = timeline(name, args.steps, args.warmup, args.batch, backend)
            results.append(r)
            segs = "  ".join(f"{k} {v:.1f}" for k, v in r["median_us"].items())
            print(f"{name} {backend}: step {r['step_us']:.1f} us, host {r['host_us']:.1f}, start->launch {r['start_to_launch_us']}, "
                  f"replayed {r['replays']}/{args.steps} | {segs}", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
