"""Where a step's host time goes: Python's profiler over steps of one backend.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_host_profile.py densenet121 resnet50 --backend ember,inductor-cudagraphs --out $OUT

For each model and backend (bf16 autocast, SGD with momentum, the bench's own step): the median
host time inside the step call and the synchronised step time over ``--steps`` steps, then
``cProfile`` over the same number of steps: the functions with the most time of their own and
the most time including callees, as text (``host_<model>_<backend>.txt``), and one summary line
per run in ``host_profile.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ember.bench import harness, models


def bench_step(name: str, backend: str, mode: str = "train", batch: int | None = None) -> tuple:
    """The bench's step of ``name`` under ``backend`` on the GPU (bf16, SGD with momentum when
    training) and two batches for it."""
    device = torch.device("cuda")
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).train(mode == "train")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if mode == "train" else None
    step, _ = harness._backend_step(case, backend, model, mode, "bf16", device, opt)
    return step, models.make_batches(case, batch or case.default_batch(mode), device, count=2)


def time_steps(step: Callable[..., object], batches: list, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each step's call until it returns (host) and until the device is done (wall)."""
    host, wall = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        step(*batches[i % 2])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return host, wall


def profile_case(name: str, backend: str, steps: int, top: int, mode: str = "train",
                 batch: int | None = None, dump: Path | None = None) -> tuple[dict, str]:
    case = models.get_case(name)
    step, batches = bench_step(name, backend, mode, batch)
    t0 = time.perf_counter()
    for i in range(6):
        step(*batches[i % 2])
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    host, wall = ([t * 1e3 for t in ts] for ts in time_steps(step, batches, steps))
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(*batches[i % 2])
        torch.cuda.synchronize()
    prof.disable()
    if dump is not None:
        prof.dump_stats(dump)  # the whole profile, for pstats or snakeviz
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"== {name} {mode} bs{batch or case.default_batch(mode)} {backend}: host {statistics.median(host):.2f} ms, "
               f"step {statistics.median(wall):.2f} ms (median of {steps})\n-- by own time\n")
    stats.sort_stats("tottime").print_stats(top)
    text.write("-- by time with callees\n")
    stats.sort_stats("cumulative").print_stats(top)
    row = {"model": name, "mode": mode, "batch": batch or case.default_batch(mode), "backend": backend, "host_ms_median": statistics.median(host),
           "ms_median": statistics.median(wall), "warmup_s": warm_s, "steps": steps}
    return row, text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,inductor-cudagraphs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's for the mode)")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", default="host_profile")
    parser.add_argument("--dump", action="store_true", help="also write each run's whole profile (.prof)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = iter(range(1000))

    def one(name: str, backend: str) -> tuple[dict, str]:
        stem = f"host_{name}_{args.mode}_{backend}_{next(runs)}"  # numbered: a backend may run twice
        row, text = profile_case(name, backend, args.steps, args.top, args.mode, args.batch,
                                 out / f"{stem}.prof" if args.dump else None)
        (out / f"{stem}.txt").write_text(text)
        return row, text.split("\n", 1)[0]

    each_case(args.models, args.backend, one, out / "host_profile.json")
    return 0


def each_case(models: list[str], backends: str, one: Callable[[str, str], tuple[dict, str]], json_path: Path) -> None:
    """``one(model, backend)`` -> (row, text to print) for every model and backend, the rows
    rewritten to ``json_path`` after each; a failed case is a row with its error."""
    rows = []
    for name in models:
        for backend in backends.split(","):
            try:
                row, text = one(name, backend)
            except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
                row = {"model": name, "backend": backend, "error": repr(err)[:500]}
                text = f"{name} {backend}: {row['error']}"
            rows.append(row)
            print(text, flush=True)
            json_path.write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
