"""The min-cut partition without Inductor's import (capture/partition.py): the stand-in numbers
mutation regions exactly as torch's helper does, the partition makes the same forward and backward
graphs as with the real module, and a training compile no longer imports Inductor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

import ember
import ember.capture.backend as backend
from ember.capture import partition

ROOT = Path(__file__).resolve().parents[2]


class _Block(nn.Module):
    """Batch norm (its running statistics: copy_ mutations in the joint graph), dropout, attention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x.reshape(b * t, 16)).reshape(b, t, 16)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return self.out(torch.nn.functional.gelu(a + h))


def test_region_ids_match_torchs_on_a_joint_graph_with_mutations(monkeypatch) -> None:
    from torch._inductor.pattern_matcher import compute_mutation_region_ids as torch_regions

    seen: list[tuple[bool, list[int], list[int]]] = []

    def checked(joint_module, joint_inputs, **kwargs):
        graph = joint_module.graph
        partition.compute_mutation_region_ids(graph)
        ours = [n.meta["mutation_region_id"] for n in graph.nodes]
        torch_regions(graph)
        seen.append((partition.regions_decidable(graph), ours, [n.meta["mutation_region_id"] for n in graph.nodes]))
        return partition.partition_joint_graph(joint_module, joint_inputs, **kwargs)

    monkeypatch.setattr(backend, "partition_joint_graph", checked)
    torch.manual_seed(0)
    model = _Block().train()
    compiled = ember.compile(model, target="aten", cache=False)
    compiled(torch.randn(3, 5, 16)).sum().backward()
    assert len(seen) == 1
    decidable, ours, theirs = seen[0]
    assert decidable
    assert ours == theirs
    assert max(theirs) >= 2  # running mean and variance written back: regions that CSE must respect


def test_calls_other_than_operator_overloads_are_left_to_torchs_helpers() -> None:
    traced = fx.symbolic_trace(lambda x: torch.relu(x) + 1)  # Python-level calls, not ATen overloads
    assert not partition.regions_decidable(traced.graph)
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    z = graph.call_function(torch.ops.aten.add_.Tensor, (y, x))
    graph.output(z)
    assert partition.regions_decidable(graph)
    partition.compute_mutation_region_ids(graph)
    assert [n.meta["mutation_region_id"] for n in graph.nodes] == [0, 0, 1, 1]


# In a fresh interpreter: the first compile partitions with the stand-in (Inductor not imported),
# the second, after Inductor's pattern matcher is imported, with the real helpers; forward and
# backward graphs and gradients compared. Then a name the stand-in lacks reaches the real module.
_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import ember
import ember.capture.backend as backend
from ember.capture import partition
from test_partition import _Block

NAME = partition.PATTERN_MATCHER
made = []

def recorded(joint_module, joint_inputs, **kwargs):
    stand_in = NAME not in sys.modules
    fw, bw = partition.partition_joint_graph(joint_module, joint_inputs, **kwargs)
    made.append({"stand_in": stand_in, "fw": fw.code, "bw": bw.code,
                 "after": NAME in sys.modules})
    return fw, bw

backend.partition_joint_graph = recorded
grads, lowering = [], []
for _ in range(2):
    torch.manual_seed(0)
    model = _Block().train()
    compiled = ember.compile(model, target="aten", cache=False)
    torch.manual_seed(1)
    compiled(torch.randn(3, 5, 16)).sum().backward()
    grads.append([p.grad for p in model.parameters()])
    lowering.append("torch._inductor.lowering" in sys.modules)
    import torch._inductor.pattern_matcher  # the real module for the second compile
    torch._dynamo.reset()
torch.manual_seed(0)
eager = _Block().train()
torch.manual_seed(1)
eager(torch.randn(3, 5, 16)).sum().backward()
print(json.dumps({
    "made": made,
    "grad_err": max((a - b).abs().max().item() for a, b in zip(grads[0], [p.grad for p in eager.parameters()])),
    "same_grads": all(torch.equal(a, b) for a, b in zip(*grads)),
    "lowering_after_first": lowering[0],
}))
"""

_OTHER_NAME_SCRIPT = r"""
import json, sys
import torch
from ember.capture import partition
NAME = partition.PATTERN_MATCHER
assert NAME not in sys.modules
stand_in = partition._StandIn(NAME)
sys.modules[NAME] = stand_in
from torch._inductor.pattern_matcher import PatternMatcherPass
real = sys.modules[NAME]
print(json.dumps({"stand_in_gone": real is not stand_in, "other_name": PatternMatcherPass is real.PatternMatcherPass}))
"""


def test_partition_with_the_stand_in_makes_torchs_graphs_without_importing_inductor() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(Path(__file__).parent)],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = result["made"]
    assert first["stand_in"] and not first["after"], "the first partition imported Inductor's pattern matcher"
    assert not second["stand_in"]
    assert first["fw"] == second["fw"] and first["bw"] == second["bw"]
    assert not result["lowering_after_first"]
    assert result["same_grads"] and result["grad_err"] < 1e-5, result["grad_err"]


def test_any_other_name_asked_of_the_stand_in_imports_the_real_module() -> None:
    proc = subprocess.run([sys.executable, "-c", _OTHER_NAME_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"stand_in_gone": True, "other_name": True}
