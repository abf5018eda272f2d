"""Reshapes inside fused groups: a view that splits or merges dims of a fused value joins the
group (the group's iteration space S is refined, schedule/dim_map.py) instead of ending it.

Plans are checked on make_fx graphs; results through the Triton interpreter (the GPU code path)
and the numba CPU kernels against eager, forward and gradients, on fresh random inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from core_helpers import assert_compiled_cleanly, check_against_eager, log_of
from cpu_fixtures import cpu_env, shared_cache  # noqa: F401 (fixtures, used by name)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember import config
from ember.capture.decompositions import decomposition_table
from ember.schedule.dim_map import SplitDim, dim_strides, refine
from ember.schedule.plan import FusedGroup, KernelPlan, plan_graph

nn = torch.nn


def plan_of(fn, *inputs: torch.Tensor, refine_views: bool = True) -> KernelPlan:
    gm = make_fx(fn, decomposition_table=decomposition_table())(*inputs)
    return plan_graph(gm.graph, refine_views=refine_views)


def windowed_scores(scores: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Swin's attention scores: [B*W, h, n, n] plus a per-head bias, viewed as [B, W, h, n, n] to
    add a per-window mask, viewed back, then a softmax over the last dim."""
    w = mask.shape[0]
    a = scores + bias.unsqueeze(0)
    a = a.view(-1, w, *a.shape[1:]) + mask.unsqueeze(1).unsqueeze(0)
    return torch.softmax(a.view(-1, *a.shape[2:]), -1)


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(6, 2, 5, 5), torch.randn(2, 5, 5), torch.randn(3, 5, 5)]


def test_a_split_and_a_merge_inside_a_softmax_chain_are_one_group() -> None:
    plan = plan_of(windowed_scores, *_inputs())
    groups = plan.fused()
    assert len(groups) == 1, plan.describe()
    # S refined: the batch of windows is two dims; the softmax reduces the last.
    assert groups[0].shape == (2, 3, 2, 5, 5) and groups[0].rdims == (4,)
    # A [B*W, ...] member walks the run of the two batch dims.
    first = next(n for n in groups[0].nodes if tuple(n.meta["val"].shape) == (6, 2, 5, 5))
    assert groups[0].dims[first][0] == (0, 1)


def test_without_the_option_the_reshapes_end_groups() -> None:
    assert len(plan_of(windowed_scores, *_inputs(), refine_views=False).fused()) == 3


def test_refine_cuts_one_dim_and_keeps_every_address() -> None:
    class Group:
        shape = (4, 6, 5)
        rdims = (1,)
        dims: dict = {}
        input_dims: dict = {}

    g = Group()
    member, other = object(), object()
    g.dims = {member: (0, 1, 2), other: ((0, 1), 2)}
    g.input_dims = {member: {other: (None, 1, 2)}}
    strides = {member: (30, 5, 1), other: (5, 1)}
    before = {n: sorted(dim_strides(d, strides[n], g.shape)) for n, d in g.dims.items()}
    refine(g, SplitDim(1, 2))
    assert g.shape == (4, 2, 3, 5) and g.rdims == (1, 2)
    assert g.dims == {member: (0, (1, 2), 3), other: ((0, 1, 2), 3)}
    assert g.input_dims == {member: {other: (None, (1, 2), 3)}}
    # The old dim 1 (stride 5 for member) is now dims 1 and 2 with strides 15 and 5.
    assert sorted(dim_strides(g.dims[member], strides[member], g.shape)) == [(0, 30), (1, 15), (2, 5), (3, 1)]
    assert before[other] == [(0, 30), (1, 5), (2, 1)]
    assert sorted(dim_strides(g.dims[other], strides[other], g.shape)) == [(0, 30), (1, 15), (2, 5), (3, 1)]


@pytest.mark.parametrize("target", ["triton-interpret", "aten"])
def test_windowed_scores_match_eager(target: str) -> None:
    compiled = ember.compile(windowed_scores, target=target)
    check_against_eager(compiled, windowed_scores, _inputs())
    assert_compiled_cleanly(log_of(compiled))


def test_windowed_scores_on_cpu_kernels_match_eager(cpu_env: None) -> None:  # noqa: F811 (fixture)
    compiled = ember.compile(windowed_scores, target="cpu")
    check_against_eager(compiled, windowed_scores, _inputs())
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    forward = next(g for g in log.graphs if g.kind == "forward")
    assert sum(forward.placement["generated"].values()) >= 7 and "aten.view" in forward.placement["generated"]


class GroupNormNet(nn.Module):
    """GroupNorm (its statistics over [N, G, C/G * H * W], the affine over [N, C, H, W]) and a
    channel shuffle (a split, a transpose and a merge of the channels) between pointwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.gn(x))
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return torch.tanh(y) * x


def test_group_norm_and_a_channel_shuffle_match_eager_with_fewer_kernels() -> None:
    torch.manual_seed(0)
    model, x = GroupNormNet(), torch.randn(2, 8, 4, 5)
    with torch.no_grad():  # not the default affine (ones, zeros): a wrong weight read would show
        model.gn.weight.uniform_(0.5, 1.5)
        model.gn.bias.normal_()
    want = _output_and_grads(copy.deepcopy(model), x)
    counts = {}
    for fuse in (True, False):
        compiled_model = copy.deepcopy(model)
        with config.patch(fuse_reshapes=fuse):
            compiled = ember.compile(compiled_model, target="triton-interpret", cache=False)
            got = _output_and_grads(compiled_model, x, compiled)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"tensor {i}: {m}")
        log = log_of(compiled)
        assert_compiled_cleanly(log)
        counts[fuse] = sum(len(g.kernel_sources) for g in log.graphs)
    assert counts[True] < counts[False], counts


def _output_and_grads(model: nn.Module, x: torch.Tensor, fn: object = None) -> list[torch.Tensor]:
    """The output, the input's gradient and every parameter's, for a fixed random cotangent."""
    xi = x.clone().requires_grad_(True)
    out = (model if fn is None else fn)(xi)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), xi.grad] + [p.grad for p in model.parameters()]


# -- property: reshapes between pointwise ops and a reduction -------------------------------------

@st.composite
def reshape_chains(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, ...]], tuple[int, ...], int]:
    """Factors of one tensor, three groupings of them into dims (the shapes the chain views the
    value as), the broadcast shape of an operand added at the middle shape, and the reduced dim."""
    factors = draw(st.lists(st.sampled_from([2, 3]), min_size=2, max_size=4))

    def grouping() -> tuple[int, ...]:
        cuts = draw(st.lists(st.booleans(), min_size=len(factors) - 1, max_size=len(factors) - 1))
        dims, size = [], factors[0]
        for f, cut in zip(factors[1:], cuts):
            if cut:
                dims.append(size)
                size = f
            else:
                size *= f
        return tuple(dims + [size])

    shapes = [grouping() for _ in range(3)]
    middle = shapes[1]
    operand = tuple(n if draw(st.booleans()) else 1 for n in middle)
    reduce_dim = draw(st.integers(0, len(shapes[2]) - 1))
    return factors, shapes, operand, reduce_dim


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshape_chains(), st.booleans())
def test_reshape_chains_match_eager(chain: tuple, transpose_first: bool) -> None:
    _factors, (first, middle, last), operand, reduce_dim = chain

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * 2.0
        if transpose_first and len(first) > 1:
            y = y.transpose(0, -1).contiguous().transpose(0, -1)  # a member laid out transposed
        y = y.reshape(middle) + w
        y = torch.exp(y.reshape(last))
        return y / y.sum(reduce_dim, keepdim=True)

    compiled = ember.compile(fn, target="triton-interpret", cache=False)
    check_against_eager(compiled, fn, [torch.randn(first), torch.randn(operand)])
    assert_compiled_cleanly(log_of(compiled))


def test_a_reshape_that_cannot_map_still_matches_eager() -> None:
    # [6, 4] viewed as [4, 6] cuts across both dims: no refinement makes it a run; the group ends.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.sin(x).view(4, 6) * 3.0).sum(1)

    x = torch.randn(6, 4)
    plan = plan_of(fn, x)
    assert len([s for s in plan.steps if isinstance(s, FusedGroup)]) == 2
    compiled = ember.compile(fn, target="triton-interpret", cache=False)
    check_against_eager(compiled, fn, [x])


def test_a_slice_scatter_into_a_merged_value_reads_its_run_coordinates() -> None:
    # The scatter's base is a member whose first dim walks two S dims: the select compares the
    # merged coordinate (row-major over the run) with the scattered range.
    def fn(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        base = torch.sin(x).view(6, 4)
        return torch.slice_scatter(base, src, dim=0, start=2, end=5) * 2.0

    x, src = torch.randn(2, 3, 4), torch.randn(3, 4)
    plan = plan_of(fn, x, src)
    group = next(g for g in plan.fused() if any(n in g.selects for n in g.nodes))
    assert any(isinstance(e, tuple) for n in group.selects for e in group.dims[n]), plan.describe()
    compiled = ember.compile(fn, target="triton-interpret", cache=False)
    check_against_eager(compiled, fn, [x, src])


def split_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fused value split three ways (a q/k/v projection's chunk), an unbind and a split with
    sizes, each piece used on its own: several views of one value from one op."""
    qkv = torch.relu(x @ w) * 2
    q, k, v = qkv.chunk(3, dim=-1)
    first, *_ = (q + 1).unbind(0)
    a, b = torch.split(torch.tanh(v), [2, 4], dim=-1)
    return (q * k).sum(-1, keepdim=True) + first.mean() + a.sum(-1, keepdim=True) - b.sigmoid().sum(-1, keepdim=True)


@pytest.mark.parametrize("target", ["triton-interpret", "aten"])
def test_a_value_split_into_several_views_compiles_and_matches_eager(target: str) -> None:
    # split / unbind / chunk have several outputs: the planner asked their shape as one tensor's
    # and the whole graph fell back to ATen as captured.
    with config.patch(strict=True):
        compiled = ember.compile(split_heads, target=target)
        check_against_eager(compiled, split_heads, [torch.randn(3, 4, 5), torch.randn(5, 18)])
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    if target == "triton-interpret":
        assert sum(g.kernels for g in log.graphs) > 0
