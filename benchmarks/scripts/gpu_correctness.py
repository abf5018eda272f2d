"""Seed-suite (or zoo) correctness on the GPU: one bf16-autocast training step and one inference
call per model, Ember vs eager, both measured against fp32 eager.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_correctness.py --json benchmarks/gpu_correctness.json
    PYTHONPATH=src python benchmarks/scripts/gpu_correctness.py zoo --json zoo_correctness.json   # the zoo suite
Model arguments may be suite names (seed, zoo). Dropout is off for the comparison.

Prints a table (worst relative error of outputs, loss, every parameter gradient and buffer) and
writes the full per-tensor errors as JSON. A model passes when Ember's error is at most
max(4 x eager's error, a floor) for every tensor, the rule the CPU tests use.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import traceback

import torch

import ember
from ember.bench.check import acceptable, run_seed_step
from ember.bench.models import SEED_SUITE, expand_names
from ember.bench.report import git_commit

SEED_MODELS = SEED_SUITE
FLOOR = {"train": 3e-2, "infer": 2e-2}  # bf16 has 8 mantissa bits: 2^-8 = 3.9e-3 per rounding


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=SEED_MODELS, help="models or suite names (seed, zoo)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="small inputs (64x64 images, seq 32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.models = expand_names(args.models)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows, failed = [], 0
    print(f"{'model':<15}{'mode':<7}{'worst tensor':<52}{'ember':>10}{'eager':>10}  {'ok':<4}{'s':>6}")
    for name in args.models:
        t0 = time.perf_counter()
        try:
            results = run_seed_step(name, lambda m: ember.compile(m), device="cuda", batch=args.batch,
                                    small=args.small, autocast=torch.bfloat16)
        except Exception as err:  # one model failing must not hide the others
            failed += 1
            rows.append({"model": name, "error": f"{type(err).__name__}: {err}",
                         "traceback": traceback.format_exc()})
            print(f"{name:<15}ERROR {type(err).__name__}: {str(err)[:200]}")
            continue
        secs = time.perf_counter() - t0
        for res in results:
            ok = all(acceptable(e, g, FLOOR[res.mode]) for e, g in res.errors.values())
            failed += not ok
            worst, e, g = res.worst()
            print(f"{name:<15}{res.mode:<7}{worst[:50]:<52}{e:>10.2e}{g:>10.2e}  {'yes' if ok else 'NO':<4}"
                  f"{secs:>6.1f}")
            rows.append({"model": name, "mode": res.mode, "ok": ok, "worst": worst, "ember_err": e,
                         "eager_err": g, "seconds_incl_compile": secs,
                         "errors": {k: {"ember": v[0], "eager": v[1]} for k, v in res.errors.items()}})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "ember": ember.__version__, "commit": git_commit()["git_commit"],
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "batch": args.batch,
            "small": args.small, "precision": "bf16 autocast, reference fp32 eager (TF32 off)",
            "floor": FLOOR, "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "results": rows}, f, indent=1)
    print(f"{len(args.models)} models, {failed} failing rows")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
