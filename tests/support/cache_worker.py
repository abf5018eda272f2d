"""Run in a fresh process by test_program_cache.py: compile a small conv net with Ember
(training step and inference), compare with eager, print a JSON line with the cache status
of every graph and the errors."""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

import ember


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 5))
    ref = copy.deepcopy(model)
    x = torch.randn(batch, 3, 6, 6)
    compiled = ember.compile(model, target="triton-interpret")
    out = compiled(x)
    out.square().mean().backward()
    want = ref(x)
    want.square().mean().backward()
    errors = {"output": (out - want).abs().max().item()}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        errors[name] = (p.grad - q.grad).abs().max().item()
    model.eval()
    ref.eval()
    with torch.no_grad():
        errors["infer"] = (compiled(x) - ref(x)).abs().max().item()
    graphs = compiled._ember_backend.log.graphs
    print(json.dumps({"cache": {g.kind: g.cache for g in graphs}, "errors": errors,
                      "stages": {g.kind: g.stage_seconds for g in graphs}}))


if __name__ == "__main__":
    main()
