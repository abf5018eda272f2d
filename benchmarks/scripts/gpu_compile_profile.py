"""Where a cold compile goes on the GPU machine: Ember's stages, the parallel kernel compile, and
any Triton compile left for the first launch.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_compile_profile.py resnet50 cyclegan --json $OUT/compile_profile.json \
        [--dump $OUT/kernels]

Each model runs in a fresh process with a new EMBER_CACHE_DIR and TRITON_CACHE_DIR: one bf16
training step through ``ember.explain``. Besides explain's split (capture / Ember stages / first
run) and each graph's kernel_compile note (kernels, workers, wall vs summed compile seconds,
worker start-up), a Triton compilation listener in the parent counts the compiles that still
happen at launch (a cache miss there means the precompiled specialisation did not match).
``--dump`` keeps every precompiled kernel's module and its compile seconds (``kernels.json``, the
input of ``sm90_compile_time.py``), so slow compiles can be studied on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fresh_process import EXPLAIN_TRAIN_STEP, child_result, fresh_caches, write_rows

CHILD = r"""
import json, os, sys, time, torch, ember
from triton import knobs
from ember.bench import models
launch = {"miss": 0, "hit": 0, "miss_s": 0.0}
def listener(*, src, metadata, metadata_group, times, cache_hit):
    launch["hit" if cache_hit else "miss"] += 1
    if not cache_hit and len(launch.setdefault("missed", [])) < 6:  # which kernels, specialised how
        launch["missed"].append(f"{getattr(src, 'name', '?')}: attrs {str(getattr(src, 'attrs', ''))[:300]} "
                                f"signature {str(getattr(src, 'signature', ''))[:200]}")
    if not cache_hit:
        try:  # microseconds
            launch["miss_s"] += (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
        except Exception:
            pass
if hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener"):
    knobs.compilation.listener = listener
else:
    launch = {"note": "this Triton has no compilation listener"}
if os.environ.get("EMBER_PROFILE_AFTER_INDUCTOR"):  # as in the suite run, where Inductor compiled first:
    # its imports and the CUDA/Triton start-up are paid before Ember's first call
    tiny = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 4)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.compile(tiny)(torch.randn(2, 3, 16, 16, device="cuda")).float().sum().backward()
    torch.cuda.synchronize()
    torch._dynamo.reset()
passes_to = os.environ.get("EMBER_PROFILE_PASSES")
if passes_to:  # cProfile Ember's graph passes alone (every graph's run_passes)
    import cProfile, ember.instruments as _instruments
    _pass_prof = cProfile.Profile()
    def _profiled_passes(stage, call):
        if stage != "passes":
            return call()
        _pass_prof.enable()
        try:
            return call()
        finally:
            _pass_prof.disable()
    _instruments.instrument(around=_profiled_passes).__enter__()
profile_to = os.environ.get("EMBER_PROFILE_CAPTURE")
if profile_to:  # cProfile the whole first call (its overhead inflates Python-heavy stages)
    import cProfile
    _prof = cProfile.Profile()
    _prof.enable()
""" + EXPLAIN_TRAIN_STEP + r"""
if profile_to:
    _prof.disable()
    _prof.dump_stats(profile_to)
from torch._dynamo import utils as dynamo_utils  # torch's own compile-stage timers (dynamo_timed)
dynamo_times = {k: round(sum(v), 3) for k, v in getattr(dynamo_utils, "compilation_time_metrics", {}).items()}
if len(sys.argv) > 2:  # keep each kernel's source and its compile time (for sm90_compile_time.py)
    import os, shutil
    from ember.runtime.precompile import compile_log
    os.makedirs(sys.argv[2], exist_ok=True)
    kept = []
    for job, secs in compile_log():
        path = os.path.join(sys.argv[2], os.path.basename(job.path))
        shutil.copyfile(job.path, path)
        kept.append({"name": job.name, "path": path, "dtypes": list(job.arg_dtypes), "meta": dict(job.meta),
                     "seconds_here": secs})
    json.dump(kept, open(os.path.join(sys.argv[2], "kernels.json"), "w"), indent=1)
# Kernels compiled twice (by a worker ahead, and again at launch): what differs between the two
# cache entries' metadata says why the precompiled one did not match.
twice = []
try:
    import glob
    by_name = {}
    for path in glob.glob(os.path.join(os.environ.get("TRITON_CACHE_DIR", ""), "*", "*.json")):
        try:
            meta = json.load(open(path))
        except Exception:
            continue
        if isinstance(meta, dict) and str(meta.get("name", "")).startswith("ember_"):
            by_name.setdefault(meta["name"], []).append(meta)
    for kname, metas in by_name.items():
        if len(metas) >= 2 and len(twice) < 4:
            a, b = metas[0], metas[1]
            twice.append({"kernel": kname, "entries": len(metas), "differ": {
                k: [str(a.get(k))[:200], str(b.get(k))[:200]] for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k) and k not in ("hash",)}})
    twice.append({"kernels_with_two_entries": sum(1 for m in by_name.values() if len(m) >= 2),
                  "kernels": len(by_name)})
except Exception as err:
    twice.append({"error": repr(err)})
passes_text = ""
if passes_to:
    import io, pstats
    _pass_prof.dump_stats(passes_to)
    buf = io.StringIO()
    pstats.Stats(_pass_prof, stream=buf).sort_stats("tottime").print_stats(25)
    passes_text = buf.getvalue()
per_pass = {}
for g in r.graphs:
    for pname, secs, _changed in g.passes:
        per_pass[pname] = round(per_pass.get(pname, 0.0) + secs, 4)
print("RESULT " + json.dumps({"compiled_twice": twice, "passes": per_pass, "passes_profile": passes_text, "first_call_s": r.total_s, "capture_s": r.capture_s, "ember_s": r.ember_s,
      "first_run_s": r.first_run_s, "stages": r.stage_totals(), "kernels": r.kernels,
      "unique_kernels": r.unique_kernels, "compile_notes": [g.title + ": " + g.compile_note for g in r.graphs],
      "launch_compiles": launch, "dynamo_times": dynamo_times}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet50", "cyclegan"])
    parser.add_argument("--workers", default=None, help="EMBER_COMPILE_WORKERS for the child")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dump", default=None, help="folder for each model's kernel sources and compile times")
    parser.add_argument("--cprofile", default=None, help="folder for a cProfile of each model's first call")
    parser.add_argument("--profile-passes", default=None,
                        help="folder for a cProfile of Ember's graph passes alone (top entries printed)")
    parser.add_argument("--after-inductor", action="store_true",
                        help="compile a tiny model with Inductor first in each process (as the suite run does)")
    args = parser.parse_args()
    rows = []
    extra = {} if args.workers is None else {"EMBER_COMPILE_WORKERS": args.workers}
    if args.cprofile:
        os.makedirs(args.cprofile, exist_ok=True)
    for name in args.models:
        prof = {"EMBER_PROFILE_CAPTURE": f"{args.cprofile}/{name}.pstats"} if args.cprofile else {}
        if args.after_inductor:
            prof["EMBER_PROFILE_AFTER_INDUCTOR"] = "1"
        if args.profile_passes:
            os.makedirs(args.profile_passes, exist_ok=True)
            prof["EMBER_PROFILE_PASSES"] = f"{args.profile_passes}/{name}.pstats"
        with fresh_caches(**extra, **prof) as env:
            dump = [f"{args.dump}/{name}"] if args.dump else []
            r, stderr = child_result(CHILD, [name, *dump], env)
        if r is None:
            print(f"{name}: ERROR {stderr[-800:]}")
            rows.append({"model": name, "error": stderr[-3000:]})
            continue
        rows.append({"model": name, "workers_env": args.workers, "after_inductor": args.after_inductor, **r})
        st = r["stages"]
        print(f"{name}: first call {r['first_call_s']:.2f} s = capture {r['capture_s']:.2f} + Ember "
              f"{r['ember_s']:.2f} (" + ", ".join(f"{k} {v:.2f}" for k, v in st.items() if v) +
              f") + first run {r['first_run_s']:.2f}; kernels {r['kernels']} ({r['unique_kernels']} unique)")
        for note in r["compile_notes"]:
            print(f"  {note}")
        print(f"  Triton compiles at launch: {r['launch_compiles']}")
        for entry in r.get("compiled_twice", []):
            print(f"  compiled twice: {json.dumps(entry)[:1500]}")
        print("  passes (s, all graphs): " + ", ".join(f"{k} {v:.3f}" for k, v in r["passes"].items()))
        if r.get("passes_profile"):
            print(r["passes_profile"])
        top = sorted(r.get("dynamo_times", {}).items(), key=lambda kv: -kv[1])[:10]
        print("  torch's timers: " + ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
    return write_rows(args.json, rows)

if __name__ == "__main__":
    sys.exit(main())
