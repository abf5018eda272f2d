"""Host time of each call after the first: does a batch-1 call get faster as the process settles?

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_host_after_compile.py bert resnet50 --out $OUT

``ember bench`` times 30 steps after 10 warm-up steps; a profile of 200 steps after 6 found
Ember's batch-1 host time less than half the bench's. For each model and backend (bf16 autocast,
inference, batch 1), the first call, then ``--calls`` calls each timed on the host (call until
return, before the synchronisation), medians over windows of calls since the first. With
``--gc`` the run is repeated after ``gc.collect(); gc.freeze()`` (the compile's objects moved out
of the collector's sight). Rows in ``host_after_compile.json``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_host_profile import bench_step, each_case, time_steps  # noqa: E402 - the script's sibling

WINDOWS = ((1, 10), (11, 40), (41, 100), (101, 200), (201, 400), (401, 1000))


def windows(host_us: list[float]) -> dict[str, float]:
    return {f"{a}-{b}": statistics.median(host_us[a - 1:b]) for a, b in WINDOWS if len(host_us) >= b}


def measure(name: str, backend: str, calls: int, freeze: bool) -> dict:
    step, batches = bench_step(name, backend, "infer", 1)
    t0 = time.perf_counter()
    step(*batches[0])
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    host, wall = ([t * 1e6 for t in ts] for ts in time_steps(step, batches, calls))
    row = {"model": name, "backend": backend, "first_call_s": first_s, "host_us": windows(host),
           "step_us": windows(wall), "gc_counts": gc.get_count(), "gc_tracked": len(gc.get_objects())}
    if freeze:
        gc.collect()
        gc.freeze()
        host2 = [t * 1e6 for t in time_steps(step, batches, calls)[0]]
        row["host_us_after_freeze"] = windows(host2)
        gc.unfreeze()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,inductor-cudagraphs")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--gc", action="store_true")
    parser.add_argument("--out", default="host_after_compile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def one(name: str, backend: str) -> tuple[dict, str]:
        row = measure(name, backend, args.calls, args.gc)
        text = (f"== {name} {backend}: first {row['first_call_s']:.2f} s; host us by calls since: "
                + ", ".join(f"{k} {v:.0f}" for k, v in row["host_us"].items())
                + "; step us: " + ", ".join(f"{k} {v:.0f}" for k, v in row["step_us"].items()))
        if "host_us_after_freeze" in row:
            text += "\n   after gc.freeze: " + ", ".join(f"{k} {v:.0f}" for k, v in row["host_us_after_freeze"].items())
        return row, text

    each_case(args.models, args.backend, one, out / "host_after_compile.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
