"""Fused groups merged into a later group that reads them (schedule/group_merge.py).

A ResNet downsampling block's two batch norms (the main branch's and the shortcut's) sit on both
sides of a convolution: merged, the forward computes both normalisations in the kernel that adds
them, and the backward takes both batch norms' sums in one pass over the shared gradient. Checked
on the plan (group counts, what is stored) and, through the Triton interpreter (the GPU code path)
and the numba CPU kernels, against eager on fresh random inputs, forward, gradients and running
statistics.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from core_helpers import assert_close, log_of
from cpu_fixtures import cpu_env, shared_cache  # noqa: F401 (fixtures, used by name)
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember import config
from ember.capture.decompositions import decomposition_table
from ember.schedule.plan import FusedGroup, plan_graph

nn = torch.nn


def downsampling_block() -> nn.Module:
    """torchvision's ResNet bottleneck with a 1x1 projection shortcut and its batch norm (as in
    ResNet-50's first block). Stride 1: on the CPU, torch 2.14.1's convolution backward of a
    strided 1x1 convolution in channels_last corrupts the heap (an eager loop of
    ``aten.convolution_backward`` alone crashes within 2,000 calls)."""
    shortcut = nn.Sequential(nn.Conv2d(6, 16, 1, bias=False), nn.BatchNorm2d(16))
    return torchvision.models.resnet.Bottleneck(6, 4, downsample=shortcut).train()


def reduction_groups(plan_text: str, shape: list[int]) -> list[str]:
    return [line for line in plan_text.splitlines() if "fused-reduction" in line and f"S={shape}" in line]


@pytest.mark.parametrize("target", ["triton-interpret", "cpu"])
def test_downsampling_blocks_batch_norms_share_one_kernel_each_way(target: str) -> None:
    torch.manual_seed(0)
    model = downsampling_block().to(memory_format=torch.channels_last)
    eager = copy.deepcopy(model)
    compiled = ember.compile(model, target=target, cache=False)
    x = torch.randn(3, 6, 10, 10).to(memory_format=torch.channels_last)
    x_got, x_want = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(x_got), eager(x_want)
    grad = torch.randn_like(want)
    (got * grad).sum().backward()
    (want * grad).sum().backward()
    assert_close(got, want, "forward")
    assert_close(x_got.grad, x_want.grad, "input gradient")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"gradient of {name}")
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(b, c) if not b.is_floating_point() else torch.allclose(b, c, atol=1e-6), name

    graphs = {g.kind: g for g in log_of(compiled).graphs}
    # The block's output: [3, 16, 10, 10]. One reduction group holds both batch norms each way.
    for kind in ("forward", "backward"):
        groups = reduction_groups(graphs[kind].plan_text, [3, 16, 10, 10])
        assert len(groups) == 1, (kind, graphs[kind].plan_text)
        assert "merged with the group it" in graphs[kind].plan_text


def test_with_merging_off_the_two_batch_norms_are_two_kernels() -> None:
    """The option turns the merge off (and the check above would see two groups)."""
    torch.manual_seed(0)
    model = downsampling_block().to(memory_format=torch.channels_last)
    with config.patch(merge_groups=False):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        compiled(torch.randn(3, 6, 10, 10).to(memory_format=torch.channels_last)).sum().backward()
    for g in log_of(compiled).graphs:
        assert len(reduction_groups(g.plan_text, [3, 16, 10, 10])) == 2, g.plan_text
        assert "merged with" not in g.plan_text


def _fused(fn, *inputs: torch.Tensor) -> list:
    gm = make_fx(fn, decomposition_table=decomposition_table())(*inputs)
    return [s for s in plan_graph(gm.graph).steps if isinstance(s, FusedGroup)]


def test_a_pointwise_group_merges_into_a_one_pass_reduction_after_a_library_call() -> None:
    """``p`` is computed before the matmul, the sum after it: merged, the sum's kernel computes
    ``p`` from a, b, c, d (5 reads in all) instead of a kernel storing it and another reading it
    back (4 reads, a store, 2 reads)."""
    def fn(a, b, c, d, x, w):
        p = a * b + c * d
        return (p + x @ w).sum(-1)

    t = [torch.randn(8, 16) for _ in range(5)] + [torch.randn(16, 16)]
    groups = _fused(fn, *t)
    assert len(groups) == 1 and "merged with the group it reads" in groups[0].reason
    compiled = ember.compile(fn, target="triton-interpret", cache=False)
    assert_close(compiled(*t), fn(*t), "result")


def test_no_merge_where_recomputing_reads_more_than_the_store_saves() -> None:
    """A softmax makes three passes over its input: recomputing ``p`` in each would read a, b, c,
    d three times, more than storing ``p`` once and reading it back."""
    def fn(a, b, c, d, x, w):
        p = a * b + c * d
        return torch.softmax(p + x @ w, -1)

    t = [torch.randn(8, 16) for _ in range(5)] + [torch.randn(16, 16)]
    groups = _fused(fn, *t)
    assert len(groups) == 2 and not any("merged" in g.reason for g in groups)
