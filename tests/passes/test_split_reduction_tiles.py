"""Generated kernels on channels_last tensors: the tile order, channel tiles and split
reductions (partial, combining and storing kernels) through the Triton interpreter, against eager."""

from __future__ import annotations

import pytest
import torch
from ember_check import assert_close, kernel_text, make_input, strict_env

import ember
from ember import config


def test_pointwise_kernel_walks_channels_last_in_memory_order() -> None:
    x = make_input((2, 5, 3, 4), "channels_last")
    with strict_env():
        fn = ember.compile(lambda t: torch.relu(t) * 2.0 + 1.0, target="triton-interpret")
        assert_close(fn(x), torch.relu(x) * 2.0 + 1.0)
    src = kernel_text(fn)
    assert "x order [0, 2, 3, 1]" in src, src  # N, H, W, then C fastest


def test_channel_statistics_of_channels_last_use_channel_tiles(split_reductions: None) -> None:
    x = make_input((3, 6, 5, 7), "channels_last")
    with strict_env(looped=True):
        fn = ember.compile(lambda t: t.sum((0, 2, 3)), target="triton-interpret")
        assert_close(fn(x), x.sum((0, 2, 3)), norm_rtol=1e-5)
    src = kernel_text(fn)
    assert "channel-contiguous" in src and "split=" in src and "ember_part1_" in src, src


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax"])
def test_a_split_reduction_without_full_outputs_combines_in_its_storing_kernel(split_reductions: None,
                                                                              reduce: str) -> None:
    # A column reduction (a linear layer's bias gradient) stores nothing that walks the reduced
    # dim: its storing kernel runs one program per column block and combines the chunks' partials
    # itself, so the group is two kernels (partials, then combine-and-store), not three.
    x = make_input((96, 5), "contiguous")

    def fn(t: torch.Tensor) -> torch.Tensor:
        return getattr(torch, reduce)(t * 2.0, 0) + 1.0

    with strict_env(looped=True):
        compiled = ember.compile(fn, target="triton-interpret")
        assert_close(compiled(x), fn(x), norm_rtol=1e-5)
    (graph,) = compiled._ember_backend.log.graphs
    assert sorted(name.split("_")[1] for name in graph.kernel_sources) == ["part1", "red"], graph.kernel_sources
    assert "split=" in kernel_text(compiled)


@pytest.mark.parametrize("tiles,rows", [(1, 8), (2, 16), (0, 48)], ids=["one_tile", "two_tiles", "whole_chunk"])
def test_a_split_reductions_full_size_outputs_are_stored_in_tiles(tiles: int, rows: int) -> None:
    """Normalising by per-channel statistics of a channels_last tensor: the partial and combining
    kernels make the statistics, then the storing kernel, which loads them combined, runs
    ``split_store_tiles`` tiles (8 rows each here) per program instead of one program per chunk of
    the reduction (4 chunks of 48 rows)."""
    x = make_input((3, 6, 9, 7), "channels_last")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean((0, 2, 3), keepdim=True)

    with strict_env(looped=True), config.patch(interpret_split_target_programs=4, split_store_tiles=tiles):
        compiled = ember.compile(fn, target="triton-interpret", cache=False)
        assert_close(compiled(x), fn(x))
    src = kernel_text(compiled)
    assert "split=4x48 part of level 1" in src and f"split=4x48 stores outputs, {rows} rows per program" in src, src


def test_a_broadcast_gradient_does_not_decide_the_tile_order(split_reductions: None) -> None:
    """A pooled gradient expanded back over H and W (ResNet's last batch-norm backward) walks
    every dim but stores only N x C: the channels_last activation orders the tile."""
    x = make_input((3, 6, 5, 7), "channels_last")
    g = torch.randn(3, 6)

    def fn(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (g[:, :, None, None].expand_as(x) / 35 * x).sum((0, 2, 3))

    with strict_env(looped=True):
        compiled = ember.compile(fn, target="triton-interpret")
        assert_close(compiled(x, g), fn(x, g), norm_rtol=1e-5)
    src = kernel_text(compiled)
    assert "channel-contiguous" in src and "r order [0, 2, 3]" in src, src



def test_identical_split_reductions_share_theirkernel_text(split_reductions: None) -> None:
    """Two normalisations of same-shaped tensors, separated by a convolution (so in separate
    fused groups), launch the same split kernels: a node name must not reach the kernel's hash."""
    def norm(t: torch.Tensor) -> torch.Tensor:
        mean = t.mean((0, 2, 3), keepdim=True)
        return (t - mean) * torch.rsqrt(((t - mean) ** 2).mean((0, 2, 3), keepdim=True) + 1e-5)

    def two_blocks(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = norm(torch.nn.functional.conv2d(x, w1, padding=1))
        return norm(torch.nn.functional.conv2d(h, w2, padding=1))

    x = make_input((3, 6, 5, 7), "channels_last")
    w1, w2 = torch.randn(6, 6, 3, 3) / 8, torch.randn(6, 6, 3, 3) / 8
    with strict_env(looped=True):
        fn = ember.compile(two_blocks, target="triton-interpret")
        assert_close(fn(x, w1, w2), two_blocks(x, w1, w2), norm_rtol=1e-4)
    (graph,) = fn._ember_backend.log.graphs
    assert graph.kernels == 2, graph.plan_text
    names = list(graph.kernel_sources)
    assert any(n.startswith("ember_part1_") for n in names), names
    # The second group's kernels are the first's: one partial, combine and final kernel per level.
    assert len(names) == len({n.rsplit("_", 1)[0] for n in names}), names
