"""Which registry models warm-start, and whether a warm process computes what the cold one did.

For each model: a training step (or, ``--mode infer``, an inference call under ``torch.no_grad()``)
through ``ember.compile(warm_start=True)`` (CPU, small inputs, the ``aten`` target) in a new process
with an empty cache (cold), then again in another new process with the cache it left (warm). Prints
the warm start's log line of the warm process and whether its loss and every gradient (inference:
its output) equal the cold process's bit for bit.

    PYTHONPATH=src python benchmarks/scripts/warm_start_coverage.py [MODEL ...] [--mode infer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, torch, ember
from ember.bench import models
from ember.bench.harness import ember_backend_of
case, train = models.get_case(sys.argv[1]), sys.argv[2] == "train"
torch.manual_seed(0)
model = case.build(True).train(train)
x, y = models.make_batches(case, 2, torch.device("cpu"), small=True, count=1)[0]
compiled = ember.compile(model, target="aten", warm_start=True)
with torch.set_grad_enabled(train):
    loss = case.loss(compiled(*x), y)
if train:
    loss.backward()
grads = [p.grad.double().sum().item() for p in model.parameters() if p.grad is not None]
backend = ember_backend_of(compiled)
print("RESULT " + json.dumps({"loss": loss.item(), "grads": grads, "log": list(backend.log.warm_start) if backend else []}))
"""

DEFAULT = ["resnet18", "tiny_transformer", "mobilenet_v3", "densenet121", "resnet50v2", "bert", "cyclegan",
           "style_transfer", "vgg16", "swin_t", "vit_b16", "convnext_t", "efficientnet_b0", "gpt2", "llama", "t5",
           "bart", "lstm_lm"]


def _run(model: str, mode: str, cache: str) -> dict:
    env = {**os.environ, "EMBER_CACHE_DIR": cache}
    proc = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"rc {proc.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=DEFAULT)
    parser.add_argument("--mode", choices=["train", "infer"], default="train")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = _run(model, args.mode, cache), _run(model, args.mode, cache)
        loaded = any(line.startswith("loaded") for line in warm.get("log", []))
        same = "error" not in cold and "error" not in warm and cold["loss"] == warm["loss"] and cold["grads"] == warm["grads"]
        rows.append({"model": model, "cold": cold, "warm": warm, "loaded": loaded, "same": same})
        last = (warm.get("log") or [warm.get("error", "")])[-1]
        what = "loss and gradients" if args.mode == "train" else "loss of the output"
        print(f"{model:16s} warm start {'loaded' if loaded else 'NOT loaded'}; {what} "
              f"{'equal' if same else 'DIFFER'} to the cold process's; {last[:150]}", flush=True)
    print(f"{sum(r['loaded'] for r in rows)} of {len(rows)} loaded; {sum(r['same'] for r in rows)} of {len(rows)} equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
