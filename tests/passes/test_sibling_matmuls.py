"""Sibling matmuls merged in GPU inference graphs (passes/sibling_matmuls.py): attention's query,
key and value projections (with and without bias, of different widths) and a gated MLP's gate and
up projections become one matmul over concatenated, frozen weights; results equal eager's on the
Triton interpreter, before and after the weights change; nothing merges in training, for a
second operand that is not a parameter, or with the option off.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from core_helpers import assert_close, assert_compiled_cleanly, log_of

import ember

nn = torch.nn
F = torch.nn.functional


class Attention(nn.Module):
    """Grouped-query attention: key and value narrower than the query; a gated MLP after it."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32, bias=bias)
        self.k = nn.Linear(32, 16, bias=bias)
        self.v = nn.Linear(32, 16, bias=bias)
        self.o = nn.Linear(32, 32, bias=bias)
        self.gate = nn.Linear(32, 48, bias=False)
        self.up = nn.Linear(32, 48, bias=False)
        self.down = nn.Linear(48, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        h = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 32))
        return h + self.down(F.silu(self.gate(h)) * self.up(h))


class ReturnsProjections(nn.Module):
    """The merged products are graph outputs themselves: returned in eager's strides."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _pair(cls: type[nn.Module], *args: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model, eager = cls(*args).eval(), cls(*args).eval()
    eager.load_state_dict(model.state_dict())
    return model, eager


def _merges(compiled: object) -> list[str]:
    return [line for g in log_of(compiled).graphs for line in g.merged_matmuls]


@pytest.mark.parametrize("bias", [True, False])
def test_projections_merge_and_match_eager_before_and_after_a_weight_change(bias: bool) -> None:
    model, eager = _pair(Attention, bias)
    compiled = ember.compile(model, target="triton-interpret")
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        assert_close(compiled(x), eager(x), "first call")
        for m in (model, eager):  # an in-place update under no_grad bumps the versions: recomputed
            m.k.weight.mul_(-1.5)
            m.up.weight.add_(0.25)
        x = torch.randn(2, 6, 32)
        assert_close(compiled(x), eager(x), "after the weights changed")
    assert_compiled_cleanly(log_of(compiled))
    merges = _merges(compiled)
    kind = "addmm" if bias else "mm"
    assert f"3 {kind}s of [12] rows, N 32+16+16" in merges, merges
    assert "2 mms of [12] rows, N 48+48" in merges, merges


def test_merged_outputs_keep_eagers_strides() -> None:
    model, eager = _pair(ReturnsProjections)
    compiled = ember.compile(model, target="triton-interpret")
    x = torch.randn(5, 8)
    with torch.no_grad():
        got, want = compiled(x), eager(x)
    assert _merges(compiled) == ["2 addmms of [5] rows, N 8+4"]
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        assert_close(g, w)


def test_nothing_merges_in_training_or_with_the_option_off() -> None:
    model, eager = _pair(Attention, True)
    x = torch.randn(2, 6, 32)
    training = ember.compile(model, target="triton-interpret")
    assert_close(training(x), eager(x))  # gradients on: forward and backward graphs, weights change
    assert _merges(training) == []
    off = ember.compile(model, target="triton-interpret", merge_matmuls=False)
    with torch.no_grad():
        assert_close(off(x), eager(x))
    assert _merges(off) == []


def test_a_second_operand_that_is_not_a_parameter_is_not_merged() -> None:
    class Products(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x @ self.w + x @ y  # y is an activation: no frozen weight to concatenate

    model, eager = _pair(Products)
    compiled = ember.compile(model, target="triton-interpret")
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    with torch.no_grad():
        assert_close(compiled(x, y), eager(x, y))
    assert _merges(compiled) == []


def test_parameters_copied_beyond_the_cap_are_not_merged() -> None:
    # float32 without autocast: the weights are the parameters themselves, so the concatenation
    # is a second copy of them, which the cap bounds.
    model, eager = _pair(Attention, True)
    x = torch.randn(2, 6, 32)
    with ember.config.patch(merge_matmuls_max_copy_mb=0.01), torch.no_grad():
        compiled = ember.compile(model, target="triton-interpret")
        assert_close(compiled(x), eager(x))
    lines = _merges(compiled)
    # q, k, v with biases: (32 + 16 + 16) x 32 weights and 64 biases, float32: 8,448 bytes, within
    # 0.01 MB; gate and up: 2 x 48 x 32 x 4 = 12,288 more would pass the cap.
    assert "3 addmms of [12] rows, N 32+16+16" in lines, lines
    assert "not merged: 2 products would copy 0.0 MB of parameters (merge_matmuls_max_copy_mb left: 0.0)" in lines


class _CastsAtConcatenation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, at every ``cat``, how many casts already concatenated are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.concatenated: list[weakref.ref] = []
        self.alive_at_cat: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten.cat.default:
            self.alive_at_cat.append(sum(r() is not None for r in self.concatenated))
            self.concatenated += [weakref.ref(t) for t in args[0]]
        return func(*args, **(kwargs or {}))


def test_casts_read_only_by_the_concatenation_are_freed_at_once() -> None:
    # Under autocast each projection's bf16 cast feeds only the concatenated weight. Held until the
    # parameter-only values were all computed, they sat between the values kept for the model's
    # life and left gaps in the caching allocator (bert-base: 40 MiB).
    model, eager = _pair(Attention, True)
    compiled = ember.compile(model, target="triton-interpret")
    x = torch.randn(2, 6, 32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:
        compiled(x)
        for m in (model, eager):
            m.q.weight.mul_(-1.0)  # a new version: the next call computes the values again
        mode = _CastsAtConcatenation()
        with mode:
            got = compiled(x)
        want = eager(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    # q/k/v weights, q/k/v biases, gate/up weights: no cast of an earlier one still alive.
    assert mode.alive_at_cat == [0, 0, 0], mode.alive_at_cat
