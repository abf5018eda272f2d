"""Ember's tiled matrix product (ops/tiled_matmul.py, ``tiled_matmul`` and ``split_k_sum`` of
ops/matmul_kernels.py) run by Triton's interpreter on CPU tensors: against a float64 product over
sizes, strides, a bias, batches and split K slices; the same bits on every run; the cost model's
candidates; the compile jobs of a split product."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.ops import tiled_matmul as tm


def _tiles(bm: int, bn: int, bk: int, split: int = 1) -> list[int]:
    return [bm, bn, bk, 8, 4, 3, split]


def _check(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tiles: list[int]) -> torch.Tensor:
    got = tm.tiled_matmul(a, b, bias, tiles)
    exact = a.double() @ b.double() + (bias.double() if bias is not None else 0.0)
    assert got.dtype == a.dtype and got.shape == exact.shape and got.is_contiguous()
    # float32 sums rounded once: within one unit in the last place (the interpreter truncates bf16).
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[a.dtype]
    scale = a.double().abs() @ b.double().abs()
    err = (got.double() - exact).abs()
    assert bool((err <= ulp * exact.abs() + 1e-5 * scale + 1e-6).all()), float((err - ulp * exact.abs()).max())
    return got


@st.composite
def products(draw: st.DrawFn) -> tuple:
    batch = draw(st.sampled_from([0, 1, 3]))  # 0: 2-D operands
    m, n, k = draw(st.integers(1, 70)), draw(st.integers(1, 70)), draw(st.integers(1, 200))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, generator=g).to(dtype)
    b = (torch.randn(*lead, n, k, generator=g).to(dtype).transpose(-1, -2) if draw(st.booleans())  # a weight's view
         else torch.randn(*lead, k, n, generator=g).to(dtype))
    bias = torch.randn(n, generator=g).to(dtype) if not batch and draw(st.booleans()) else None
    tiles = _tiles(draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32])),
                   draw(st.sampled_from(tm.SPLITS)))
    return a, b, bias, tiles


@settings(max_examples=30, deadline=None)
@given(products())
def test_kernel_matches_a_float64_product(case: tuple) -> None:
    _check(*case)


@pytest.mark.parametrize("split", [2, 3, 4, 8])
def test_split_k_with_a_bias_and_a_ragged_last_slice(split: int) -> None:
    g = torch.Generator().manual_seed(split)
    a, b = torch.randn(24, 200, generator=g).bfloat16(), torch.randn(200, 40, generator=g).bfloat16()
    bias = torch.randn(40, generator=g).bfloat16()
    first = _check(a, b, bias, _tiles(16, 32, 16, split))  # 13 K steps: the last slice is shorter
    assert torch.equal(first, tm.tiled_matmul(a, b, bias, _tiles(16, 32, 16, split)))  # fixed order: same bits


def test_a_split_larger_than_the_k_steps_is_cut_to_them() -> None:
    meta = tm._meta(_tiles(16, 16, 32, 8), k=70)  # 3 steps of 32
    assert meta["SPLIT_K"] == 3
    assert tm._meta(_tiles(16, 16, 32, 8), k=32)["SPLIT_K"] == 1
    assert tm._meta(_tiles(16, 16, 32, 4), k=160)["SPLIT_K"] == 3  # 5 steps: slices of 2, 2, 1, not 2, 2, 1, 0
    assert tm._meta([16, 16, 32, 8, 4, 3], k=4096)["SPLIT_K"] == 1  # a configuration recorded before SPLIT_K
    g = torch.Generator().manual_seed(0)
    _check(torch.randn(5, 70, generator=g).half(), torch.randn(70, 9, generator=g).half(), None, _tiles(16, 16, 32, 8))


def test_the_cost_model_splits_k_only_where_the_tiles_are_few() -> None:
    few = tm.candidates(1, 128, 768, 3072, 2)  # batch-1 inference: 24 tiles of 64 x 64 for 132 SMs
    many = tm.candidates(1, 8192, 3072, 768, 2)
    assert all(set(c) == set(tm.TILE_KEYS) for c in few + many)
    assert few[0]["SPLIT_K"] > 1 and all(c["SPLIT_K"] == 1 for c in many)
    assert all(-(-3072 // c["BLOCK_K"]) >= 2 * c["SPLIT_K"] for c in few)  # two K steps a slice at least


def test_the_compile_jobs_of_a_split_product() -> None:
    from torch._subclasses import FakeTensorMode

    from ember.runtime import precompile

    with FakeTensorMode():
        a = torch.empty(128, 3072, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(768, 3072, device="cuda", dtype=torch.bfloat16).t()
        bias = torch.empty(768, device="cuda", dtype=torch.bfloat16)
        gm = torch.fx.symbolic_trace(lambda x, y, z: torch.ops.ember.tiled_matmul.default(x, y, z, _tiles(64, 64, 64, 4)))
        for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], (a, b, bias)):
            node.meta["val"] = value
        call = next(n for n in gm.graph.nodes if n.op == "call_function")
        call.meta["val"] = torch.empty(128, 768, device="cuda", dtype=torch.bfloat16)
    product, total = tm.compile_jobs(gm)
    assert (product.name, total.name) == ("tiled_matmul", "split_k_sum")
    assert dict(product.meta)["SPLIT_K"] == 4 and dict(total.meta) == {"SPLIT_K": 4, "HAS_BIAS": True,
                                                                       "BLOCK": tm.SUM_BLOCK, "num_warps": 4}
    assert product.arg_dtypes[3] == "float32"  # the slices' buffer
    assert list(total.arg_dtypes[3:]) == [precompile.int_arg(v) for v in (128 * 768, 768, 1)]
    for job in (product, total):
        fn = getattr(tm._kernels(False), job.name)
        assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])


def test_explain_names_the_split() -> None:
    from ember.tune.report import config_label

    assert config_label({"impl": "tiled", **dict(zip(tm.TILE_KEYS, _tiles(64, 64, 64, 4)))}, True) == \
        "impl=tiled 64x64x64 (group 8, 4 warps, 3 stages, K in 4 slices)"
    assert "slices" not in config_label({"impl": "tiled", **dict(zip(tm.TILE_KEYS, _tiles(64, 64, 64)))}, True)
