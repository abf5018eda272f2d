"""Values computed again in the group that reads them instead of stored (schedule/recompute.py),
and reductions over the same values merged (group_merge.merge_sibling_reductions).

A LayerNorm backward: the row group computes the input gradient, and the weight and bias sums
over the rows recompute the normalised input from the saved statistics in one kernel of their
own, so the row group stores the input gradient only. A stochastic-depth scale
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
    """Tokens on an H x W grid with H = W (a swin_t stage): LayerNorm over C, then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)).tanh()


def _backward_groups(recompute: bool) -> tuple[list[str], nn.Module]:
    torch.manual_seed(0)
    model = NormThenLinear()
    eager = copy.deepcopy(model)
    with config.patch(recompute_values=recompute):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        x = torch.randn(3, 5, 5, 12)
        x_got, x_want = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = compiled(x_got), eager(x_want)
        grad = torch.randn_like(want)
        (got * grad).sum().backward()
    (want * grad).sum().backward()
    assert_close(got, want, "forward")
    assert_close(x_got.grad, x_want.grad, "input gradient")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"gradient of {name}")
    backward = next(g for g in log_of(compiled).graphs if g.kind == "backward")
    # The row factor rstd / C ([3, 5, 5, 1], H = W) rides in the row group, placed by position.
    assert "S=[3, 5, 5, 1]" not in backward.plan_text, backward.plan_text
    return [line for line in backward.plan_text.splitlines() if "S=[3, 5, 5, 12]" in line], compiled


def test_layer_norm_weight_and_bias_sums_recompute_and_share_one_kernel() -> None:
    groups, _ = _backward_groups(recompute=True)
    rows = [g for g in groups if "D=[3]" in g]
    columns = [g for g in groups if "D=[0, 1, 2]" in g]
    assert len(rows) == 1 and " out=1 " in rows[0], groups  # the input gradient only
    assert len(columns) == 1 and " out=2 " in columns[0], groups  # weight and bias gradients
    assert "merged with a reduction reading the same values" in columns[0]


def test_with_recompute_off_the_row_group_stores_what_the_sums_read() -> None:
    groups, _ = _backward_groups(recompute=False)
    rows = [g for g in groups if "D=[3]" in g]
    columns = [g for g in groups if "D=[0, 1, 2]" in g]
    assert len(rows) == 1 and " out=2 " in rows[0], groups
    assert len(columns) == 2, groups


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
