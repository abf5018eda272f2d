"""Seed-suite coverage on the GPU: ``ember.explain`` of every seed model, training (bf16
autocast, forward + backward) and inference, at the models' benchmark batch sizes.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_explain.py --out $OUT/explain

Prints one row per model and mode: graphs, graph breaks, kernels, the share of compute ops in
generated kernels / library calls / fallback, and Ember's compile time. Writes every report
as JSON (``as_dict``) and the full text reports of the models named by ``--text``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

import ember
from ember.bench import models
from ember.bench.models import SEED_SUITE

SEED_MODELS = SEED_SUITE


def explain_case(name: str, mode: str, device: torch.device) -> ember.report.explain.ExplainReport:
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).train(mode == "train")
    (inputs, _target), *_ = models.make_batches(case, case.default_batch(mode), device, count=1)
    grad = torch.enable_grad() if mode == "train" else torch.no_grad()
    with grad, torch.autocast(device.type, dtype=torch.bfloat16):
        return ember.explain(model, *inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=SEED_MODELS)
    parser.add_argument("--out", default="explain_out")
    parser.add_argument("--text", default="resnet50,bert", help="models whose full text report is written")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    text_models = set(args.text.split(","))
    rows = []
    print(f"{'model':<15}{'mode':<7}{'graphs':>7}{'breaks':>7}{'kernels':>8}{'generated%':>11}"
          f"{'library%':>9}{'fallback%':>10}{'ember_s':>8}{'first_s':>8}")
    for name in args.models:
        for mode in ("train", "infer"):
            try:
                report = explain_case(name, mode, device)
            except Exception as err:  # one model failing must not hide the others
                print(f"{name:<15}{mode:<7}ERROR {type(err).__name__}: {str(err)[:200]}")
                rows.append({"model": name, "mode": mode, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()})
                continue
            d = report.as_dict()
            cov = d["coverage"]
            print(f"{name:<15}{mode:<7}{d['aten_graphs']:>7}{d['graph_breaks']['count']:>7}{d['kernels']:>8}"
                  f"{cov.get('generated', 0):>11.1f}{cov.get('library', 0):>9.1f}{cov.get('fallback', 0):>10.1f}"
                  f"{report.ember_s:>8.2f}{report.total_s:>8.2f}", flush=True)
            rows.append({"model": name, "mode": mode, **d})
            if name in text_models:
                (out / f"explain_{name}_{mode}.txt").write_text(str(report))
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    (out / "explain.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                 "torch": torch.__version__, "results": rows},
                                                indent=1, default=str))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
