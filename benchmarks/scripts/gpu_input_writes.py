"""Writes into graph inputs on the GPU (capture/backend.py, codegen/input_writes.py): batch norm's
running statistics and a buffer counter, kept in Ember's program and its CUDA graphs.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_input_writes.py --out $OUT

A small conv + batch-norm net (fp32, SGD) trains ``--steps`` steps under ember.compile (Triton,
CUDA graphs) and eagerly, for each setting of ``input_mutations_in_graph`` and
``input_writes_as_stores``: outputs, gradients, parameters and every buffer are compared after each
step, then an eval-mode call. Prints one JSON line per setting (largest differences, the forward's
CUDA-graph status, how its input writes ran) and writes them to ``input_writes.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

import ember
from ember import config


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        y = torch.relu(self.bn1(self.c1(x)))
        y = torch.relu(self.bn2(self.c2(y)))
        return self.fc(y.mean((2, 3)))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def run(in_graph: bool, stores: bool, steps: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Net().to(dev)
    eager = copy.deepcopy(model)
    with config.patch(input_mutations_in_graph=in_graph, input_writes_as_stores=stores):
        compiled = ember.compile(model)
        opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
        worst = {"out": 0.0, "grad": 0.0, "param": 0.0, "buffer": 0.0}
        for _ in range(steps):
            x = torch.randn(8, 3, 16, 16, device=dev)
            outs = []
            for fn, opt in ((compiled, opt_c), (eager, opt_e)):
                opt.zero_grad()
                out = fn(x)
                out.square().mean().backward()
                outs.append(out.detach())
            worst["out"] = max(worst["out"], _max_diff(outs[:1], outs[1:]))
            worst["grad"] = max(worst["grad"], _max_diff([p.grad for p in model.parameters()],
                                                         [p.grad for p in eager.parameters()]))
            opt_c.step()
            opt_e.step()
            worst["param"] = max(worst["param"], _max_diff(list(model.parameters()), list(eager.parameters())))
            worst["buffer"] = max(worst["buffer"], _max_diff(list(model.buffers()), list(eager.buffers())))
        model.eval()
        eager.eval()
        with torch.no_grad():
            x = torch.randn(8, 3, 16, 16, device=dev)
            worst["eval_out"] = _max_diff([compiled(x)], [eager(x)])
    graphs = compiled._ember_backend.log.graphs
    fw = next(r for r in graphs if r.kind == "forward")
    return {"input_mutations_in_graph": in_graph, "input_writes_as_stores": stores, "steps": steps,
            "max_abs_diff": worst, "count": int(model.count), "eager_count": int(eager.count),
            "forward_cudagraph": fw.cudagraph, "forward_stores": fw.program.count("[input write] stored"),
            "forward_copies": fw.program.count("aten.copy_.default("),
            "errors": [r.error for r in graphs if r.error]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rows = []
    for in_graph, stores in ((True, True), (True, False), (False, True)):
        try:
            row = run(in_graph, stores, args.steps)
        except Exception as err:  # noqa: BLE001 - one failed setting must not lose the others
            row = {"input_mutations_in_graph": in_graph, "input_writes_as_stores": stores, "error": repr(err)[:800]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "input_writes.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
