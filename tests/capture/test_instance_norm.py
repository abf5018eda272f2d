"""Instance norm reaches Ember as spatial reductions in the input's layout (capture/instance_norm.py).

Outputs and gradients are compared with eager on random inputs (fp32 and bf16 autocast, with and
without affine parameters, 1-D/2-D/3-D, NCHW and channels_last); calls that keep running
statistics stay PyTorch's composite op; explain reports the rewrite.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from ember_check import assert_close

import ember
from ember.report.explain import explain_with


class Net(nn.Module):
    def __init__(self, dims: int, affine: bool, running: bool = False) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims]
        # No bias: instance norm removes it, so its gradient is rounding noise around zero.
        self.conv = conv(3, 5, 3, padding=1, bias=False)
        self.norm = norm(5, affine=affine, track_running_stats=running)
        if affine:  # not the 1/0 initialisation: the affine terms must matter
            nn.init.normal_(self.norm.weight)
            nn.init.normal_(self.norm.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x))) * 1.5


def _step(model: nn.Module, x: torch.Tensor, cot: torch.Tensor, autocast: bool) -> tuple:
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.backward(cot)
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())], [b.clone() for b in model.buffers()]


SHAPES = {1: (2, 3, 11), 2: (2, 3, 7, 6), 3: (2, 3, 4, 5, 3)}


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_instance_norm_matches_eager(dims: int, affine: bool, autocast: bool) -> None:
    torch.manual_seed(dims)
    model = Net(dims, affine)
    ref = copy.deepcopy(model)
    x = torch.randn(SHAPES[dims]) * 3 + 1
    if dims == 2:
        x = x.to(memory_format=torch.channels_last)
    compiled = ember.compile(model, target="triton-interpret")
    cot = torch.randn(x.shape[0], 5, *x.shape[2:])
    want = _step(ref, x, cot, autocast)
    got = _step(compiled, x, cot, autocast)
    tol = {"rtol": 2e-2, "norm_rtol": 2e-2} if autocast else {"norm_rtol": 1e-4}
    assert got[0].dtype == want[0].dtype
    assert_close(got[0], want[0], "output", **tol)
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        assert_close(a, b, f"gradient {i}", **tol)
    log = compiled._ember_backend.log
    assert sum(n for r, n in log.rewrites.items() if "instance_norm" in r) == 1, log.rewrites
    for g in log.graphs:
        ops = {op for ops_ in g.placement.values() for op in ops_}
        assert not any("batch_norm" in op for op in ops), ops


@pytest.mark.parametrize("running,target", [(True, "triton-interpret"), (False, "cpu")])
def test_running_statistics_and_cpu_targets_keep_the_composite_op(running: bool, target: str) -> None:
    # The CPU kernels accumulate in float32 where ATen's CPU batch norm accumulates in double.
    torch.manual_seed(0)
    model = Net(2, affine=True, running=running)
    ref = copy.deepcopy(model)
    x, cot = torch.randn(2, 3, 6, 6), torch.randn(2, 5, 6, 6)
    compiled = ember.compile(model, target=target)
    want, got = _step(ref, x, cot, False), _step(compiled, x, cot, False)
    assert_close(got[0], want[0], "output", norm_rtol=1e-4)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):  # gradients, then the running statistics
        assert_close(a, b, "gradient or running statistic", norm_rtol=1e-4)
    log = compiled._ember_backend.log
    assert sum(n for r, n in log.rewrites.items() if "instance_norm" in r) == 0, log.rewrites


def test_explain_reports_the_rewrite() -> None:
    torch.manual_seed(0)
    report = explain_with(Net(2, affine=True), (torch.randn(2, 3, 6, 6),), target="triton-interpret")
    assert "1x F.instance_norm -> spatial reductions" in str(report)
    assert any("instance_norm" in r for r in report.as_dict()["capture_rewrites"])
