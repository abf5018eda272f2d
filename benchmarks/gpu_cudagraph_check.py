"""CUDA-graph replay is correct: run on the device after any change to runtime/cudagraph.py.

    PYTHONPATH=src python benchmarks/gpu_cudagraph_check.py

For resnet18, bert (2 layers) and a small MLP under ``ember.compile`` in inference: five
calls with fresh inputs, each compared with eager (bf16 autocast); an output kept from an
early call must not change when later calls replay the graph; an in-place parameter update
between calls must be seen (parameters are read in place); explain must say "captured".
"""

from __future__ import annotations

import sys

import torch

import ember
from ember.bench import models


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(name: str) -> list[str]:
    problems = []
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(True).cuda().eval()
    compiled = ember.compile(model)
    batches = models.make_batches(case, 2, torch.device("cuda"), small=True, count=5)
    kept, kept_value = None, None
    for i, (inputs, _t) in enumerate(batches):
        if i == 3:  # parameters change in place: the graph must read the new values
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.9)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            want = models.primary_tensor(model(*inputs))
            got = models.primary_tensor(compiled(*inputs))
        err = _rel(got, want)
        if not err < 2e-2:
            problems.append(f"{name} call {i}: relative error {err:.2e}")
        if i == 1:
            kept, kept_value = got, got.clone()
    if not torch.equal(kept, kept_value):
        problems.append(f"{name}: an output of call 1 changed after later replays")
    statuses = [g.cudagraph for g in compiled._ember_backend.log.graphs]
    if not any(s.startswith("captured") for s in statuses):
        problems.append(f"{name}: no graph captured: {statuses}")
    print(f"{name:<18} {'ok' if not problems else 'FAILED'}  {statuses}")
    return problems


def main() -> int:
    problems = []
    for name in sys.argv[1:] or ["resnet18", "tiny_transformer", "bert"]:
        problems += check(name)
        torch._dynamo.reset()
    for p in problems:
        print("PROBLEM", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
