"""Values computed again in the group that reads them instead of stored (schedule/recompute.py),
and reductions over the same values merged (group_merge.merge_sibling_reductions).

A LayerNorm backward under bf16 autocast: the row group computes the input gradient, and the
weight and bias sums over the rows recompute the normalised input from the bf16 input and the
saved statistics in one kernel of their own, so the row group stores the input gradient only. A stochastic-depth scale
(``mask / keep``) is computed inside the kernel it scales instead of a kernel of its own.
Checked on the plan and against eager through the Triton interpreter, forward and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from core_helpers import assert_close, log_of
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember import config
from ember.capture.decompositions import decomposition_table
from ember.schedule.plan import FusedGroup, plan_graph

nn = torch.nn


class NormThenLinear(nn.Module):
    """Tokens on an H x W grid with H = W (a swin_t stage): a linear, LayerNorm over C, a linear.
    Under bf16 autocast the LayerNorm reads the first linear's bf16 output, as in a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.fc0(x))).tanh()


def _bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within 3% of the largest magnitude: bf16 keeps 8 bits of mantissa, and a matmul's gradient
    sums 75 rows of bf16 products in an order of its own."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.03 * want.float().abs().max().item() + 1e-3, f"{what}: max error {err}"


def _backward_groups(recompute: bool, bf16: bool = True) -> list[str]:
    torch.manual_seed(0)
    model = NormThenLinear()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 5, 5, 12)
    x_got, x_want = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(3, 5, 5, 12)
    with config.patch(recompute_values=recompute):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            got = compiled(x_got)
        (got.float() * grad).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        want = eager(x_want)
    (want.float() * grad).sum().backward()
    close = _bf16_close if bf16 else assert_close
    close(got, want, "forward")
    close(x_got.grad, x_want.grad, "input gradient")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        close(p.grad, q.grad, f"gradient of {name}")
    backward = next(g for g in log_of(compiled).graphs if g.kind == "backward")
    # The row factor rstd / C ([3, 5, 5, 1], H = W) rides in the row group, placed by position.
    assert "S=[3, 5, 5, 1]" not in backward.plan_text, backward.plan_text
    return [line for line in backward.plan_text.splitlines() if "S=[3, 5, 5, 12]" in line]


def _rows_and_columns(groups: list[str]) -> tuple[list[str], list[str]]:
    return [g for g in groups if "D=[3]" in g], [g for g in groups if "D=[0, 1, 2]" in g]


def test_layer_norm_weight_and_bias_sums_recompute_and_share_one_kernel() -> None:
    rows, columns = _rows_and_columns(_backward_groups(recompute=True))
    assert len(rows) == 1 and " out=1 " in rows[0], rows  # the input gradient only
    assert len(columns) == 1 and " out=2 " in columns[0], columns  # weight and bias gradients
    assert "merged with a reduction reading the same values" in columns[0]


def test_with_recompute_off_the_row_group_stores_what_the_sums_read() -> None:
    rows, columns = _rows_and_columns(_backward_groups(recompute=False))
    assert len(rows) == 1 and " out=3 " in rows[0], rows  # input gradient, float32 gradient, product
    assert len(columns) == 2, columns


def test_in_float32_the_product_stays_stored() -> None:
    """Recomputing gradient x normalised input would keep the float32 input alive until the sums,
    more bytes than the product it saves: the memory rule declines (the bias sum reads the
    matmul's gradient directly either way)."""
    rows, columns = _rows_and_columns(_backward_groups(recompute=True, bf16=False))
    assert len(rows) == 1 and " out=2 " in rows[0], rows
    assert len(columns) == 2, columns


def _plan(fn, *inputs: torch.Tensor, recompute: bool = True) -> list[FusedGroup]:
    gm = make_fx(fn, decomposition_table=decomposition_table())(*inputs)
    return [s for s in plan_graph(gm.graph, recompute=recompute).steps if isinstance(s, FusedGroup)]


def _drop_path(x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A residual branch ending in a matmul, scaled per sample (the scale's one reader is the
    kernel after the matmul)."""
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],)) @ y
    return x + h * (mask / 0.9)


@pytest.mark.parametrize("recompute", [True, False])
def test_a_stochastic_depth_scale_is_computed_in_the_kernel_it_scales(recompute: bool) -> None:
    x, y = torch.randn(4, 6, 6, 8), torch.randn(8, 8)
    mask = (torch.rand(4, 1, 1, 1) > 0.3).float()
    groups = _plan(_drop_path, x, mask, y, recompute=recompute)
    small = [g for g in groups if tuple(g.shape) == (4, 1, 1, 1)]
    assert len(small) == (0 if recompute else 1), [g.shape for g in groups]
    assert len(groups) == (2 if recompute else 3)
    with config.patch(recompute_values=recompute):
        compiled = ember.compile(_drop_path, target="triton-interpret", cache=False)
        assert_close(compiled(x, mask, y), _drop_path(x, mask, y), "result")
