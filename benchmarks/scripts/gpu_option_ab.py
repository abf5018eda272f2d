"""One Ember environment setting at two values, each bench row in a new process, arms alternating.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_option_ab.py resnet50 mobilenet_v3 --mode train \
        --backend ember-whole-step --env EMBER_CUDNN_BENCHMARK=0,1 --rounds 2 --gpus 2 --out $OUT/ab

Each (model, value, round) is one ``ember bench`` process (the bench's own timer: host synchronised
after every step, median of 30). With ``--gpus 2`` the two values of a round run at the same time,
one per GPU, and swap GPUs from round to round, so neither value always has the same GPU. Prints
a table of step ms, compile seconds and peak reserved MiB per model and value; every row's JSON is
kept under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _bench(model: str, args: argparse.Namespace, name: str, value: str, gpu: int, out: Path,
           tag: str) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), **{name: value})
    path = out / f"{model}_{args.mode}_{name}_{value}_{tag}.json"
    cmd = [sys.executable, "-m", "ember.cli", "bench", model, "--mode", args.mode, "--backend", args.backend,
           "--json", str(path), "--no-progress"]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    log = open(out / f"{path.stem}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _row(path: Path) -> dict | None:
    try:
        rows = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r for r in rows if not r.get("error")), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--mode", default="train")
    parser.add_argument("--backend", default="ember-whole-step")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--env", required=True, help="NAME=A,B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; no new round starts after")
    args = parser.parse_args()
    name, values_text = args.env.split("=", 1)
    values = values_text.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results: dict[tuple[str, str], list[dict]] = {}
    for model in args.models:
        for rnd in range(args.rounds):
            if time.monotonic() - start > args.budget:
                print(f"budget reached: {model} round {rnd + 1} not run", flush=True)
                break
            order = values if rnd % 2 == 0 else values[::-1]
            if args.gpus >= len(values):
                procs = [(v, _bench(model, args, name, v, i, args.out, f"r{rnd + 1}")) for i, v in enumerate(order)]
                for _, p in procs:
                    p.wait()
            else:
                for v in order:
                    _bench(model, args, name, v, 0, args.out, f"r{rnd + 1}").wait()
            for v in values:
                row = _row(args.out / f"{model}_{args.mode}_{name}_{v}_r{rnd + 1}.json")
                if row is not None:
                    results.setdefault((model, v), []).append(row)
            print(f"{model} round {rnd + 1} done at {time.monotonic() - start:.0f} s", flush=True)
    print(f"\n{name}: {args.mode}, {args.backend}; step ms (median of each process), compile s, peak reserved MiB")
    print(f"| model | {' | '.join(f'{name}={v}' for v in values)} | ratio {values[0]}/{values[-1]} |")
    print("|---|" + "---|" * (len(values) + 1))
    for model in args.models:
        cells, medians = [], []
        for v in values:
            rows = results.get((model, v), [])
            if not rows:
                cells.append("-")
                continue
            ms = [r["ms_median"] for r in rows]
            medians.append(statistics.median(ms))
            cells.append(", ".join(f"{m:.2f}" for m in ms) + " ms; compile "
                         + ", ".join(f"{r.get('compile_s') or 0:.1f}" for r in rows) + " s; "
                         + ", ".join(f"{(r.get('peak_reserved_bytes') or 0) / 2**20:,.0f}" for r in rows) + " MiB")
        ratio = f"{medians[0] / medians[-1]:.3f}" if len(medians) == len(values) else "-"
        print(f"| {model} | {' | '.join(cells)} | {ratio} |")


if __name__ == "__main__":
    main()
