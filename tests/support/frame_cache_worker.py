"""Run in a fresh process by tests/capture/test_frame_cache.py: compile a model with a graph break
(two Dynamo frames) on the CPU target, run one training step (forward and backward) or an
inference call, and print one JSON line per variant: the frame cache's log, the graphs' cache
labels, how many graphs AOTAutograd traced in this process, output and gradient sums, and the
largest difference from eager on the same fresh random input.

    python frame_cache_worker.py CACHE_DIR MODE [VARIANT ...]

MODE is train or infer. Each VARIANT compiles a fresh ember.compile in this same process:
base, input_shape (another batch size), dtype (float64 weights and input), option (fuse_cat=False),
off (frame_cache=False), warm_start (warm_start=True: a graph break leaves the frame cache in charge),
step (ember.compile_step over a train_fn with the graph break; losses and parameters after 2 steps).
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn
from torch._dynamo.utils import counters
from worker_step import run_beside_eager  # tests/support, the script's folder

import ember


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc1(x)) * 2.0
        torch._dynamo.graph_break()  # two frames: forward before and after the break
        return self.fc2(torch.tanh(self.norm(y)))


def run(cache_dir: str, mode: str, variant: str) -> dict:
    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(5 if variant == "input_shape" else 4, 6)
    if variant == "dtype":
        model, x = model.double(), x.double()
    if mode == "infer":
        model.eval()
    ref = copy.deepcopy(model)
    options = {"cache_dir": cache_dir, "target": "cpu"}
    if variant == "option":
        options["fuse_cat"] = False
    if variant == "off":
        options["frame_cache"] = False
    if variant == "warm_start":
        options["warm_start"] = True
    traced_before = counters["aot_autograd"]["total"]
    if variant == "step":
        return _step(model, ref, x, options, traced_before)
    compiled = ember.compile(model, **options)
    out, want, grads, grad_err = run_beside_eager(compiled, model, ref, x, mode)
    log = compiled._ember_backend.log
    return {"variant": variant, "log": log.frame_cache, "warm_start": log.warm_start,
            "caches": [g.cache for g in log.graphs], "aot_traces": counters["aot_autograd"]["total"] - traced_before,
            "out": out.double().sum().item(), "grads": grads,
            "out_err": (out - want).abs().max().item(), "grad_err": grad_err}


def _step(model: nn.Module, ref: nn.Module, x: torch.Tensor, options: dict, traced_before: int) -> dict:
    def make_train_fn(m: nn.Module):  # noqa: ANN202
        def train_fn(batch: torch.Tensor) -> torch.Tensor:
            return m(batch).square().mean()
        return train_fn

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = ember.compile_step(make_train_fn(model), opt, model=model, **options)
    losses, want = [], []
    for _ in range(2):
        losses.append(step(x).item())
        ref_opt.zero_grad()
        loss = make_train_fn(ref)(x)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    log = step.backend.log
    return {"variant": "step", "log": log.frame_cache, "warm_start": log.warm_start,
            "caches": [g.cache for g in log.graphs], "aot_traces": counters["aot_autograd"]["total"] - traced_before,
            "out": sum(losses), "grads": {n: p.double().sum().item() for n, p in model.named_parameters()},
            "out_err": max(abs(a - b) for a, b in zip(losses, want)), "grad_err": err}


def main() -> None:
    cache_dir, mode, *variants = sys.argv[1:]
    print(json.dumps([run(cache_dir, mode, v) for v in variants or ["base"]]))


if __name__ == "__main__":
    main()
