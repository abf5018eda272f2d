"""Garbage collection during a compile (capture/aot_settings.py ``gc_paused``), on the CPU.

Each mode runs in a fresh process: resnet50 in training mode, batch 2 at 224x224, compiled for
``triton-interpret`` up to Ember's kernel plan (the plan step raises, so the graphs then run
through ATen and no interpreted kernel runs); the first call is timed and every collection is
timed through ``gc.callbacks``. ``paused`` is Ember as it is; ``not paused`` replaces the pause
with a no-op.

    PYTHONPATH=src python benchmarks/scripts/cpu_gc_during_compile.py --json benchmarks/cpu_gc_during_compile_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CHILD = r"""
import contextlib, gc, json, resource, sys, time, warnings
import torch
import ember, ember.capture.backend as backend, ember.instruments as instruments
from ember.bench import models
if sys.argv[1] == "not paused":
    backend.gc_paused = contextlib.nullcontext
def _stop(stage, record, args):
    if stage == "schedule":
        raise RuntimeError("stop before the kernel plan")
instruments.instrument(before=_stop).__enter__()
warnings.simplefilter("ignore")
case = models.get_case("resnet50")
model = case.build(False).train()
(inputs, _t), = models.make_batches(case, 2, torch.device("cpu"), count=1)
compiled = ember.compile(model, target="triton-interpret")
counts, seconds, start = [0, 0, 0], [0.0, 0.0, 0.0], {}
def timed(phase, info):
    if phase == "start":
        start["t"] = time.perf_counter()
    else:
        counts[info["generation"]] += 1
        seconds[info["generation"]] += time.perf_counter() - start["t"]
gc.callbacks.append(timed)
t0 = time.perf_counter()
compiled(*inputs)
first = time.perf_counter() - t0
print("RESULT " + json.dumps({"first_call_s": first, "collections": counts, "collection_s": seconds,
      "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for mode in ("not paused", "paused"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "EMBER_CACHE_DIR": cache, "EMBER_STRICT": "0"}
            proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{mode}: ERROR {proc.stderr[-600:]}")
            return 1
        r = {"mode": mode, **json.loads(line[len("RESULT "):])}
        rows.append(r)
        print(f"{mode:>11}: first call {r['first_call_s']:.2f} s; collections per generation {r['collections']}, "
              f"{sum(r['collection_s']):.2f} s in them (full: {r['collection_s'][2]:.2f} s); max RSS {r['max_rss_mib']} MiB")
    if args.json:
        import torch
        doc = {"env": {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                       "machine": platform.processor() or platform.machine(),
                       "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                    text=True).stdout.strip()},
               "results": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
