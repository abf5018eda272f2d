"""Reflection padding through Ember's own Triton kernels (ops/reflection_pad.py), run by
Triton's interpreter on CPU tensors: the padded values, the gather backward and the layouts
against ATen's kernels, and what stays ATen's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

from ember.ops import reflection_pad
from ember.runtime import precompile

aten = torch.ops.aten


@st.composite
def paddings(draw: st.DrawFn) -> tuple[torch.Tensor, list[int]]:
    h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    pad = [draw(st.integers(0, w - 1)), draw(st.integers(0, w - 1)), draw(st.integers(0, h - 1)),
           draw(st.integers(0, h - 1))]
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 5)), h, w)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=g).to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    if draw(st.booleans()):
        x = x.to(memory_format=torch.channels_last)
    return x, pad


def _strides(t: torch.Tensor) -> list[int]:
    """The strides that mean something: those of dims longer than one."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def _check(x: torch.Tensor, pad: list[int]) -> None:
    want = aten.reflection_pad2d(x, pad)
    got = reflection_pad.decompose_forward(x, pad)
    assert torch.equal(got, want)
    assert _strides(got) == _strides(want)
    grad = torch.randn(want.shape).to(x.dtype).contiguous(memory_format=torch.channels_last if x.dim() == 4
                                                          and x.stride(1) == 1 < x.shape[1] else torch.contiguous_format)
    # Summed in float32 and rounded once (ATen's CUDA kernel adds atomically in the tensor's dtype).
    want_dx = aten.reflection_pad2d_backward(grad.float(), x.float(), pad).to(x.dtype)
    got_dx = reflection_pad.decompose_backward(grad, x, pad)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-6, atol=1e-6)
    assert got_dx.shape == x.shape
    assert got_dx.is_contiguous(memory_format=suggest_memory_format(grad))  # the gradient's layout


@settings(max_examples=40, deadline=None)
@given(paddings())
def test_kernels_match_aten(case: tuple) -> None:
    _check(*case)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cyclegan_paddings_match_aten(channels_last: bool) -> None:
    torch.manual_seed(0)
    for pad in ([3, 3, 3, 3], [1, 1, 1, 1], [0, 2, 1, 0]):
        x = torch.randn(2, 8, 10, 9)
        _check(x.to(memory_format=torch.channels_last) if channels_last else x, pad)


def test_a_3d_input_is_one_sample() -> None:
    torch.manual_seed(0)
    _check(torch.randn(4, 6, 5), [2, 1, 3, 4])


@pytest.mark.parametrize("why", ["integer", "pad_too_wide", "negative", "5d", "float64"])
def test_what_the_kernels_do_not_take_stays_aten(why: str) -> None:
    x, pad = torch.randn(1, 2, 6, 6), [1, 1, 1, 1]
    if why == "integer":
        x = torch.randint(0, 9, (1, 2, 6, 6))
    elif why == "pad_too_wide":
        pad = [6, 0, 0, 0]  # ATen refuses it too
    elif why == "negative":
        pad = [-1, 0, 0, 0]
    elif why == "float64":
        x = x.double()  # the kernels sum in float32: a float64 gradient would be rounded
    else:
        x = torch.randn(1, 1, 2, 6, 6)
    assert reflection_pad.decompose_forward(x, pad) is NotImplemented
    assert reflection_pad.decompose_backward(torch.randn(1), x, pad) is NotImplemented


def test_the_compile_jobs_follow_the_graphs_dtypes_and_layouts() -> None:
    # The jobs come from the graph after the passes (the layout pass decides the format): one per
    # kernel, dtype and memory format, with as many arguments as the kernels take before their
    # constexprs. Fake CUDA tensors: no GPU needed to build them.
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1, 4, 5, 5, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        y = torch.empty(2, 3, 6, 6, device="cuda")
        gm = torch.fx.symbolic_trace(lambda a, b: (reflection_pad.FORWARD_OP(a, [1, 1, 1, 1]),
                                                   reflection_pad.BACKWARD_OP(b, [2, 3, 4, 4], [1, 1, 1, 1])))
        for node, value in zip([n for n in gm.graph.nodes if n.op == "call_function"],
                               [reflection_pad.reflection_pad2d(x, [1, 1, 1, 1]),
                                reflection_pad.reflection_pad2d_backward(y, [2, 3, 4, 4], [1, 1, 1, 1])]):
            node.meta["val"] = value
    forward, backward = reflection_pad.compile_jobs(gm)
    assert (forward.name, backward.name) == ("reflection_pad2d_forward", "reflection_pad2d_backward")
    assert forward.arg_dtypes[:2] == ("bfloat16", "bfloat16") and backward.arg_dtypes[:2] == ("float32", "float32")
    assert set(forward.arg_dtypes[2:]) == set(backward.arg_dtypes[2:]) == {precompile.SCALAR_INT32}
    assert dict(forward.meta)["CHANNELS_LAST"] and not dict(backward.meta)["CHANNELS_LAST"]
    assert dict(backward.meta)["ROUND_BF16"] is False
    kernels = reflection_pad.window_kernels(False)  # compiled mode: built at a launch, none here
    for job in (forward, backward):
        fn = getattr(kernels, job.name)
        assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])
