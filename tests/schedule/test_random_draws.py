"""Random draws that read no computed value (stochastic depth's per-sample mask) are planned
first, so the residual add they scale joins the kernel that computes the block's output; the
draws keep their order, so the compiled step draws eager's numbers.
"""

from __future__ import annotations

import copy

import torch
from core_helpers import log_of
from torchvision.ops import StochasticDepth

import ember
from ember.schedule.plan import FusedGroup

nn = torch.nn
RANDOM_OPS_RAND = torch.ops.aten.rand.default


class ResidualBlocks(nn.Module):
    """Three pre-norm residual blocks with stochastic depth (timm and torchvision's vision
    transformers and ConvNeXt draw it per sample), then a dropout whose input is computed."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))
        self.mlps = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.drop_paths = nn.ModuleList(StochasticDepth(0.3, "row") for _ in range(3))
        self.dropout = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, mlp, drop_path in zip(self.norms, self.mlps, self.drop_paths):
            x = x + drop_path(torch.tanh(mlp(norm(x))).transpose(1, 2).contiguous().transpose(1, 2))
        return self.dropout(x)


def _step(model: nn.Module, fn: object, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = fn(xi)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), xi.grad] + [p.grad for p in model.parameters()]


def test_stochastic_depth_draws_go_first_and_match_eager() -> None:
    torch.manual_seed(0)
    model = ResidualBlocks().train()
    eager = copy.deepcopy(model)
    compiled = ember.compile(model, target="triton-interpret", cache=False)
    x = torch.randn(4, 6, 12)
    for seed in (3, 4):  # two steps: every call draws again, the same numbers as eager's
        want = _step(eager, eager, x, seed)
        got = _step(model, compiled, x, seed)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"tensor {i}: {m}")
        for p in list(model.parameters()) + list(eager.parameters()):
            p.grad = None
    forward = next(g for g in log_of(compiled).graphs if g.kind == "forward")
    plan = forward.plan_text.splitlines()
    draws = [i for i, line in enumerate(plan) if "bernoulli" in line]
    dropout = [i for i, line in enumerate(plan) if "native_dropout" in line or "rand" in line.split("[")[-1][:8]]
    assert len(draws) == 3, forward.plan_text
    first_group = next(i for i, line in enumerate(plan) if " fused-" in line)
    # The three draws come before any kernel, and their scalings are one kernel beside each other.
    assert max(draws) < first_group, forward.plan_text
    assert plan[first_group].count("div.Tensor") == 3, plan[first_group]
    # The dropout reads the blocks' output: it stays after them (its draw comes last in eager too).
    assert not dropout or min(dropout) > max(draws)
    # The scaled residual add joins the kernel that computes the block's output (before: a kernel
    # of its own per block, reading the stored output back).
    assert sum("no fused producer" in line and "[mul.Tensor, add.Tensor" in line for line in plan) == 0, \
        forward.plan_text


def test_a_draw_that_reads_a_computed_value_keeps_every_later_draw_in_place() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.capture.decompositions import decomposition_table
    from ember.schedule.plan import plan_graph

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = torch.nn.functional.dropout(torch.sigmoid(x), 0.5, training=True)  # draws like a computed value
        b = torch.rand(x.shape)  # reads nothing, but comes after the dropout's draw in the RNG stream
        return a * b + x

    gm = make_fx(fn, decomposition_table=decomposition_table())(torch.randn(3, 4))
    plan = plan_graph(gm.graph)
    seeded = torch.Tag.nondeterministic_seeded
    draws = [s for s in plan.steps if not isinstance(s, FusedGroup) and seeded in s.node.target.tags]
    # The dropout's in-place draw (not one of the ops Ember lowers) ends the prefix that may move:
    # torch.rand stays after it, where eager draws it.
    assert [d.node.target for d in draws] == [torch.ops.aten.bernoulli_.float, RANDOM_OPS_RAND], plan.describe()
    assert draws[0].index < draws[1].index, plan.describe()
