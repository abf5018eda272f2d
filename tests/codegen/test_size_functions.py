"""Python's own functions on sizes in a compiled program (codegen/program.py): a check on a
data-dependent size (``operator.ge`` of the size ``torch.where`` returns), ``torch.sym_max`` and
``math`` functions are written by their module's name; mixture-of-experts routing with top-2
experts per token compiles without falling back and trains like eager."""

from __future__ import annotations

import math
import operator

import torch

import ember
from ember.codegen.program import _qualname


class TopTwoExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                               torch.nn.Linear(32, 16)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # how many tokens: known only when it runs
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_python_size_functions_are_named_by_module() -> None:
    assert _qualname(operator.ge) == "operator.ge" and _qualname(operator.floordiv) == "operator.floordiv"
    assert _qualname(torch.sym_max) == "torch.sym_max" and _qualname(math.ceil) == "math.ceil"


def test_top_two_routing_compiles_and_trains_like_eager() -> None:
    torch.manual_seed(0)
    model, x = TopTwoExperts(), torch.randn(12, 16)
    eager = TopTwoExperts()
    eager.load_state_dict(model.state_dict())
    compiled = ember.compile(model)  # (a CPU compile: the warm start's whole-module capture)
    got, want = compiled(x), eager(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cot = torch.randn(got.shape)
    (got * cot).sum().backward()
    (want * cot).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    errors = [g.error for g in compiled._ember_backend.log.graphs if g.error]
    assert not errors, errors
