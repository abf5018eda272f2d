"""Cold compiles of several models in one process, in `ember bench`'s order (eager, Inductor,
Ember per model): what each Ember first call waited for and what Triton still compiled at launch.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_compile_sequence.py cyclegan style_transfer --json $OUT/sequence.json

`gpu_compile_profile.py` runs each model in a fresh process; the suite does not, and a later
model's compile can depend on what earlier ones left behind (the compile workers, Triton's
per-process state, the environment Inductor changed). Per (model, backend): the first step's
seconds, Ember's split, each graph's kernel_compile note and precompile errors, and the Triton
compiles at launch during it (cache hits and misses, the first missed kernels by name).
"""

from __future__ import annotations

import argparse
import json
import sys

from triton import knobs

from ember.bench import harness

_PHASE = ["start"]
_LAUNCH: dict[str, dict] = {}


def _listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    row = _LAUNCH.setdefault(_PHASE[0], {"hit": 0, "miss": 0, "missed": []})
    row["hit" if cache_hit else "miss"] += 1
    if not cache_hit and len(row["missed"]) < 8:
        row["missed"].append(str(getattr(src, "name", "?")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    knobs.compilation.listener = _listener
    notes: dict[str, list[str]] = {}
    measure = harness._measure

    def traced(*a, **kw):
        _PHASE[0] = a[-1]  # the row's label, "cyclegan train bs1 [ember]"
        return measure(*a, **kw)

    harness._measure = traced
    original_ember = harness.BACKENDS["ember"]

    def ember_with_notes(model):
        fn = original_ember(model)
        notes[_PHASE[0]] = fn._ember_backend.log.graphs  # filled as the graphs compile
        return fn

    harness.BACKENDS["ember"] = ember_with_notes
    rows = harness.run_benchmark(args.models, modes=("train",), precision="bf16", iters=5, progress=False)
    result = []
    for r in rows:
        label = f"{r['model']} {r['mode']} bs{r['batch']} [{r['backend']}]"
        entry = {"model": r["model"], "backend": r["backend"], "compile_s": r["compile_s"], "error": r["error"],
                 "split": r.get("compile_split"), "launch_compiles": _LAUNCH.get(label, {})}
        graphs = notes.get(label)
        if graphs is not None:
            entry["compile_notes"] = [g.title + ": " + g.compile_note for g in graphs]
        result.append(entry)
        print(json.dumps(entry)[:1500])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
