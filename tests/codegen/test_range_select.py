"""cat, stack and slice_scatter inside generated kernels (schedule/range_select.py) vs eager.

On the Triton path (``target="triton-interpret"``) each case checks outputs and gradients on
fresh random inputs and that the cat ran in a generated kernel, not as an ATen op; on the CPU
target (numba: no range selects, the cat stays on ATen) and with ``fuse_cat=False`` the results
must still match eager.
"""

from __future__ import annotations

import pytest
import torch
from ember_check import assert_close, check, make_input, strict_env

import ember
from ember import config


def _graphs(compiled) -> list:
    return compiled._ember_backend.log.graphs


def _not_on_aten(compiled, ops=("aten.cat", "aten.slice_scatter")) -> None:
    for g in _graphs(compiled):
        fallback = g.placement.get("fallback", {})
        assert not any(op in fallback for op in ops), f"{g.title}: {dict(fallback)}\n{g.plan_text}"


def _generated(compiled, op: str, kinds=("forward", "inference", "backward")) -> int:
    return sum(g.placement.get("generated", {}).get(op, 0) for g in _graphs(compiled) if g.kind in kinds)


class Rope(torch.nn.Module):
    """Llama-style rotary embedding of a projection: q * cos + rotate_half(q) * sin."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


class StackedProjections(torch.nn.Module):
    """Three projections stacked, and one projection unbound into three (its backward stacks)."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack([self.a(x), self.b(x).relu(), self.c(x)], dim=1).tanh()
        q, k, v = self.qkv(x).view(x.shape[0], 3, -1).unbind(1)
        return stacked.sum(1) + q * k + v.sigmoid()


def _compare_module(module: torch.nn.Module, args: list[torch.Tensor], target: str, **options) -> object:
    """Outputs and the gradients of every parameter and float input against eager; the compiled model."""
    torch.manual_seed(0)
    with strict_env():
        compiled = ember.compile(module, target=target, **options)
        want, got = module(*args), compiled(*args)
        assert_close(got, want, "output")
        leaves = [a for a in args if a.requires_grad] + list(module.parameters())
        cot = torch.randn_like(want)
        gw = torch.autograd.grad(want, leaves, cot)
        gg = torch.autograd.grad(got, leaves, cot)
        for i, (a, b) in enumerate(zip(gg, gw)):
            assert_close(a, b, f"grad {i}")
    return compiled


def _rope_inputs() -> list[torch.Tensor]:
    return [torch.randn(2, 5, 16, requires_grad=True), torch.randn(5, 8), torch.randn(5, 8)]


def test_rope_rotate_half_fuses_forward_and_backward():
    compiled = _compare_module(Rope(), _rope_inputs(), "triton-interpret")
    _not_on_aten(compiled)
    fwd = next(g for g in _graphs(compiled) if g.kind == "forward")
    # The cat, the slices, the negation and the rotary mul/add: one kernel.
    assert fwd.kernels == 1, fwd.plan_text
    assert _generated(compiled, "aten.cat", ("forward",)) == 1
    assert _generated(compiled, "aten.slice_scatter", ("backward",)) >= 1


def test_stack_and_unbind_backward_fuse():
    compiled = _compare_module(StackedProjections(), [torch.randn(4, 6, requires_grad=True)], "triton-interpret")
    _not_on_aten(compiled)
    assert _generated(compiled, "aten.cat", ("forward",)) == 1
    assert _generated(compiled, "aten.cat", ("backward",)) >= 1  # unbind's gradient is a stack


@pytest.mark.parametrize("dim", [-1, 1, -2, 0])
def test_cat_of_three_with_mixed_producers(dim):
    a = make_input((3, 4, 5), "contiguous", requires_grad=True)
    b = make_input((3, 4, 5), "transposed", requires_grad=True)
    c = make_input((3, 4, 5), "contiguous", requires_grad=True)
    sizes = {-1: (3, 4, 2), 1: (3, 2, 5), -2: (3, 2, 5), 0: (2, 4, 5)}[dim]
    d = torch.randn(sizes)
    w = torch.randn(5)

    def fn(a, b, c, d):
        # pointwise producers, a graph input read as is, a broadcast, and a producer kept
        # elsewhere (a.sin() is also an output)
        s = a.sin()
        out = torch.cat([s * 2.0, b, (c + w).relu(), d], dim=dim)
        return out.exp() * 0.5, s

    check(fn, [a, b, c, d], expect_ops=["aten.cat"])


def test_cat_with_an_empty_input():
    a = make_input((3, 4), "contiguous", requires_grad=True)
    e = torch.randn(3, 0, requires_grad=True)
    b = make_input((3, 2), "contiguous", requires_grad=True)
    check(lambda a, e, b: torch.cat([a.exp(), e * 3.0, b, e], dim=1) - 1.0, [a, e, b], expect_ops=["aten.cat"])


def test_cat_of_one_element_rows_and_bf16():
    a = make_input((4, 1), "contiguous", torch.bfloat16)
    b = make_input((4, 3), "contiguous", torch.bfloat16)
    check(lambda a, b: torch.cat([a, b.neg()], 1) * 3.0, [a, b], expect_ops=["aten.cat"])


def test_slice_scatter_inside_a_kernel():
    base = make_input((4, 6, 3), "contiguous")
    src = make_input((4, 2, 3), "permuted")
    check(lambda base, src: torch.slice_scatter(base.exp(), src * 2.0, dim=1, start=3, end=5) + 1.0,
          [base, src], expect_ops=["aten.slice_scatter"])


def test_cat_of_more_inputs_than_the_limit_stays_on_aten():
    xs = [torch.randn(2, 3) for _ in range(9)]
    with strict_env():
        compiled = ember.compile(lambda *xs: torch.cat([x * 2 for x in xs], 0) + 1, target="triton-interpret")
        assert_close(compiled(*xs), torch.cat([x * 2 for x in xs], 0) + 1)
    (g,) = _graphs(compiled)
    assert g.placement["fallback"]["aten.cat"] == 1


@pytest.mark.parametrize("target,options", [("cpu", {}), ("triton-interpret", {"fuse_cat": False})],
                         ids=["cpu", "switched-off"])
def test_cat_on_aten_where_not_fused(target, options):
    pytest.importorskip("numba") if target == "cpu" else None
    compiled = _compare_module(Rope(), _rope_inputs(), target, **options)
    fallback = sum(g.placement.get("fallback", {}).get("aten.cat", 0) for g in _graphs(compiled))
    assert fallback == 1, [g.plan_text for g in _graphs(compiled)]
    compiled = _compare_module(StackedProjections(), [torch.randn(4, 6, requires_grad=True)], target, **options)


def test_option_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_FUSE_CAT", "0")
    assert config.Options.from_env().fuse_cat is False
