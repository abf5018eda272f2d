"""GPU time per step of models under variants of the block-size settings (config.py's
``BLOCK_SETTINGS``): which defaults the rules should take on this GPU.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_block_sweep.py resnet50 mobilenet_v3 \\
        --variant split_target_programs=1056 --variant split_target_programs=1056,xcontig_tile=8192 --out $OUT

Each model runs under the defaults and then each ``--variant`` (comma list of setting=value), as
``ember-whole-step`` training (``--mode infer``: ``ember`` inference) in bf16; torch.profiler
gives the GPU time per step (the sum of its kernels, as benchmarks/scripts/gpu_profile.py) and
the host-synchronised wall time per step. One line per run, all rows in ``block_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_host_profile import bench_step  # noqa: E402
from gpu_profile import profile_case  # noqa: E402

from ember import config  # noqa: E402


def wall_ms(name: str, backend: str, mode: str, steps: int) -> float:
    step, batches = bench_step(name, backend, mode)
    for i in range(5):
        step(*batches[i % 2])
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*batches[i % 2])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parse_variant(text: str) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        key, value = item.split("=")
        if key not in config.BLOCK_SETTINGS:
            raise SystemExit(f"{key} is not a block setting: {', '.join(config.BLOCK_SETTINGS)}")
        out[key] = int(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--variant", action="append", default=[], help="setting=value[,setting=value]")
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="block_sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = "ember-whole-step" if args.mode == "train" else "ember"
    rows = []
    for name in args.models:
        for variant in [{}] + [parse_variant(v) for v in args.variant]:
            torch._dynamo.reset()
            with config.patch(**variant):
                prof = profile_case(name, backend, args.mode, 5, out, trace=False, keep=0)
                torch._dynamo.reset()
                wall = wall_ms(name, backend, args.mode, args.steps)
            row = {"model": name, "mode": args.mode, "backend": backend, "variant": variant or "defaults",
                   "gpu_ms_per_step": prof["gpu_ms_per_step"], "launches_per_step": prof["launches_per_step"],
                   "ms_median": wall, "family_ms_per_step": prof["family_ms_per_step"]}
            rows.append(row)
            print(f"{name:<14} {str(variant or 'defaults'):<60} GPU {row['gpu_ms_per_step']:7.2f} ms  "
                  f"wall {wall:7.2f} ms  launches {row['launches_per_step']:.0f}", flush=True)
            (out / "block_sweep.json").write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
