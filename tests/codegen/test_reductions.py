"""Generated reduction kernels vs eager ATen: sum/mean/amax/amin over any dims with keepdim
both ways and pointwise prologues/epilogues, var/var_mean/std, several reductions in one
kernel; each in both reduction modes (persistent, and looped via tiny block constants).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ember_check import FLOAT_DTYPES, check, layouts, make_input, random_values, shapes, strict_env
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ember
from ember import config

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

MODES = [pytest.param(False, id="persistent"), pytest.param(True, id="looped")]
REDUCE = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}
EXPECT = {"sum": "aten.sum", "mean": "aten.sum", "amax": "aten.amax", "amin": "aten.amin"}


@st.composite
def dim_spec(draw, rank: int):
    """How the reduced dims are written: one dim, several (any sign), all (None) or []."""
    form = draw(st.sampled_from(["single", "multiple", "all", "empty"]))
    if form == "all":
        return None
    if form == "empty":
        return []
    if form == "single":
        d = draw(st.integers(0, rank - 1))
        return d - rank if draw(st.booleans()) else d
    picked = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return [d - rank if draw(st.booleans()) else d for d in picked]


def _reduce(name: str, x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    op = REDUCE[name]
    if dims is None:
        return op(x) if not keepdim else op(x, dim=list(range(x.dim())), keepdim=True)
    if name == "mean" and dims == []:
        return op(x, dim=dims, keepdim=keepdim)
    return op(x, dims, keepdim=keepdim)


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return {"norm_rtol": 1e-5}
    return {}


@pytest.mark.parametrize("looped", MODES)
@pytest.mark.parametrize("name", sorted(REDUCE))
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_reduce_with_prologue_epilogue(name, looped, data):
    shape = data.draw(shapes(max_rank=4, max_numel=2048))
    layout = data.draw(layouts(shape))
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    dims = data.draw(dim_spec(len(shape)))
    keepdim = data.draw(st.booleans())
    form = data.draw(st.sampled_from(["plain", "prologue", "epilogue", "both"]))
    fp32 = dtype == torch.float32
    x = make_input(shape, dtype=dtype, requires_grad=fp32, **layout)

    def fn(x):
        v = x * 2 + 1 if form in ("prologue", "both") else x
        r = _reduce(name, v, dims, keepdim)
        return r * 3 - 0.5 if form in ("epilogue", "both") else r

    check(fn, [x], looped=looped, expect_ops=[EXPECT[name]] if shape and min(shape) > 1 else [], **_tol(dtype))


@pytest.mark.parametrize("looped", MODES)
@pytest.mark.parametrize("name", ["sum", "amax", "amin"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_reduce_int64(name, looped, data):
    shape = data.draw(shapes(max_numel=1024))
    x = make_input(shape, dtype=torch.int64, kind="int", **data.draw(layouts(shape)))
    dims = data.draw(dim_spec(len(shape)))
    if dims == [] and name != "sum":
        dims = None
    keepdim = data.draw(st.booleans())
    check(lambda x: _reduce(name, x * 3 - 1, dims, keepdim), [x], looped=looped, exact=True)


@pytest.mark.parametrize("looped", MODES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_centred_by_own_reduction(looped, data):
    # x - reduce(x, keepdim) * ...: a full-domain output that needs a reduction first
    # (two phases in the looped mode).
    shape = data.draw(shapes(min_rank=2, max_numel=2048))
    layout = data.draw(layouts(shape))
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    dims = data.draw(dim_spec(len(shape)).filter(lambda d: d not in (None, [])))
    name = data.draw(st.sampled_from(sorted(REDUCE)))
    x = make_input(shape, dtype=dtype, requires_grad=dtype == torch.float32, **layout)
    check(lambda x: (x - _reduce(name, x, dims, True)) * 2, [x], looped=looped, **_tol(dtype))


@pytest.mark.parametrize("looped", MODES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_several_reductions_one_input(looped, data):
    shape = data.draw(shapes(min_rank=1, max_numel=2048))
    layout = data.draw(layouts(shape))
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdim = data.draw(st.booleans())
    x = make_input(shape, dtype=dtype, requires_grad=dtype == torch.float32, **layout)

    def fn(x):
        s = x.sum(dim, keepdim=keepdim)
        m = x.amax(dim, keepdim=keepdim)
        n = (x * x).amin(dim, keepdim=keepdim)
        return s, m - n, (x.exp() - 1).mean(dim, keepdim=keepdim)

    check(fn, [x], looped=looped, **_tol(dtype))


@pytest.mark.parametrize("looped", MODES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_reduction_of_broadcast_product(looped, data):
    # (x * w).sum(dim) with w broadcast along some dims: the load of w walks fewer dims.
    shape = data.draw(shapes(min_rank=2, max_rank=3, max_numel=2048))
    layout = data.draw(layouts(shape))
    wshape = tuple(s if data.draw(st.booleans()) else 1 for s in shape)
    w = make_input(wshape, requires_grad=True, **data.draw(layouts(wshape)))
    x = make_input(shape, requires_grad=True, **layout)
    dims = data.draw(dim_spec(len(shape)).filter(lambda d: d not in (None, [])))
    check(lambda x, w: (x * w + w).sum(dims), [x, w], looped=looped, norm_rtol=1e-5)


VAR = {
    "var": lambda x, dims, c, k: torch.var(x, dims, correction=c, keepdim=k),
    "std": lambda x, dims, c, k: torch.std(x, dims, correction=c, keepdim=k),
    "var_mean": lambda x, dims, c, k: torch.var_mean(x, dims, correction=c, keepdim=k),
    "std_mean": lambda x, dims, c, k: torch.std_mean(x, dims, correction=c, keepdim=k),
}


@pytest.mark.parametrize("looped", MODES)
@pytest.mark.parametrize("name", sorted(VAR))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_variance(name, looped, data):
    shape = data.draw(shapes(min_side=2, max_numel=2048))
    layout = data.draw(layouts(shape))
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    dims = data.draw(dim_spec(len(shape)).filter(lambda d: d != []))
    correction = data.draw(st.sampled_from([0, 1]))
    keepdim = data.draw(st.booleans())
    shift = data.draw(st.sampled_from([0.0, 3.0]))  # a mean far from zero
    x = make_input(shape, dtype=dtype, requires_grad=dtype == torch.float32, **layout)
    if name.startswith("std") and x.requires_grad:
        # d std / dx = (x - mean) / (n std): at zero spread (a reduced dim that is a stride-0
        # broadcast of one value) it is a ratio of rounding errors in eager and Ember alike.
        spread = torch.var(x.detach(), dims, correction=0)
        assume(bool((spread > 1e-3).all()))
    fn = VAR[name]
    check(lambda x: fn(x + shift, dims, correction, keepdim), [x], looped=looped, **_tol(dtype))


@pytest.mark.parametrize("correction", [0, 1])
def test_variance_of_single_element_groups(correction):
    # Reducing a size-1 dim: correction=1 divides 0 by 0 (eager: nan, with a warning).
    x = make_input((4, 1, 6), "contiguous")
    with pytest.warns(UserWarning) if correction else _nothing():
        want = torch.var(x, 1, correction=correction)
    assert want.isnan().all() == bool(correction)
    check(lambda x: torch.var(x, 1, correction=correction) + x.sum(1), [x])


@pytest.mark.parametrize("correction", [0, 1])
def test_var_mean_of_single_element(correction):
    # var_mean over a dim of size 1 next to others: n == correction gives nan in eager.
    x = make_input((5, 1), "contiguous")
    check(lambda x: torch.var_mean(x * 2, 1, correction=correction), [x])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("looped", MODES)
def test_long_reduction_many_loop_iterations(looped):
    # rnumel 1000 >> loop_rblock 8: 125 loop iterations; a masked tail on the last one.
    x = make_input((3, 1000), "transposed", requires_grad=True)
    check(lambda x: (x.sum(1), x.amax(1), torch.var_mean(x, 1, correction=1), x.softmax(1)), [x],
          looped=looped, norm_rtol=1e-5)


def test_full_reduction_to_scalar():
    x = make_input((7, 11, 5), "permuted", perm=[2, 0, 1], requires_grad=True)
    check(lambda x: ((x * x).sum() + x.amax() - x.amin(), x.mean()), [x], norm_rtol=1e-5)
    check(lambda x: ((x * x).sum() + x.amax() - x.amin(), x.mean()), [x], norm_rtol=1e-5, looped=True)


@pytest.mark.parametrize("looped", MODES)
def test_float_sum_is_as_accurate_as_aten(looped):
    # Batch-norm statistics of activations whose mean dwarfs their spread: a sequential fp32
    # sum over a tile loses digits that the normalised output then amplifies. Measured
    # against float64, Ember's output must be about as accurate as ATen's.
    # Looped: 16 iterations of 256-wide tiles (each lane adds sequentially across iterations).
    torch.manual_seed(0)
    x = torch.randn(2, 32, 32, 32) * 0.5 + 30 * torch.rand(1, 32, 1, 1)

    def bn(t):
        return torch.nn.functional.batch_norm(t, None, None, training=True)

    ref = bn(x.double())
    eager = bn(x)
    from ember_check import strict_env

    import ember
    with strict_env(looped=looped, loop_rblock=256):
        got = ember.compile(bn, target="triton-interpret")(x)

    def err(a):
        return ((a.double() - ref).norm() / ref.norm()).item()
    assert err(got) <= max(4 * err(eager), 1e-6), (err(got), err(eager))


@pytest.mark.parametrize("case", ["last_keepdim", "first", "all", "nonbool", "dims", "as_mask"])
def test_any_is_a_generated_reduction(case):
    # any -> amax of int32 "is nonzero" flags (capture/decompositions.py); NaN counts as nonzero.
    fns = {
        "last_keepdim": lambda x: torch.any(x > 0.5, -1, keepdim=True),
        "first": lambda x: torch.any(x > 0.5, 0),
        "all": lambda x: torch.any(x > 2.5),
        "nonbool": lambda x: (x * (x > 1.0)).any(1),
        "dims": lambda x: torch.any(x.reshape(2, 3, 4) > 1.0, dim=(0, 2)),
        "as_mask": lambda x: torch.where(torch.any(x > 1.0, -1, keepdim=True), x, -x),
    }
    x = make_input((6, 4), "contiguous")
    x[0, 0] = float("nan")
    check(fns[case], [x], grad=False, expect_ops=["aten.amax"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integer_max_and_min_of_narrow_types(dtype):
    # The reductions' identities must fit the type (int64's minimum does not fit int32).
    x = torch.randint(0, 100, (5, 7), dtype=dtype)
    check(lambda t: torch.amax(t, 1) + torch.amin(t, 0).sum(), [x], grad=False)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("window", [2, (2, 3)])
def test_tiling_max_pool_is_generated_and_routes_gradients_like_aten(layout, window):
    # kernel == stride windows that tile the plane (capture/pooling.py): the maximum is pointwise
    # over the window's strided views, the backward sends each gradient to the window's first
    # maximum as ATen does.
    # ReLU zeros make ties; a NaN must win its window, forward and backward.
    x = make_input((2, 3, 12, 6), layout)
    x[0, 1, 0, 1] = float("nan")
    x.requires_grad_()
    fn = lambda t: F.max_pool2d(torch.relu(t), window) * 1.5  # noqa: E731
    with strict_env():
        compiled = ember.compile(fn, target="triton-interpret")
        got, want = compiled(x), fn(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert got.stride() == want.stride()
    cot = random_values(want.shape, want.dtype)
    (g_got,), (g_want,) = torch.autograd.grad(got, x, cot), torch.autograd.grad(want, x, cot)
    assert torch.equal(g_got, g_want) and g_got.stride() == g_want.stride()
    for graph in compiled._ember_backend.log.graphs:
        assert not any("max_pool" in op for where in graph.placement.values() for op in where), graph.placement
    fwd = next(g for g in compiled._ember_backend.log.graphs if g.kind == "forward")
    assert fwd.placement["generated"]["aten.maximum"] >= 1


def test_max_pool_indices_and_other_windows():
    x = make_input((2, 3, 8, 6), "contiguous")
    with strict_env():
        out, idx = ember.compile(lambda t: F.max_pool2d(t, 2, return_indices=True), target="triton-interpret")(x)
    want_out, want_idx = F.max_pool2d(x, 2, return_indices=True)
    assert torch.equal(out, want_out) and torch.equal(idx, want_idx)
    # Overlapping windows: Ember's own kernels (ops/max_pool.py); dilated ones stay ATen's.
    check(lambda t: F.max_pool2d(t, 3, 2), [x], grad=False, allow_fallback=["ember.max_pool2d"])
    check(lambda t: F.max_pool2d(t, 3, 1, dilation=2), [x], grad=False,
          allow_fallback=["aten.max_pool2d_with_indices"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float32_sums_are_generated(dtype: torch.dtype) -> None:
    # CUDA autocast gives every sum dtype=float32: the kernels load half inputs as float32 anyway.
    x = make_input((6, 33), "contiguous", dtype=dtype, requires_grad=dtype == torch.float32)
    tol = {} if dtype == torch.float32 else {"norm_rtol": 1e-2}
    check(lambda t: torch.sum(t * 2, 1, dtype=torch.float32) + 1, [x], expect_ops=["aten.sum"], **tol)


def test_sums_to_another_dtype_stay_aten() -> None:
    # int32 -> int64 (and a narrowing float sum) keep ATen's kernel.
    x = torch.randint(-50, 50, (4, 9), dtype=torch.int32)
    check(lambda t: torch.sum(t + 1, 1, dtype=torch.int64), [x], allow_fallback=["aten.sum"])
    y = make_input((4, 9), "contiguous")
    check(lambda t: torch.sum(t * 3, 0, dtype=torch.bfloat16), [y], allow_fallback=["aten.sum"], norm_rtol=1e-2)


@pytest.mark.parametrize("looped", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_max_and_min_give_nan_to_rows_holding_one(looped, dtype):
    # The interpreter reduces max/min with numpy's NaN-ignoring reductions (reduce_rows); a row
    # with a NaN must still give NaN, as torch's max does, and the other rows their extremes.
    x = make_input((6, 40), "contiguous").to(dtype)
    x[1, 7] = float("nan")
    x[4, :] = float("nan")
    x[5, :] = float("-inf")
    fn = lambda t: (torch.amax(t, 1) * 2, torch.amin(t, 1) - 1, torch.softmax(t.float(), -1))  # noqa: E731
    with strict_env(looped=looped):
        got = ember.compile(fn, target="triton-interpret")(x)
    for g, w in zip(got, fn(x)):
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        torch.testing.assert_close(torch.nan_to_num(g), torch.nan_to_num(w))


def test_max_of_a_split_reduction_gives_nan_to_its_row():
    # A long row split over programs: the partial results and their combination keep the NaN.
    x = make_input((2, 20000), "contiguous")
    x[0, 15000] = float("nan")
    with strict_env(looped=True), config.patch(interpret_split_target_programs=64):
        got = ember.compile(lambda t: (torch.amax(t, 1) * 2, torch.amin(t, 1) * 2), target="triton-interpret")(x)
    for g, w in zip(got, (torch.amax(x, 1) * 2, torch.amin(x, 1) * 2)):
        assert torch.isnan(g[0]) and not torch.isnan(g[1])
        torch.testing.assert_close(g[1], w[1])
