"""A Linear's bias gradient (a sum over batch x tokens, rows a reshape merged) beside the input
gradient the matmuls read: with ``fuse_merged_row_sums`` both come from one Triton kernel whose
first reduction loop stores the full-size gradient while it sums it (``store_before_reductions``),
in one pass; split over programs, the partial-result kernel stores it and the combining kernel
does not. Gradients equal eager's; with both settings off the sum reads the stored value again."""

from __future__ import annotations

import pytest
import torch
from core_helpers import assert_close, log_of

import ember
from ember import config

# Small blocks, so the interpreter loops over the rows and splits them across programs.
LOOPED = {"loop_rblock": 64, "persistent_rblock_max": 64}
SPLIT = {**LOOPED, "interpret_split_target_programs": 64}


class GeluMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _train_step(blocks: dict, **settings: bool) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model, reference = GeluMLP(), GeluMLP()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 25, 16)  # 200 rows: several loop iterations and chunks
    with config.patch(**blocks, **settings):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, name)
    (backward,) = [g for g in log_of(compiled).graphs if g.kind == "backward"]
    gelu = {n: s for n, s in backward.kernel_sources.items() if "gelu_backward" in n}
    return gelu, {n: s for n, s in backward.kernel_sources.items() if n not in gelu}


def test_the_bias_gradient_and_the_full_gradient_come_from_one_loop() -> None:
    gelu, _ = _train_step(LOOPED, fuse_merged_row_sums=True, store_before_reductions=True)
    (name, source), = gelu.items()
    assert "_sum_" in name, name  # the bias gradient's sum joined the gelu backward
    assert source.count("for roffset") == 1, source  # stored and summed in one pass
    assert source.count("tl.store(out0 + (x_") == 1, source


def test_a_split_sum_stores_the_full_gradient_in_its_partial_kernel_only() -> None:
    gelu, _ = _train_step(SPLIT, fuse_merged_row_sums=True, store_before_reductions=True)
    parts = {n: s for n, s in gelu.items() if n.startswith("ember_part")}
    final = {n: s for n, s in gelu.items() if not n.startswith("ember_part")}
    assert parts and final, sorted(gelu)
    full_store = "rindex * 32"  # the [rows, 32] gradient's row stride
    assert all(full_store in s for s in parts.values()), parts
    assert not any(full_store in s for s in final.values()), final


@pytest.mark.parametrize("early", [False, True])
def test_without_the_fusion_the_sum_reads_the_stored_gradient(early: bool) -> None:
    gelu, rest = _train_step(LOOPED, fuse_merged_row_sums=False, store_before_reductions=early)
    assert all(n.startswith("ember_pw_") for n in gelu), sorted(gelu)
    assert any(n.startswith("ember_red_sum") for n in rest), sorted(rest)


def test_the_fused_kernel_computes_twice_without_early_stores() -> None:
    gelu, _ = _train_step(LOOPED, fuse_merged_row_sums=True, store_before_reductions=False)
    (source,) = gelu.values()
    assert source.count("for roffset") == 2, source  # sums, then computes again and stores
