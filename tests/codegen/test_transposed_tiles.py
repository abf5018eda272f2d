"""Pointwise kernels reading or writing a transposed tensor walk it in 2-D tiles (codegen/triton_tiles.py
``transposed_dims``): results equal eager's through Triton's interpreter, forward and backward,
persistent and looped tiles, odd sizes; the rule picks a tile only where a large tensor is transposed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from ember_check import assert_close, make_input, random_values, strict_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ember
from ember import config


def _run(fn: Callable, args: Sequence[torch.Tensor], grad: bool = False) -> list[str]:
    """``fn`` through the interpreter against eager (outputs, and gradients when ``grad``); the
    names of the kernels it generated."""
    torch._dynamo.reset()
    leaves = [a.detach().clone().requires_grad_(grad) for a in args]
    with strict_env():
        compiled = ember.compile(fn, target="triton-interpret")
        got = compiled(*leaves)
    want_leaves = [a.detach().clone().requires_grad_(grad) for a in args]
    want = fn(*want_leaves)
    assert_close(got, want, "output")
    if grad:
        cot = random_values(want.shape, want.dtype)
        for g, w in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, want_leaves, cot)):
            assert_close(g, w, "gradient")
    return [name for g in compiled._ember_backend.log.graphs for name in g.kernel_sources]


def _tiled(names: list[str]) -> int:
    return sum(name.startswith("ember_tpw_") for name in names)


def test_channels_last_copy_walks_a_two_dimensional_tile() -> None:
    # The NCHW input's H and W (S dims 2 and 3) are one contiguous run: the tile's second axis
    # walks both (one 120-long row), the first walks N and C (the output's stride-1 dim).
    x = make_input((2, 24, 10, 12), "contiguous")
    torch._dynamo.reset()
    with strict_env():
        compiled = ember.compile(lambda t: (t * 2 + 1).permute(0, 2, 3, 1).contiguous(), target="triton-interpret")
        torch.testing.assert_close(compiled(x), (x * 2 + 1).permute(0, 2, 3, 1).contiguous())
    (source,) = [s for g in compiled._ember_backend.log.graphs for s in g.kernel_sources.values()]
    assert "ember_tpw_" in source and "r walks dims [2, 3]" in source and "x=48 r=120" in source, source


def test_transposed_input_beside_a_contiguous_one_forward_and_backward() -> None:
    a, b = make_input((3, 40, 24), "contiguous"), make_input((3, 24, 40), "contiguous")
    names = _run(lambda p, q: torch.tanh(p.transpose(1, 2) + q), [a, b], grad=True)
    assert _tiled(names) >= 1, names


def test_odd_sizes_are_masked() -> None:
    x = make_input((3, 37, 29, 11), "contiguous")
    names = _run(lambda t: t.permute(0, 3, 1, 2).contiguous().sigmoid(), [x])
    assert _tiled(names) == 1, names


def test_a_tile_dim_longer_than_the_tile_takes_a_second_grid_axis() -> None:
    # The interpreter's tile side is 1024: the 1100-long stride-1 dim of the input takes two tiles.
    x = make_input((16, 1100), "contiguous")
    torch._dynamo.reset()
    with strict_env():
        compiled = ember.compile(lambda t: (t.t() * 3).contiguous(), target="triton-interpret")
        torch.testing.assert_close(compiled(x), (x.t() * 3).contiguous())
    (source,) = [s for g in compiled._ember_backend.log.graphs for s in g.kernel_sources.values()]
    assert "r walks dims [0]" in source and "split=2x1024" in source, source


def test_short_or_untransposed_dims_keep_one_index() -> None:
    x = make_input((4, 6, 5), "contiguous")
    assert _tiled(_run(lambda t: t.transpose(1, 2).contiguous() + 1, [x])) == 0  # sides under 8
    y = make_input((16, 40), "contiguous")
    assert _tiled(_run(lambda t: t * 2 + 1, [y])) == 0
    z = make_input((16, 40), "contiguous")
    assert _tiled(_run(lambda t, b: t + b, [z, make_input((40,), "contiguous")])) == 0  # a broadcast row


def test_setting_zero_turns_the_tiles_off() -> None:
    x = make_input((2, 24, 10, 12), "contiguous")
    with config.patch(transpose_tile=0):
        names = _run(lambda t: (t * 2 + 1).permute(0, 2, 3, 1).contiguous(), [x])
    assert _tiled(names) == 0 and names, names


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tiles(dtype: torch.dtype) -> None:
    x = make_input((2, 16, 9, 20), "contiguous", dtype=dtype)
    names = _run(lambda t: (t.float() * 0.5).to(dtype).permute(0, 2, 3, 1).contiguous(), [x])
    assert _tiled(names) == 1, names


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_permutations_match_eager(data: st.DataObject) -> None:
    rank = data.draw(st.integers(2, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 20), min_size=rank, max_size=rank)))
    perm = data.draw(st.permutations(range(rank)))
    x = make_input(shape, "contiguous")
    _run(lambda t: (t.permute(*perm) * 1.5 - 0.25).contiguous(), [x])
