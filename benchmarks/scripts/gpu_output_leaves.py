"""Each output of a model, per backend, against fp32 eager: which output differs, and how much.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_output_leaves.py bert --hidden-states --out $OUT

bf16 autocast and no_grad, the bench's model and a random batch; backends eager (bf16), Inductor
and Ember (per-graph programs, and the whole call). For every output leaf (a Hugging Face model's
hidden states one by one with ``--hidden-states``): dtype, and the largest difference from fp32
eager relative to that leaf's largest magnitude. A backend far above bf16 eager on one leaf
points at the program that makes it. Rows go to ``output_leaves.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from gpu_whole_call import relative_difference, tensor_leaves

import ember
from ember.bench.models import get_case, make_batches


def run_model(name: str, batch: int, hidden_states: bool) -> list[dict]:
    case = get_case(name)
    device = torch.device("cuda")
    eager = case.build(False).to(device).eval()
    if hidden_states:
        eager.config.output_hidden_states = True
    backends = {"eager": eager,
                "inductor": torch.compile(copy.deepcopy(eager)),
                "ember": ember.compile(copy.deepcopy(eager)),
                "ember-whole-call": ember.compile(copy.deepcopy(eager), whole_call=True)}
    batches = make_batches(case, batch, device, count=4, seed=7)
    rows = []
    for label, model in backends.items():
        worst: list[float] = []
        dtypes: list[str] = []
        for inputs, _ in batches:
            with torch.no_grad():
                exact = tensor_leaves(eager(*inputs))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    got = tensor_leaves(model(*inputs))
            if len(got) != len(exact):
                raise AssertionError(f"{label}: {len(got)} outputs, fp32 eager {len(exact)}")
            diffs = [relative_difference(a, b) for a, b in zip(got, exact)]
            worst = [max(x, y) for x, y in zip(worst, diffs)] if worst else diffs
            dtypes = [str(a.dtype).replace("torch.", "") for a in got]
        rows.append({"model": name, "backend": label, "rel_diff_per_output": worst, "dtypes": dtypes})
        print(f"{name:8s} {label:17s} " + " ".join(f"{d:.1e}" for d in worst) + f"   {sorted(set(dtypes))}",
              flush=True)
        whole = getattr(getattr(model, "_ember_backend", None), "whole_call", None)
        if whole is not None:
            rows[-1]["whole_call"] = whole.describe()
            print(f"{'':8s} whole call: {whole.describe()[:300]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden-states", action="store_true", help="Hugging Face: output_hidden_states=True")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.models:
        rows += run_model(name, args.batch, args.hidden_states)
        torch._dynamo.reset()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    (args.out / "output_leaves.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
