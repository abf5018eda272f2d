"""Nearest upsampling reaches the compiled program as ATen's kernels, not an index/index_put pair.

Forward and gradients are compared with eager on random inputs for every way of asking for the
output size (scale factor, size, per-dim tuples, recompute_scale_factor, non-integer factors,
1-D/2-D/3-D, channels_last), and the captured graphs are checked for what they contain.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
from ember.ops.upsample import rewrite_nearest_interpolate

CASES = [
    ((2, 3, 5, 7), {"scale_factor": 2}),
    ((2, 3, 5, 7), {"scale_factor": (2, 3)}),
    ((2, 3, 5, 7), {"scale_factor": 1.7}),
    ((2, 3, 5, 7), {"scale_factor": 2.05}),  # output is 2x, source indices are not i // 2
    ((2, 3, 5, 7), {"scale_factor": 1.5, "recompute_scale_factor": True}),
    ((2, 3, 5, 7), {"size": (12, 9)}),
    ((2, 3, 5, 7), {"size": 11}),
    ((2, 3, 9), {"scale_factor": 3}),
    ((1, 2, 3, 4, 5), {"scale_factor": 2}),
]


class Net(nn.Module):
    def __init__(self, channels: int, dims: int, kwargs: dict) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv = conv(channels, 4, 3, padding=1)
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.conv(x), mode="nearest", **self.kwargs)
        return torch.tanh(y) * 1.5


def _run(model: nn.Module, x: torch.Tensor, cot: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(cot)
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("shape,kwargs", CASES, ids=[str(k) + str(len(s)) for s, k in CASES])
def test_nearest_upsampling_matches_eager(shape: tuple, kwargs: dict) -> None:
    torch.manual_seed(0)
    model = Net(shape[1], len(shape) - 2, kwargs)
    x = torch.randn(shape)
    want_out = model(x)
    cot = torch.randn_like(want_out)
    want, want_grads = _run(model, x, cot)
    got, got_grads = _run(ember.compile(model), x, cot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{"scale_factor": 2}, {"size": (7, 10)}], ids=["x2", "size"])
def test_generated_kernel_target_with_channels_last(kwargs: dict) -> None:
    """The GPU code path (Triton interpreter): the layout pass makes the convolution channels_last,
    and the custom op's fake result must describe the strides ATen's kernel really returns."""
    torch.manual_seed(3)
    model = Net(3, 2, kwargs)
    x = torch.randn(2, 3, 4, 5)
    cot = torch.randn_like(model(x))
    want, want_grads = _run(model, x, cot)
    got, got_grads = _run(ember.compile(model, target="triton-interpret"), x, cot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_channels_last_input_keeps_its_layout_and_gradient() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t * 2, scale_factor=2) + 1

    leaf = x.clone().requires_grad_(True)
    want = fn(leaf)
    cot = torch.randn_like(want)
    want.backward(cot)
    got_leaf = x.clone().requires_grad_(True)
    got = ember.compile(fn)(got_leaf)
    got.backward(cot)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_leaf.grad, leaf.grad)
    assert got.is_contiguous(memory_format=torch.channels_last) == want.is_contiguous(memory_format=torch.channels_last)


def test_graphs_call_aten_upsampling_not_index_put() -> None:
    torch.manual_seed(2)
    model = Net(3, 2, {"scale_factor": 2})
    report = ember.explain(model, torch.randn(2, 3, 4, 4, requires_grad=True))
    programs = {g.kind: g.program for g in report.graphs}
    assert "torch.ops.ember.upsample_nearest.default" in programs["forward"]
    assert "torch.ops.ember.upsample_nearest_backward.default" in programs["backward"]
    for program in programs.values():
        assert "index_put" not in program and "aten.index." not in program
    assert "ATen's kernel behind Ember's custom op" in programs["forward"]


def test_rewrite_leaves_other_modes_alone() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (F.interpolate(x, scale_factor=2, mode="bilinear") + F.interpolate(x, size=(8, 8))
                + F.interpolate(x, scale_factor=2, mode="nearest-exact"))

    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen.append(rewrite_nearest_interpolate(gm))
        return gm.forward

    x = torch.randn(1, 2, 4, 4)
    out = torch.compile(fn, backend=backend)(x)
    assert seen == [1]  # only the nearest call
    torch.testing.assert_close(out, fn(x))
