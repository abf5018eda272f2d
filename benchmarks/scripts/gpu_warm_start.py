"""Warm start: the first call of a model in a new process, with a cold and then a warm cache.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_warm_start.py resnet50 bert --json $OUT/warm_start.json

For each model, two fresh processes share one new EMBER_CACHE_DIR (and one new Triton cache):
the first compiles cold, the second should find every graph in the cache. Each process runs
``ember.explain`` on one bf16 training step at the benchmark batch size and reports the first
call split into Dynamo + AOTAutograd capture, Ember's own compile work (all stages, cache
lookups included) and running the graphs.
"""

from __future__ import annotations

import argparse
import sys

from fresh_process import EXPLAIN_TRAIN_STEP, child_result, fresh_caches, write_rows

CHILD = r"""
import json, sys, torch, ember
from ember.bench import models
""" + EXPLAIN_TRAIN_STEP + r"""
print("RESULT " + json.dumps({"first_call_s": r.total_s, "capture_s": r.capture_s, "ember_s": r.ember_s,
      "first_run_s": r.first_run_s, "stages": r.stage_totals(), "cache": [g.cache for g in r.graphs]}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet50", "bert"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'model':<10}{'run':<6}{'first call s':>13}{'capture s':>11}{'ember s':>9}{'run s':>8}  cache")
    for name in args.models:
        with fresh_caches() as env:
            for run in ("cold", "warm"):
                r, stderr = child_result(CHILD, [name], env)
                if r is None:
                    print(f"{name:<10}{run:<6}ERROR {stderr[-500:]}")
                    rows.append({"model": name, "run": run, "error": stderr[-3000:]})
                    continue
                print(f"{name:<10}{run:<6}{r['first_call_s']:>13.2f}{r['capture_s']:>11.2f}{r['ember_s']:>9.2f}"
                      f"{r['first_run_s']:>8.2f}  {','.join(r['cache'])}", flush=True)
                rows.append({"model": name, "run": run, **r})
    return write_rows(args.json, rows)

if __name__ == "__main__":
    sys.exit(main())
