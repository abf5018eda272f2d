"""torch.roll and constant padding as slices and a cat (capture/decompositions.py), generated inside kernels vs eager.

A roll over several dims is a cat of cats; the outer cat inlines the inner ones
(schedule/plan.py, codegen/kernel_writer.py), so the whole roll and its consumers are one
kernel with no ATen gather (PyTorch's reference decomposition is an index_select per dim).
"""

from __future__ import annotations

import pytest
import torch
from ember_check import assert_close, check, make_input, strict_env

import ember


def _kernels(compiled, kind: str) -> int:
    return sum(g.kernels for g in compiled._ember_backend.log.graphs if g.kind == kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_roll_over_two_dims_with_negative_shifts(dtype):
    # swin's cyclic shift: (B, H, W, C), shifts (-s, -s) over dims (1, 2), and back.
    x = make_input((2, 7, 6, 5), "contiguous", dtype, requires_grad=True)
    w = torch.randn(5, dtype=dtype)
    check(lambda x: (torch.roll(x * 2.0, shifts=(-3, -2), dims=(1, 2)) + w).relu(), [x],
                   expect_ops=["aten.cat"])


def test_roll_back_and_forth_on_channels_last():
    # NCHW tensor in channels_last memory; positive and negative shifts, one dim larger than
    # its size, and a shift of a whole period (no-op on that dim).
    x = make_input((2, 3, 5, 6), "channels_last", requires_grad=True)

    def fn(x):
        y = torch.roll(x.sin(), shifts=(2, -8, 6), dims=(2, 3, 3))
        return torch.roll(y, shifts=(-1,), dims=(-1,)) * x

    check(fn, [x], expect_ops=["aten.cat"])


def test_roll_of_one_dim_is_one_kernel_forward_and_backward():
    x = make_input((4, 9), "contiguous", requires_grad=True)
    check(lambda x: torch.roll(x, 4, 1).exp() - x, [x], expect_ops=["aten.cat"])


def test_two_dim_roll_fuses_into_its_consumer():
    x = torch.randn(2, 8, 8, 3, requires_grad=True)
    fn = lambda x: torch.roll(x, shifts=(-3, -3), dims=(1, 2)).tanh()  # noqa: E731
    with strict_env():
        compiled = ember.compile(fn, target="triton-interpret")
        assert_close(compiled(x), fn(x))
    graphs = compiled._ember_backend.log.graphs
    assert not any("aten.index_select" in g.placement.get("fallback", {}) for g in graphs)
    # The slices, both cats and the tanh: one kernel reading x once.
    assert _kernels(compiled, "forward") == 1, [g.plan_text for g in graphs]


def test_flattened_roll_stays_correct():
    # No dims: PyTorch's reference (roll of the flattened tensor) keeps it; still matches eager.
    x = torch.randn(3, 4)
    compiled = ember.compile(lambda x: torch.roll(x + 1, 5) * 2, target="triton-interpret")
    assert_close(compiled(x), torch.roll(x + 1, 5) * 2)


@pytest.mark.parametrize("pad", [(0, 0, 0, 2, 0, 3), (0, 0, 0, 0, 0, 0), (1, -2, 0, 0, -1, 2)],
                         ids=["window", "zero", "mixed"])
def test_constant_pad_is_generated(pad):
    # swin's F.pad to a multiple of the window (channels last, (B, H, W, C)); a zero pad; crops.
    x = make_input((2, 5, 6, 4), "contiguous", requires_grad=True)
    check(lambda x: torch.nn.functional.pad(x * 2.0, pad, value=0.5).sigmoid(), [x], expect_ops=["aten.sigmoid"])
