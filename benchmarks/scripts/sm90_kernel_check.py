"""Compile every Triton kernel a GPU run of the seed models would build, for an H100 (sm_90), on a
machine without a GPU: the generated kernels (the rules' configuration and the tuner's best few)
and Ember's own ops in each model's graphs, plus every tile configuration of the tuner's tiled
matmul and attention kernels. Reports compile errors and kernels past the shared-memory limit.

    PYTHONPATH=src python benchmarks/scripts/sm90_kernel_check.py [MODEL ...] [--mode train|infer|both]
        [--batch 2] [--candidates 4] [--json OUT.json]
    PYTHONPATH=src python benchmarks/scripts/sm90_kernel_check.py --sweep core|wider [--only NAME ...]
        [--candidates 0] [--json OUT.json]

Each seed model runs one step on the Triton interpreter at full size and ``--batch`` (bf16
autocast, as the GPU suite runs) to reach its kernels; the batch changes the kernels' sizes, not
their kinds. ``--sweep`` takes the CPU sweep's models instead (benchmarks/scripts/sweep_models.py,
their small inputs, one training step where the sweep trains them, else one inference call; bf16
autocast; dropout as the model has it), one row each, a model that fails on the interpreter
reported as its row's error. ``--python PY`` compiles every kernel a second time with the Triton of
PY's environment (the GPU machine's 3.6.0: requirements-gpu-triton.txt; no torch needed there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from ember.bench import gpu_kernels, models  # noqa: E402
from ember.runtime.target_compile import H100, compile_for_target  # noqa: E402
from ember.tune.session import load_model  # noqa: E402

SEEDS = models.SEED_SUITE


PYTHONS: list[str | None] = [None]  # the children's interpreters: None is the default (--python adds)


def _row(label: str, jobs: list, seconds_collect: float) -> dict:
    row: dict = {"case": label, "kernels": len(jobs), "collect_s": round(seconds_collect, 2), "failures": [],
                 "by_triton": {}}
    for python in PYTHONS:
        t0 = time.perf_counter()
        results = compile_for_target(jobs, H100, python=python)
        version = ",".join(sorted({r.triton for r in results}))
        row["by_triton"][version] = {"compile_wall_s": round(time.perf_counter() - t0, 2),
                                     "compile_serial_s": round(sum(r.seconds for r in results), 2),
                                     "max_shared": max((r.shared or 0) for r in results) if results else 0}
        row["failures"] += [{"triton": version, "kernel": r.describe(), "problem": r.problem()}
                            for r in gpu_kernels.failures(results)]
    row["max_shared"] = max((v["max_shared"] for v in row["by_triton"].values()), default=0)
    row["triton"] = ", ".join(row["by_triton"])
    return row


def _write(path: str | None, rows: list[dict]) -> None:
    """The JSON so far (after every row: a run cut short keeps what it measured)."""
    if not path:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "target": f"{H100} (sm_90)", "cpu": platform.processor() or platform.machine(), "git_commit": commit,
           "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    Path(path).write_text(json.dumps({"env": env, "rows": rows}, indent=1))


def _sweep_rows(set_name: str, only: list[str], candidates: int, rows: list[dict], path: str | None) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    import sweep_models
    sweep_models._register_all()
    names = [n for n, c in sweep_models.REGISTRY.items() if c.group == set_name and (not only or n in only)]
    for name in names:
        case = sweep_models.REGISTRY[name]
        t0 = time.perf_counter()
        try:
            torch._dynamo.reset()  # one wrapper function for every model: Dynamo's recompile limit is per function
            torch.manual_seed(0)
            model = case.build().train(case.train)
            args, kwargs = case.make(torch.Generator().manual_seed(0))

            def call(*a: object, _m: torch.nn.Module = model, _kw: dict = kwargs) -> object:
                return _m(*a, **_kw)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                jobs = gpu_kernels.model_jobs(call, tuple(args), case.train, gpu_kernels.scratch_folder(),
                                              candidates=candidates)
        except Exception as err:  # noqa: BLE001 - one model's failure is its row
            rows.append({"case": name, "kernels": 0, "collect_s": round(time.perf_counter() - t0, 2),
                         "error": f"{type(err).__name__}: {str(err)[:500]}", "failures": []})
        else:
            rows.append(_row(name, jobs, time.perf_counter() - t0))
        print(json.dumps(rows[-1])[:300], flush=True)
        _write(path, rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=SEEDS)
    ap.add_argument("--mode", choices=["train", "infer", "both"], default="both")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--candidates", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--sweep", choices=["core", "wider"], help="the CPU sweep's models instead of the seeds")
    ap.add_argument("--only", nargs="*", default=[], help="with --sweep: these models of the set")
    ap.add_argument("--no-families", action="store_true", help="skip the tuner's kernel families")
    ap.add_argument("--python", action="append", default=[],
                    help="also compile with the Triton of this interpreter's environment (repeatable)")
    args = ap.parse_args()
    PYTHONS.extend(args.python)
    rows = []
    t0 = time.perf_counter()
    if not args.no_families:
        rows.append(_row("tuning families (tiled matmul, split-K sum, attention; bf16, fp16)",
                         gpu_kernels.tuning_family_jobs(), time.perf_counter() - t0))
        print(json.dumps(rows[-1])[:300], flush=True)
    modes = ["train", "infer"] if args.mode == "both" else [args.mode]
    if args.sweep:
        _sweep_rows(args.sweep, args.only, args.candidates, rows, args.json)
    for name in args.models if not args.sweep else []:
        models.get_case(name)
        for mode in modes:
            t0 = time.perf_counter()
            model, inputs, loss = load_model(name, torch.device("cpu"), mode, args.batch, False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                jobs = gpu_kernels.model_jobs(model, inputs, mode == "train", gpu_kernels.scratch_folder(),
                                              loss if mode == "train" else None, args.candidates)
            rows.append(_row(f"{name} {mode} bs{args.batch} bf16", jobs, time.perf_counter() - t0))
            print(json.dumps(rows[-1])[:300], flush=True)
            _write(args.json, rows)
    print(f"\n{'case':<66} {'kernels':>7} {'max shared':>10} {'failed':>6}  triton")
    for r in rows:
        print(f"{r['case']:<66} {r['kernels']:>7} {r.get('max_shared', '-'):>10} {len(r['failures']):>6}  "
              f"{r.get('triton', '')} {r.get('error', '')[:100]}")
    _write(args.json, rows)


if __name__ == "__main__":
    main()
