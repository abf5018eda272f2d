"""Values computed from shapes alone (no graph input) folded once at compile time
(passes/cleanup.py fold_constants): swin's shifted-window attention mask, built on every call from
zeros, slice assignments, a window partition and masked_fill, becomes one constant the program keeps
(codegen/program.py), including when the program comes from the cache."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from ember_check import check
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from ember.passes.cleanup import FOLD_MAX_NUMEL, eliminate_dead_code, fold_constants

aten = torch.ops.aten


def trace(fn, *inputs: torch.Tensor) -> fx.GraphModule:
    return make_fx(functionalize(fn))(*inputs)


def count(gm: fx.GraphModule, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == op)


def assert_same_function(before: fx.GraphModule, after: fx.GraphModule, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    torch.testing.assert_close(after(x.clone()), before(x.clone()))


def _shifted_window_mask(x: torch.Tensor, window: int = 4, shift: int = 2) -> torch.Tensor:
    """torchvision's swin attention mask: built from ``x``'s shape alone (zeros, slice
    assignments, window partition, pairwise difference, masked_fill), added to ``x``."""
    h, w = x.shape[-2], x.shape[-1]
    mask = torch.zeros((h, w), dtype=x.dtype)  # swin: x.new_zeros, the same full once captured
    count = 0
    for hs in ((0, -window), (-window, -shift), (-shift, None)):
        for ws in ((0, -window), (-window, -shift), (-shift, None)):
            mask[hs[0]:hs[1], ws[0]:ws[1]] = count
            count += 1
    mask = mask.view(h // window, window, w // window, window).permute(0, 2, 1, 3).reshape(-1, window * window)
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
    return x.reshape(-1, window * window, window * window) * 2.0 + mask


def test_fold_constants_computes_a_shape_only_mask_once() -> None:
    x = torch.randn(8, 8)
    gm = trace(lambda x: _shifted_window_mask(x.view(1, 1, 8, 8).expand(4, 1, 8, 8).reshape(4, 16, 4)), x)
    eliminate_dead_code(gm)
    reference = copy.deepcopy(gm)
    assert count(gm, aten.slice_scatter.default) > 0
    assert fold_constants(gm) >= 1
    eliminate_dead_code(gm)
    gm.recompile()
    assert count(gm, aten.slice_scatter.default) == 0 and count(gm, aten.masked_fill.Scalar) == 0, gm.code
    # What is left: the input's reshape and mul, and one add of the folded mask (4 windows x 16 x 16).
    (attr,) = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_ember_folded_")]
    assert getattr(gm, attr.target).shape == (4, 16, 16) and list(attr.users)[0].target == aten.add.Tensor
    assert_same_function(reference, gm, (8, 8))


def test_fold_constants_keeps_large_fills_inline() -> None:
    # A fill and pointwise ops / views of it are computed inside the kernels for free: no buffer.
    n = FOLD_MAX_NUMEL * 4
    gm = trace(lambda x: x + torch.full((n, 1), 2.0).exp().t().expand(3, n), torch.randn(3, n))
    assert fold_constants(gm) == 0


def test_compiled_shape_only_mask_matches_eager() -> None:
    x = torch.randn(16, 16, 16, requires_grad=True)
    fn = lambda x: _shifted_window_mask(x.sin()).softmax(-1)  # noqa: E731
    check(fn, [x], expect_ops=["aten.sin"])


@pytest.mark.parametrize("frame_cache", [False, True])
def test_folded_mask_survives_the_program_cache(tmp_path, frame_cache: bool) -> None:
    # The second compile is a cache hit (the program cache's, or the frame cache's, which holds
    # the same stored program): the passes do not run, so the folded mask must come from the
    # stored program, not from an attribute of the captured module.
    import ember
    from ember.runtime import kernels

    x = torch.randn(16, 16, 16)
    want = _shifted_window_mask(x.sin()).softmax(-1)
    records = []
    for _ in range(2):
        torch._dynamo.reset()
        kernels.forget_loaded()
        compiled = ember.compile(lambda x: _shifted_window_mask(x.sin()).softmax(-1), target="triton-interpret",
                                 cache_dir=str(tmp_path), cache=True, frame_cache=frame_cache,
                                 warm_start=False)  # the program and frame caches are the subject
        torch.testing.assert_close(compiled(x), want)
        records += compiled._ember_backend.log.graphs
    assert [g.cache for g in records] == ["stored", "frame cache" if frame_cache else "hit"]
