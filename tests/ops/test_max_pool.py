"""Overlapping max pooling through Ember's own Triton kernels (ops/max_pool.py), run by
Triton's interpreter on CPU tensors: maxima, ATen's flat indices rebuilt from the int8 window
positions, and the gather backward, against ATen's kernels, ties, NaN and all--inf windows
included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.capture import pooling
from ember.ops import max_pool

aten = torch.ops.aten


@st.composite
def poolings(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    k = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
    s = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    p = [draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2))]
    h, w = draw(st.integers(max(1, k[0] - 2 * p[0]), 9)), draw(st.integers(max(1, k[1] - 2 * p[1]), 9))
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # Few distinct values: ties in most windows.
    x = torch.randint(-3, 3, (n, c, h, w), generator=g).float() if draw(st.booleans()) else \
        torch.randn(n, c, h, w, generator=g)
    if draw(st.booleans()):
        x.view(-1)[torch.randint(0, x.numel(), (2,), generator=g)] = float("nan")
    if draw(st.booleans()):
        x[0, 0, : min(h, 2), : min(w, 2)] = float("-inf")
    if draw(st.booleans()):
        x = x.to(memory_format=torch.channels_last)
    return x, k, s, p


def _check(x: torch.Tensor, k: list[int], s: list[int], p: list[int]) -> None:
    want, want_idx = aten.max_pool2d_with_indices(x, k, s, p)
    got, got_idx = pooling._overlapping(x, k, s, p, [1, 1], False)
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())
    assert torch.equal(want_idx, got_idx)
    assert _strides(got) == _strides(want)
    grad = torch.randn(want.shape, dtype=x.dtype).to(memory_format=torch.channels_last if x.stride(1) == 1 else torch.contiguous_format)
    # Summed in float32 and rounded once, as ATen's CUDA kernel does (its CPU kernel adds in bf16).
    want_dx = aten.max_pool2d_with_indices_backward(grad.float(), x.float(), k, s, p, [1, 1], False,
                                                    want_idx).to(x.dtype)
    _, positions = max_pool.max_pool2d(x, k, s, p)
    assert positions.dtype == torch.int8
    got_dx = max_pool.max_pool2d_backward(grad, positions, list(x.shape), k, s, p)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-6, atol=1e-6)
    assert _strides(got_dx) == _strides(want_dx)


def _strides(t: torch.Tensor) -> list[int]:
    """The strides that mean something: those of dims longer than one."""
    return [st for st, n in zip(t.stride(), t.shape) if n > 1]


@settings(max_examples=40, deadline=None)
@given(poolings())
def test_kernels_match_aten(case: tuple) -> None:
    _check(*case)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_resnet_stem_pooling_matches_aten(channels_last: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 14, 13)
    _check(x.to(memory_format=torch.channels_last) if channels_last else x, [3, 3], [2, 2], [1, 1])


def test_bf16_rounds_like_aten() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9).to(torch.bfloat16).to(memory_format=torch.channels_last)
    _check(x, [3, 3], [2, 2], [1, 1])


@pytest.mark.parametrize("why", ["dilation", "ceil_mode", "window", "padding", "float64"])
def test_what_the_kernels_do_not_take_stays_aten(why: str) -> None:
    x = torch.randn(1, 2, 12, 12)
    k, s, p, d, ceil = [3, 3], [2, 2], [1, 1], [1, 1], False
    if why == "dilation":
        d = [2, 2]
    elif why == "ceil_mode":
        ceil = True
    elif why == "window":
        x, k, p = torch.randn(1, 2, 20, 20), [12, 12], [0, 0]
    elif why == "float64":
        x = x.double()  # the kernels hold values in float32: a float64 maximum would be rounded
    else:
        k, p = [2, 2], [2, 2]  # more than half the window: ATen refuses it too
    assert pooling.max_pool2d_with_indices(x, k, s, p, d, ceil) is NotImplemented


def test_the_compile_jobs_follow_the_graphs_dtypes_windows_layouts_and_sizes() -> None:
    # One job per kernel, dtype, window, memory format and shape, with as many arguments as the
    # kernels take before their constexprs; the integers are the launch's own values (Triton
    # specialises on them, so the workers must build that binary). Fake CUDA tensors: no GPU needed.
    from torch._subclasses import FakeTensorMode

    from ember.runtime import precompile

    with FakeTensorMode():
        x = torch.empty(2, 4, 9, 9, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        g = torch.empty(2, 4, 5, 5, device="cuda")
        pos = torch.empty(2, 4, 5, 5, device="cuda", dtype=torch.int8)
        gm = torch.fx.symbolic_trace(lambda a, b, p: (
            torch.ops.ember.max_pool2d.default(a, [3, 3], [2, 2], [1, 1]),
            torch.ops.ember.max_pool2d_backward.default(b, p, [2, 4, 9, 9], [3, 3], [2, 2], [1, 1])))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, (x, g, pos)):
            node.meta["val"] = value
        forward_node, backward_node = [n for n in gm.graph.nodes if n.op == "call_function"]
        forward_node.meta["val"] = out, _ = max_pool.max_pool2d(x, [3, 3], [2, 2], [1, 1])
        backward_node.meta["val"] = dx = max_pool.max_pool2d_backward(g, pos, [2, 4, 9, 9], [3, 3], [2, 2], [1, 1])
    forward, backward = max_pool.compile_jobs(gm)
    assert (forward.name, backward.name) == ("max_pool2d_forward", "max_pool2d_backward")
    assert forward.arg_dtypes[:3] == ("bfloat16", "bfloat16", "int8")
    assert backward.arg_dtypes[:3] == ("float32", "int8", "float32")
    ints = [precompile.int_arg(v) for v in (2 * 4 * 5 * 5, 4, 9, 9, 5, 5, *x.stride(), *out.stride())]
    assert list(forward.arg_dtypes[3:]) == ints
    assert list(backward.arg_dtypes[3:]) == [precompile.int_arg(v) for v in (2 * 4 * 9 * 9, 4, 9, 9, 5, 5, *g.stride(),
                                                                              *dx.stride())]
    meta_f, meta_b = dict(forward.meta), dict(backward.meta)
    assert meta_f["CHANNELS_LAST"] and not meta_b["CHANNELS_LAST"] and meta_b["ROUND_BF16"] is False
    assert (meta_f["KH"], meta_f["SH"], meta_f["PH"]) == (3, 2, 1)
    kernels = max_pool.window_kernels(False)  # compiled mode: built at a launch, none here
    for job in (forward, backward):
        fn = getattr(kernels, job.name)
        assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])
