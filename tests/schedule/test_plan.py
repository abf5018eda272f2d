"""``plan_graph``: how an ATen graph (as Ember sees it, after its decomposition table) is split
into fused, extern, view, constant, getitem and fallback steps.

Each case also checks plan invariants (every op in exactly one step, steps in dependency order)
and runs the same function through ``ember.compile(target="aten")`` against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from core_helpers import assert_compiled_cleanly, check_against_eager, log_of
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.capture.decompositions import decomposition_table
from ember.schedule.plan import FusedGroup, KernelPlan, plan_graph
from ember.schedule.rules import OpClass, classify

aten = torch.ops.aten


def plan_of(fn, *inputs: torch.Tensor) -> KernelPlan:
    gm = make_fx(fn, decomposition_table=decomposition_table())(*inputs)
    plan = plan_graph(gm.graph)
    check_invariants(plan)
    return plan


def check_invariants(plan: KernelPlan) -> None:
    ops = [n for n in plan.graph.nodes if n.op == "call_function"]
    members = [n for s in plan.steps for n in s.nodes]
    assert sorted(members, key=ops.index) == ops, "every op belongs to exactly one step"
    assert set(plan.classes) == set(ops)
    assert [s.index for s in plan.steps] == list(range(len(plan.steps)))
    for step in plan.steps:
        for n in step.nodes:
            assert plan.step_of[n] is step
            for a in n.all_input_nodes:
                if a.op == "call_function" and plan.step_of[a] is not step:
                    assert plan.step_of[a].index < step.index, f"{n} reads {a} from a later step"


def kinds(plan: KernelPlan) -> list[str]:
    return [s.kind for s in plan.steps]


def op_names(nodes: list[fx.Node]) -> list[str]:
    return [n.target._overloadpacket.__name__ for n in nodes]


def run_compiled(fn, *inputs: torch.Tensor, params=()):
    compiled = ember.compile(fn, target="aten")
    check_against_eager(compiled, fn, list(inputs), params=params)
    assert_compiled_cleanly(log_of(compiled))
    return log_of(compiled)


# -- fused groups ------------------------------------------------------------------------------

def test_pointwise_chain_is_one_fused_group() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return ((x.sin() * 2.0 + 1.0).relu() - x).tanh()

    x = torch.randn(4, 8)
    plan = plan_of(fn, x)
    assert kinds(plan) == ["fused"]
    (group,) = plan.fused()
    assert isinstance(group, FusedGroup) and not group.is_reduction
    assert op_names(group.nodes) == ["sin", "mul", "add", "relu", "sub", "tanh"]
    assert group.shape == (4, 8) and group.rdims == ()
    assert [n.op for n in group.inputs] == ["placeholder"]
    assert group.outputs == [group.nodes[-1]]
    assert all(plan.classes[n][0] == OpClass.POINTWISE for n in group.nodes)
    assert "fused-pointwise" in plan.describe()

    log = run_compiled(fn, x)
    forward = next(g for g in log.graphs if g.kind == "forward")
    assert forward.steps["fused"] == 1 and sum(forward.steps.values()) == 1


def test_broadcasting_pointwise_chain_is_one_fused_group() -> None:
    def fn(x: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        return (x * row + col).sigmoid() * x

    inputs = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 1))
    plan = plan_of(fn, *inputs)
    assert kinds(plan) == ["fused"]
    (group,) = plan.fused()
    assert group.shape == (4, 8) and len(group.inputs) == 3
    run_compiled(fn, *inputs)


def test_softmax_is_one_fused_reduction_group() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)

    x = torch.randn(4, 8)
    plan = plan_of(fn, x)
    assert kinds(plan) == ["fused"]
    (group,) = plan.fused()
    assert group.is_reduction and group.shape == (4, 8) and group.rdims == (1,)
    assert op_names(group.nodes) == ["amax", "sub", "exp", "sum", "div"]
    assert [plan.classes[n][0] for n in group.nodes if n.target in (aten.amax.default, aten.sum.dim_IntList)] == \
        [OpClass.REDUCTION, OpClass.REDUCTION]
    assert "fused-reduction" in plan.describe() and "D=[1]" in plan.describe()
    run_compiled(fn, x)


def test_reductions_over_different_dims_are_separate_groups() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True) * x.amax(1, keepdim=True)

    x = torch.randn(4, 8)
    plan = plan_of(fn, x)
    groups = plan.fused()
    assert len(groups) == 2 and all(g.is_reduction for g in groups)
    assert sorted(g.rdims for g in groups) == [(0,), (1,)]
    run_compiled(fn, x)


def test_layer_norm_forward_is_at_most_two_fused_groups_and_no_fallback() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (16,), w, b, eps=1e-5)

    inputs = (torch.randn(6, 16), torch.randn(16), torch.randn(16))
    plan = plan_of(fn, *inputs)
    assert 1 <= len(plan.fused()) <= 2, plan.describe()
    assert not [s for s in plan.steps if s.kind in ("fallback", "extern")], plan.describe()
    assert all(g.is_reduction and g.rdims == (1,) for g in plan.fused())
    names = [n for g in plan.fused() for n in op_names(g.nodes)]
    assert "rsqrt" in names and names.count("sum") == 2
    run_compiled(fn, *inputs)


# -- extern, views, fallback ------------------------------------------------------------------------

def test_matmul_is_an_extern_library_call() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    plan = plan_of(fn, x, w)
    assert kinds(plan) == ["extern"]
    assert plan.steps[0].node.target == aten.mm.default
    assert plan.classes[plan.steps[0].node] == (OpClass.EXTERN, "")
    run_compiled(fn, x, w)


def test_linear_then_activation_is_extern_then_fused() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(x, w, b)) * 2.0

    inputs = (torch.randn(5, 8), torch.randn(6, 8), torch.randn(6))
    plan = plan_of(fn, *inputs)
    steps = [s for s in plan.steps if s.kind != "view"]
    assert steps[0].kind == "extern" and steps[0].node.target == aten.addmm.default, plan.describe()
    assert steps[1:] and all(s.kind == "fused" for s in steps[1:]), plan.describe()
    assert any(steps[0].node in s.inputs for s in steps[1:])
    assert "erf" in [name for s in steps[1:] for name in op_names(s.nodes)]
    run_compiled(fn, *inputs)


SIBLINGS = {
    "sin-plus-cos": lambda x: x.sin() + x.cos(),
    "two-branches": lambda x: (x * 2.0) * (x + 1.0),
    "gelu": F.gelu,
}


@pytest.mark.parametrize("name", list(SIBLINGS))
def test_pointwise_branches_of_one_input_are_one_fused_group(name: str) -> None:
    fn = SIBLINGS[name]
    x = torch.randn(4, 8)
    run_compiled(fn, x)  # correct either way
    plan = plan_of(fn, x)
    assert kinds(plan) == ["fused"], plan.describe()


def test_a_use_of_one_input_after_a_library_call_joins_the_group_that_reads_it() -> None:
    # The partitioner may place a library call between two uses of one tensor (generated
    # pooling's maximum and its NaN checks): the later use joins the earlier group, not a new
    # kernel that reads the tensor again.
    def fn(x, w):
        a = torch.relu(x) * 2.0
        m = x @ w
        b = torch.sigmoid(x)
        return (a + b)[:, :4] * m

    x, w = torch.randn(8, 8), torch.randn(8, 4)
    run_compiled(fn, x, w)
    plan = plan_of(fn, x, w)
    group = plan.step_of[next(n for n in plan.graph.nodes if n.target == aten.relu.default)]
    assert "sigmoid" in op_names(group.nodes), plan.describe()


def test_views_read_only_after_the_kernel_become_views_of_its_output() -> None:
    # A permuted, unsqueezed view of a computed value that only a later op reads is an ATen view
    # of the stored value, not a second (rearranged) store of the same data.
    def fn(x):
        y = torch.relu(x * 2.0)
        z = y.permute(0, 2, 3, 1).unsqueeze(1)
        return torch.cumsum(z, 2)  # cumsum: a fallback op

    x = torch.randn(2, 3, 4, 5)
    run_compiled(fn, x)
    plan = plan_of(fn, x)
    (group,) = plan.fused()
    assert op_names(group.outputs) == ["relu"], plan.describe()
    views = [s for s in plan.steps if s.kind == "view"]
    assert op_names([n for s in views for n in s.nodes]) == ["permute", "unsqueeze"], plan.describe()


@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (6, 6, 5, 5), (4, 5, 5, 5)],
                         ids=["distinct_sizes", "batch_equals_channels", "channels_equal_height_and_width"])
def test_training_batch_norm_is_one_kernel_forward_and_one_backward(shape: tuple[int, ...]) -> None:
    """Hoisted parameter views, sibling fusion and per-channel values beside the reduction make
    training batch norm + ReLU one kernel forward (statistics, normalise, affine, ReLU, running
    statistics) and one kernel backward (both sums and the input gradient). Also where a reduced
    dim has the channel count's size (ResNet-50's 128-channel layers at batch 128): a per-channel
    vector must sit on the kept dim to meet the reduction's results."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(shape[1]), torch.nn.ReLU())
    compiled = ember.compile(model)
    check_against_eager(compiled, model, [torch.randn(shape)], params=list(model.parameters()))
    graphs = {g.kind: g for g in log_of(compiled).graphs}
    assert set(graphs) == {"forward", "backward"}
    for kind, g in graphs.items():
        # (the num_batches_tracked += 1 scalar stays its own kernel)
        groups = [line for line in g.plan_text.splitlines() if " fused-" in line and "S=[] " not in line]
        assert len(groups) == 1 and f"S={list(shape)}" in groups[0], (kind, g.plan_text)


def test_unsupported_op_is_a_fallback_step_with_a_reason() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.cumsum(-1) * 2.0).exp()

    x = torch.randn(4, 8)
    plan = plan_of(fn, x)
    assert kinds(plan) == ["fallback", "fused"]
    step = plan.steps[0]
    assert step.node.target == aten.cumsum.default
    assert classify(step.node).cls == OpClass.FALLBACK
    assert "cumsum" in step.reason and "no Ember lowering" in step.reason
    assert "(no Ember lowering for cumsum" in plan.describe()
    assert op_names(plan.steps[1].nodes) == ["mul", "exp"]

    log = run_compiled(fn, x)
    forward = next(g for g in log.graphs if g.kind == "forward")
    assert forward.placement["fallback"]["aten.cumsum"] == 1
    assert any(r.startswith("aten.cumsum: no Ember lowering") for r in forward.fallback_reasons)


def test_multi_output_fallback_has_getitem_steps() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        values, _ = torch.sort(x, dim=-1)
        return values * 3.0 + 1.0

    x = torch.randn(4, 8)
    plan = plan_of(fn, x)
    assert plan.steps[0].kind == "fallback" and plan.steps[0].node.target == aten.sort.default
    assert "getitem" in kinds(plan) and kinds(plan)[-1] == "fused"
    run_compiled(fn, x)


def test_random_op_falls_back_with_its_reason() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, 0.5, True)[0] + 1.0

    plan = plan_of(fn, torch.randn(4, 8))
    fallbacks = [s for s in plan.steps if s.kind == "fallback"]
    assert [s.node.target for s in fallbacks] == [aten.native_dropout.default]
    assert "random op" in fallbacks[0].reason
    assert kinds(plan) == ["fallback", "getitem", "getitem", "fused"]


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1)])
def test_sum_then_broadcast_back_stays_correct(dims: tuple[int, ...]) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x - x.sum(dims, keepdim=True)).square()

    x = torch.randn(5, 7)
    plan = plan_of(fn, x)
    assert all(s.kind == "fused" for s in plan.steps)
    run_compiled(fn, x)


def test_each_new_fused_group_records_why_it_starts() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) + 1
        return (y.sum(1, keepdim=True) * y).sum(0)  # the last sum reduces dim 0, the group reduces dim 1

    plan = plan_of(fn, torch.randn(4, 8))
    groups = plan.fused()
    assert len(groups) == 2
    assert groups[0].reason.startswith("no fused producer")
    assert "reduces other dims than the group's reduction" in groups[1].reason
    assert f"not into step {groups[0].index}" in groups[1].reason
    decisions = plan.fusion_decisions()
    assert sum(decisions.values()) == 2 and "not into step N: reduces other dims than the group's reduction" in decisions
    assert "(new group: no fused producer" in plan.describe()
