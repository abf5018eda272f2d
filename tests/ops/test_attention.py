"""Ember's attention kernel (ops/attention.py, ``attention_forward`` of ops/attention_kernels.py)
run by Triton's interpreter on CPU tensors: against float64 SDPA over sizes, head dims, strides,
additive and boolean masks that broadcast, causal calls and scales; rows with every key masked;
the log-sum-exp; which calls it takes; the compile job."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.ops import attention as att


def _reference(q, k, v, mask, causal, scale) -> torch.Tensor:
    wide = mask.double() if mask is not None and mask.is_floating_point() else mask
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=wide, is_causal=causal,
                                          scale=scale)


def _check(q, k, v, mask=None, causal=False, scale=None, tiles=(16, 16, 4, 2)) -> torch.Tensor:
    assert att.takes(q, k, v, mask)
    out, lse = att.attention(q, k, v, mask, causal, scale, list(tiles))
    want = _reference(q, k, v, mask, causal, scale)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # tokens outside heads, as the flash backends lay it out
    # float32 sums, probabilities rounded to the dtype once before the values' product.
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[q.dtype]
    assert (out.double() - want).abs().max().item() <= 4 * ulp * (1 + want.abs().max().item())
    return lse


@st.composite
def calls(draw: st.DrawFn) -> tuple:
    b, h, lq, lk = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d, dv = draw(st.sampled_from([8, 16, 24, 64])), draw(st.sampled_from([8, 16, 40]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, lq, h, d, generator=g).to(dtype).transpose(1, 2)  # a projection's heads: a view
    k = torch.randn(b, h, lk, d, generator=g).to(dtype)
    v = torch.randn(b, h, lk, dv, generator=g).to(dtype)
    kind = draw(st.sampled_from(["none", "padding", "bool", "causal"]))
    mask, causal = None, kind == "causal"
    if kind == "padding":  # an additive mask per key, broadcast over heads and queries
        mask = torch.where(torch.rand(b, 1, 1, lk, generator=g) < 0.25, -1e4, 0.0).to(dtype)
    if kind == "bool":  # every query attends to its own key (lk >= lq) or to the first
        mask = (torch.rand(b, h, lq, lk, generator=g) < 0.6)
        mask[..., 0] = True
    scale = draw(st.sampled_from([None, 0.3]))
    tiles = draw(st.sampled_from([(16, 16, 4, 2), (32, 16, 4, 2), (16, 32, 4, 3)]))
    return q, k, v, mask, causal, scale, tiles


@settings(max_examples=30, deadline=None)
@given(calls())
def test_kernel_matches_float64_sdpa(case: tuple) -> None:
    _check(*case)


def test_the_log_sum_exp_of_the_scaled_scores() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g).bfloat16() for _ in range(3))
    lse = _check(q, k, v, scale=0.5)
    want = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) * 0.5, -1)
    assert lse.dtype == torch.float32 and torch.allclose(lse.double(), want, atol=1e-4)


def test_a_row_with_every_key_masked_gives_zeros() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 5, 16, generator=g).half() for _ in range(3))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    mask[0, 0, 3] = False
    out, lse = att.attention(q, k, v, mask, False, None, [16, 16, 4, 2])
    assert torch.equal(out[0, 0, 3], torch.zeros(16, dtype=torch.half)) and lse[0, 0, 3] == -math.inf
    keep = [0, 1, 2, 4]
    torch.testing.assert_close(out[0, 0, keep].float(), _reference(q, k, v, mask, False, None)[0, 0, keep].float(),
                               atol=4e-3, rtol=0)


def test_which_calls_it_takes() -> None:
    q = torch.randn(2, 3, 7, 16).bfloat16()
    assert att.takes(q, q, q, None) and att.takes(q, q, q, torch.zeros(7).bfloat16())
    assert not att.takes(q.float(), q.float(), q.float(), None)  # float32 stays the backends'
    assert not att.takes(q, q[:, :1], q[:, :1], None)  # grouped keys and values (no broadcast here)
    assert att.takes(q, q, q, torch.zeros(3, 7, 7).bfloat16())  # per head, right-aligned as torch broadcasts
    assert not att.takes(q, q, q, torch.zeros(2, 7, 7).bfloat16())  # 2 is no number of heads (3)
    assert not att.takes(q, q, q, torch.zeros(2, 1, 7, 7, dtype=torch.int64))
    wide = torch.randn(1, 1, 4, 300).bfloat16()
    assert not att.takes(wide, wide, wide, None)  # head dims past MAX_DIM


def test_candidates_fit_the_tokens() -> None:
    def padded(c: dict, lq: int, lk: int) -> int:  # the scores a call computes, padding included
        return -(-lq // c["BLOCK_M"]) * c["BLOCK_M"] * -(-lk // c["BLOCK_N"]) * c["BLOCK_N"]
    for lq, lk in ((10, 10), (128, 128), (7, 300)):
        found = att.candidates(lq, lk)
        assert len(found) == 4 and all(set(c) == set(att.TILE_KEYS) for c in found)
        assert padded(found[0], lq, lk) == min(padded(dict(zip(att.TILE_KEYS, c)), lq, lk) for c in att._CONFIGS)


@pytest.mark.parametrize("masked", [False, True])
def test_the_compile_job_follows_the_call(masked: bool) -> None:
    from torch._subclasses import FakeTensorMode

    from ember.runtime import precompile

    with FakeTensorMode():
        q = torch.empty(1, 128, 12, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        mask = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16) if masked else None
    job = att.job(q, q, q, mask, False, None, [64, 64, 4, 2])  # a graph's fake values, outside their mode
    meta = dict(job.meta)
    assert meta["MASK"] == (1 if masked else 0) and meta["SCALE"] == 0.125 and meta["BLOCK_D"] == 64
    fn = att._kernels(False).attention_forward
    assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])
    assert job.arg_dtypes[:6] == ("bfloat16",) * 5 + ("float32",)
    assert job.arg_dtypes[6:8] == (precompile.int_arg(12), precompile.int_arg(128))
