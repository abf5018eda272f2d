"""Depthwise convolution through Ember's own Triton kernels (ops/depthwise_conv.py,
passes/depthwise.py), run by Triton's interpreter on CPU tensors: the forward (with and without a
bias), the input and weight gradients against ATen's convolution over strides, paddings,
dilations, window sizes and both layouts; the pass's rule; a model trained through
``ember.compile`` against eager; the compile jobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._prims_common import suggest_memory_format

import ember
from ember import config
from ember.ops import depthwise_conv
from ember.passes.depthwise import takes


@st.composite
def convolutions(draw: st.DrawFn) -> tuple:
    k = [draw(st.integers(1, 5)), draw(st.integers(1, 5))]
    s = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    d = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    p = [draw(st.integers(0, k[0])), draw(st.integers(0, k[1]))]
    reach = [d[i] * (k[i] - 1) + 1 - 2 * p[i] for i in range(2)]
    h, w = draw(st.integers(max(1, reach[0]), 10)), draw(st.integers(max(1, reach[1]), 10))
    n, c = draw(st.integers(1, 2)), draw(st.integers(2, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(n, c, h, w, generator=g)
    if draw(st.booleans()):
        x = x.to(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, *k, generator=g)
    bias = torch.randn(c, generator=g) if draw(st.booleans()) else None
    return x, weight, bias, s, p, d


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, s: list[int], p: list[int],
           d: list[int]) -> None:
    c = x.shape[1]
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.conv2d(xr, wr, bias, s, p, d, c)
    grad = torch.randn_like(want)
    want_dx, want_dw = torch.autograd.grad(want, (xr, wr), grad)
    got = depthwise_conv.depthwise_conv2d(x, weight, bias, s, p, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.stride() == torch.empty(got.shape, memory_format=suggest_memory_format(x)).stride()  # x's format
    got_dx = depthwise_conv.depthwise_conv2d_backward_input(grad, weight, list(x.shape), s, p, d)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    got_dw = depthwise_conv.depthwise_conv2d_backward_weight(grad, x, weight, s, p, d)
    torch.testing.assert_close(got_dw, want_dw, rtol=1e-5, atol=1e-4)
    assert got_dw.stride() == torch.empty(weight.shape, memory_format=suggest_memory_format(x)).stride()


@settings(max_examples=30, deadline=None)
@given(convolutions())
def test_kernels_match_aten(case: tuple) -> None:
    _check(*case)


@pytest.mark.parametrize("window,stride", [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1)])
def test_mobilenet_and_convnext_windows_match_aten(window: int, stride: int) -> None:
    torch.manual_seed(window * 10 + stride)
    x = torch.randn(2, 24, 11, 12).to(memory_format=torch.channels_last)
    _check(x, torch.randn(24, 1, window, window), torch.randn(24), [stride] * 2, [window // 2] * 2, [1, 1])


def test_weight_gradient_sums_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # More output tiles than chunks: each chunk sums several tiles, the op sums the chunks.
    monkeypatch.setattr(depthwise_conv, "TARGET_PROGRAMS", 4)
    torch.manual_seed(3)
    x = torch.randn(2, 64, 12, 12).to(memory_format=torch.channels_last)
    chunks, per_chunk = depthwise_conv.weight_chunks(2 * 12 * 12, 64, 16)
    assert chunks > 1 and per_chunk > 1
    _check(x, torch.randn(64, 1, 3, 3), None, [1, 1], [1, 1], [1, 1])


def test_bf16_rounds_like_aten() -> None:
    torch.manual_seed(4)
    x = torch.randn(2, 16, 9, 9).to(torch.bfloat16).to(memory_format=torch.channels_last)
    weight = torch.randn(16, 1, 3, 3).to(torch.bfloat16)
    bias = torch.randn(16).to(torch.bfloat16)
    got = depthwise_conv.depthwise_conv2d(x, weight, bias, [2, 2], [1, 1], [1, 1])
    # Summed in float32, bias included, rounded once (ATen's CUDA kernels round the same way).
    want = F.conv2d(x.float(), weight.float(), bias.float(), 2, 1, 1, 16).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("why", ["nchw", "multiplier", "grouped", "transposed", "float64", "one_channel"])
def test_what_the_rule_does_not_take_stays_cudnn(why: str) -> None:
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    weight = torch.randn(8, 1, 3, 3)
    transposed, groups = False, 8
    if why == "nchw":
        x = x.contiguous()  # ATen's own depthwise kernels, no build at the first call
    elif why == "multiplier":
        weight = torch.randn(16, 1, 3, 3)
    elif why == "grouped":
        weight, groups = torch.randn(8, 2, 3, 3), 4
    elif why == "transposed":
        transposed = True
    elif why == "float64":
        x, weight = x.double(), weight.double()
    else:
        x, weight, groups = torch.randn(2, 1, 10, 10).to(memory_format=torch.channels_last), weight[:1], 1
    assert takes(torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last), torch.randn(8, 1, 3, 3),
                 [1, 1], [1, 1], [1, 1], False, [0, 0], 8)
    assert not takes(x, weight, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)


class InvertedResidual(nn.Module):
    """MobileNet's block: expand, depthwise (stride 2, with and without a bias), project."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.depthwise = nn.Sequential(nn.Conv2d(16, 16, 3, 2, 1, groups=16, bias=False), nn.BatchNorm2d(16),
                                       nn.Hardswish())
        self.depthwise5 = nn.Conv2d(16, 16, 5, 1, 2, groups=16)
        self.project = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.depthwise5(self.depthwise(self.expand(x))))


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("enabled", [True, False], ids=["ember_kernels", "off"])
def test_a_trained_block_matches_eager_and_says_what_ran(enabled: bool) -> None:
    torch.manual_seed(5)
    eager = InvertedResidual()
    model = InvertedResidual()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(2, 4, 12, 12)
    want, want_grads = _train_step(eager, x)
    with config.patch(layout_min_activation_to_weight=0.0, depthwise_kernels=enabled):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        got, got_grads = _train_step(compiled, x)
        report = ember.explain(compiled, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    programs = {g.kind: g.program for g in report.graphs}
    forward_calls = programs["forward"].count("torch.ops.ember.depthwise_conv2d.default")
    backward_calls = [programs["backward"].count(f"torch.ops.ember.depthwise_conv2d_backward_{k}.default")
                      for k in ("input", "weight")]
    if enabled:
        assert forward_calls == 2 and backward_calls == [2, 2]
    else:
        assert forward_calls == 0 and backward_calls == [0, 0]


def test_the_compile_jobs_follow_the_graphs_shapes() -> None:
    # One job per kernel with as many arguments as the kernel takes before its constexprs; the
    # integers are the launch's own values (Triton specialises on them). Fake CUDA tensors.
    from torch._subclasses import FakeTensorMode

    from ember.runtime import precompile

    with FakeTensorMode():
        x = torch.empty(2, 8, 9, 9, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        w = torch.empty(8, 1, 3, 3, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(2, 8, 5, 5, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        ops = torch.ops.ember
        gm = torch.fx.symbolic_trace(lambda a, b, c: (
            ops.depthwise_conv2d.default(a, b, None, [2, 2], [1, 1], [1, 1]),
            ops.depthwise_conv2d_backward_input.default(c, b, [2, 8, 9, 9], [2, 2], [1, 1], [1, 1]),
            ops.depthwise_conv2d_backward_weight.default(c, a, b, [2, 2], [1, 1], [1, 1])))
        for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], (x, w, g)):
            node.meta["val"] = value
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        calls[0].meta["val"] = y = depthwise_conv.depthwise_conv2d(x, w, None, [2, 2], [1, 1], [1, 1])
        calls[1].meta["val"] = depthwise_conv.depthwise_conv2d_backward_input(g, w, [2, 8, 9, 9], [2, 2], [1, 1], [1, 1])
        calls[2].meta["val"] = depthwise_conv.depthwise_conv2d_backward_weight(g, x, w, [2, 2], [1, 1], [1, 1])
    jobs = depthwise_conv.compile_jobs(gm)
    assert [j.name for j in jobs] == ["depthwise_forward", "depthwise_backward_input", "depthwise_backward_weight"]
    forward = jobs[0]
    ints = [2 * 5 * 5, 8, 9, 9, 5, 5, *x.stride(), *w.stride()[0:1], *w.stride()[2:], *y.stride()]
    assert list(forward.arg_dtypes[4:]) == [precompile.int_arg(v) for v in ints]
    assert dict(forward.meta)["HAS_BIAS"] is False and dict(forward.meta)["SH"] == 2
    assert dict(jobs[2].meta)["TAPS"] == 16
    kernels = depthwise_conv.window_kernels(False)  # compiled mode: built at a launch, none here
    for job in jobs:
        fn = getattr(kernels, job.name)
        assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])
