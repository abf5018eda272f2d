"""Generated pointwise kernels vs eager ATen: unary ops, binary ops with broadcasting and
scalars, comparisons/where over float/int/bool, casts, and random fused chains.

Every case runs through ``target="triton-interpret"`` with EMBER_STRICT=1 on fresh random
inputs of random shape and memory layout, checks the forward result and (float32) the
gradients, and asserts that the ops ran in generated kernels.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from ember_check import (
    FLOAT_DTYPES,
    assert_close,
    broadcast_shape,
    check,
    layouts,
    make_input,
    shapes,
    strict_env,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ember

SETTINGS = settings(max_examples=8, deadline=None)

# name -> (function, input kind, ops expected in the generated forward kernel)
UNARY = {
    "neg": (torch.neg, "normal", ["aten.neg"]),
    "abs": (torch.abs, "normal", ["aten.abs"]),
    "exp": (torch.exp, "normal", ["aten.exp"]),
    "log": (torch.log, "positive", ["aten.log"]),
    "sqrt": (torch.sqrt, "positive", ["aten.sqrt"]),
    "rsqrt": (torch.rsqrt, "positive", ["aten.rsqrt"]),
    "tanh": (torch.tanh, "normal", ["aten.tanh"]),
    "sigmoid": (torch.sigmoid, "normal", ["aten.sigmoid"]),
    "relu": (torch.relu, "normal", ["aten.relu"]),
    "gelu": (F.gelu, "normal", ["aten.erf"]),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), "normal", ["aten.tanh"]),
    "silu": (F.silu, "normal", []),
    "hardswish": (F.hardswish, "normal", []),
    "hardsigmoid": (F.hardsigmoid, "normal", []),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.7), "normal", []),
    "clamp_min": (lambda x: torch.clamp(x, min=-0.3), "normal", []),
    "clamp_max": (lambda x: torch.clamp(x, max=0.4), "normal", []),
    "pow2": (lambda x: x.pow(2), "normal", []),
    "pow_half": (lambda x: x.pow(0.5), "positive", []),
    "pow_minus1": (lambda x: x ** -1, "positive", []),
    "reciprocal": (torch.reciprocal, "positive", []),
    "sub_from_scalar": (lambda x: 1.5 - x, "normal", []),
}


@st.composite
def tensor_case(draw, dtypes=FLOAT_DTYPES, max_numel=2048, **shape_kw):
    shape = draw(shapes(max_numel=max_numel, **shape_kw))
    layout = draw(layouts(shape))
    dtype = draw(st.sampled_from(dtypes))
    return shape, layout, dtype


@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(case=tensor_case())
def test_unary(name, case):
    fn, kind, expect = UNARY[name]
    shape, layout, dtype = case
    x = make_input(shape, dtype=dtype, kind=kind, requires_grad=dtype == torch.float32, **layout)
    check(fn, [x], expect_ops=expect)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_in_chain_with_grad(name):
    # The op between a prologue and an epilogue in one kernel, float32 with gradients, on a
    # transposed input (the hypothesis test above covers the layouts and dtypes).
    fn, kind, expect = UNARY[name]
    x = make_input((7, 9), "transposed", kind=kind, requires_grad=True)
    b = make_input((9,), "contiguous", requires_grad=True)
    pre = (lambda t: t * 1.25 + 0.1) if kind == "positive" else (lambda t: t * 1.5 - 0.2)
    check(lambda x, b: fn(pre(x)) * b - 0.5, [x, b], expect_ops=expect + ["aten.mul", "aten.sub"])


BINARY = {
    "add": lambda x, y: x + y,
    "add_alpha": lambda x, y: torch.add(x, y, alpha=2.5),
    "sub": lambda x, y: x - y,
    "sub_alpha": lambda x, y: torch.sub(x, y, alpha=-0.75),
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "where_gt": lambda x, y: torch.where(x > y, x, y * 2),
    "sq_diff": lambda x, y: (x - y).pow(2),
    "div_rev": lambda x, y: y / x,
}


@pytest.mark.parametrize("name", sorted(BINARY))
@SETTINGS
@given(data=st.data())
def test_binary_broadcast(name, data):
    shape, layout, dtype = data.draw(tensor_case())
    yshape = data.draw(broadcast_shape(shape))
    ylayout = data.draw(layouts(yshape))
    swap = data.draw(st.booleans())  # the broadcast operand first
    fp32 = dtype == torch.float32
    kind = "positive" if name.startswith("div") else "normal"
    x = make_input(shape, dtype=dtype, kind=kind, requires_grad=fp32, **layout)
    y = make_input(yshape, dtype=dtype, kind=kind, requires_grad=fp32, **ylayout)
    fn = BINARY[name]
    args = [y, x] if swap else [x, y]
    check(fn, args)


SCALAR_OPS = {
    "add_int": lambda x: x + 3,
    "add_float": lambda x: x + 0.375,
    "radd": lambda x: 2.5 + x,
    "sub_float": lambda x: x - 1.25,
    "rsub": lambda x: 1.25 - x,
    "mul_int": lambda x: x * -2,
    "mul_float": lambda x: x * 0.3,
    "div_float": lambda x: x / 3.0,
    "rdiv": lambda x: 2.0 / x,
    "div_int": lambda x: x / 7,
    "chain": lambda x: ((x * 2 + 1) / 3 - 0.5) * -1.5,
}


@pytest.mark.parametrize("name", sorted(SCALAR_OPS))
@settings(max_examples=5, deadline=None)
@given(case=tensor_case())
def test_scalar_operands(name, case):
    shape, layout, dtype = case
    kind = "positive" if name == "rdiv" else "normal"
    x = make_input(shape, dtype=dtype, kind=kind, requires_grad=dtype == torch.float32, **layout)
    check(SCALAR_OPS[name], [x])


COMPARE = {
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}


@pytest.mark.parametrize("name", sorted(COMPARE))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_comparisons(name, data):
    # Small-integer values so that equality happens; outputs are bool and must match exactly.
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]))
    shape = data.draw(shapes())
    yshape = data.draw(broadcast_shape(shape))
    x = make_input(shape, dtype=dtype, kind="int", **data.draw(layouts(shape)))
    y = make_input(yshape, dtype=dtype, kind="int", **data.draw(layouts(yshape)))
    op = COMPARE[name]
    with_scalar = data.draw(st.sampled_from(["tensor", "int", "float"]))
    if with_scalar == "tensor":
        check(lambda x, y: op(x, y), [x, y], exact=True)
    elif with_scalar == "int":
        check(lambda x: op(x, 1), [x], exact=True)
    else:
        check(lambda x: op(x, 0.5), [x], exact=True)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_where(data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]))
    shape = data.draw(shapes())
    cshape = data.draw(broadcast_shape(shape))
    yshape = data.draw(broadcast_shape(shape))
    cond = make_input(cshape, dtype=torch.bool, **data.draw(layouts(cshape)))
    fp32 = dtype == torch.float32
    x = make_input(shape, dtype=dtype, requires_grad=fp32, **data.draw(layouts(shape)))
    y = make_input(yshape, dtype=dtype, requires_grad=fp32, **data.draw(layouts(yshape)))
    form = data.draw(st.sampled_from(["tensors", "scalar_other", "scalar_self", "swap"]))
    if form == "tensors":
        check(lambda c, x, y: torch.where(c, x, y), [cond, x, y], exact=not fp32)
    elif form == "swap":
        check(lambda c, x, y: torch.where(c, y, x), [cond, x, y], exact=not fp32)
    elif form == "scalar_other":
        other = True if dtype == torch.bool else 3
        check(lambda c, x: torch.where(c, x, other), [cond, x], exact=not fp32)
    else:
        check(lambda c, x: torch.where(~c, 0.0, x) if x.is_floating_point() else torch.where(~c, 0, x),
              [cond, x], exact=not fp32)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_integer_and_bool_arithmetic(data):
    shape = data.draw(shapes())
    yshape = data.draw(broadcast_shape(shape))
    a = make_input(shape, dtype=torch.int64, kind="int", **data.draw(layouts(shape)))
    b = make_input(yshape, dtype=torch.int64, kind="int", **data.draw(layouts(yshape)))
    m = make_input(yshape, dtype=torch.bool, **data.draw(layouts(yshape)))
    form = data.draw(st.sampled_from(["arith", "mixed_bool", "minmax", "logical", "true_div", "float_scalar"]))
    if form == "arith":
        check(lambda a, b: (a + b) * 3 - b.abs(), [a, b], exact=True)
    elif form == "mixed_bool":
        check(lambda a, m: a * m + m, [a, m], exact=True)
    elif form == "minmax":
        check(lambda a, b: torch.maximum(a, b) - torch.minimum(a, -b).clamp(-3, 2), [a, b], exact=True)
    elif form == "logical":
        check(lambda a, m: torch.logical_and(a > 0, m) | ~m & (a == 0), [a, m], exact=True)
    elif form == "true_div":
        # int64 / int64 is a float32 true division in torch
        check(lambda a, b: a / (b.abs() + 1), [a, b])
    else:
        check(lambda a: (a * 0.5 + 1) > 1.25, [a], exact=True)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_mixed_dtype_promotion(data):
    shape = data.draw(shapes())
    yshape = data.draw(broadcast_shape(shape))
    x = make_input(shape, **data.draw(layouts(shape)), requires_grad=True)
    low = data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.int64, torch.bool]))
    y = make_input(yshape, dtype=low, **data.draw(layouts(yshape)))
    check(lambda x, y: x * y + y - x.tanh(), [x, y])


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_cast_float32_to_bf16_rounds_like_eager(data):
    # Values with many mantissa bits, so round-to-nearest-even matters; bf16 results must be
    # bit-identical to eager (a single rounding of the float32 value).
    shape = data.draw(shapes())
    x = make_input(shape, **data.draw(layouts(shape)))
    x = x * 37.77
    form = data.draw(st.sampled_from(["plain", "computed", "roundtrip", "ties"]))
    if form == "plain":
        check(lambda x: x.to(torch.bfloat16), [x], exact=True, expect_ops=[])
    elif form == "computed":
        check(lambda x: (x * 1.7 + 0.3).to(torch.bfloat16), [x], exact=True)
    elif form == "roundtrip":
        # float32 -> bf16 -> float32 inside one kernel: the float32 output holds bf16 values
        check(lambda x: (x * 3.1).to(torch.bfloat16).to(torch.float32) + 0.0, [x], exact=True)
    else:
        # exact ties: bf16 value + half an ulp (odd and even last mantissa bits)
        base = make_input(shape, dtype=torch.bfloat16, layout="contiguous").float()
        bits = base.view(torch.int32) | 0x8000
        ties = bits.view(torch.float32)
        check(lambda t: t.to(torch.bfloat16), [ties], exact=True)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_cast_low_precision_to_float32(data):
    shape = data.draw(shapes())
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]))
    x = make_input(shape, dtype=dtype, **data.draw(layouts(shape)))
    # bf16/fp16 -> float32 is exact; so is the float32 arithmetic after it and the cast back
    check(lambda x: x.float() * 0.5, [x], exact=True)
    check(lambda x: (x.float() * 3.3 - 1).to(dtype), [x], exact=True)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_cast_float32_to_fp16_rounds_like_eager(data):
    shape = data.draw(shapes())
    x = make_input(shape, **data.draw(layouts(shape))) * 13.13
    check(lambda x: (x + 0.1).to(torch.float16), [x], exact=True)


# -- random fused chains --------------------------------------------------------------------

CHAIN_UNARY = [
    lambda v: -v, torch.abs, lambda v: torch.exp(torch.tanh(v)), lambda v: torch.log(v.abs() + 0.5),
    lambda v: torch.sqrt(v.abs() + 0.1), lambda v: torch.rsqrt(v * v + 0.5), torch.tanh, torch.sigmoid,
    torch.relu, F.gelu, functools.partial(F.gelu, approximate="tanh"), F.silu, F.hardswish, F.hardsigmoid,
    lambda v: v.clamp(-1.0, 1.5), lambda v: v.pow(2), lambda v: (v.abs() + 0.2).pow(0.5),
    lambda v: (v.abs() + 0.5).pow(-1),
]
CHAIN_BINARY = [
    lambda v, w: v + w, lambda v, w: v - w, lambda v, w: v * w, lambda v, w: v / (w.abs() + 0.5),
    torch.maximum, torch.minimum,
    # Continuous where v == w: fused bf16 chains keep float32 intermediates (as Inductor's do), so
    # a branch on a rounded-vs-unrounded sum may flip; it must not jump the result when it does.
    lambda v, w: torch.where(v > w, v - w, (v - w) * 0.5), lambda v, w: torch.add(v, w, alpha=0.5),
]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_chain(data):
    shape, layout, dtype = data.draw(tensor_case())
    n_other = data.draw(st.integers(0, 2))
    fp32 = dtype == torch.float32
    x = make_input(shape, dtype=dtype, requires_grad=fp32, **layout)
    others = []
    for _ in range(n_other):
        oshape = data.draw(broadcast_shape(shape))
        others.append(make_input(oshape, dtype=dtype, requires_grad=fp32, **data.draw(layouts(oshape))))
    steps = data.draw(st.lists(st.tuples(st.booleans(), st.integers(0, 100), st.integers(0, 100)),
                               min_size=2, max_size=6))

    def fn(x, *others):
        v = x
        for binary, i, j in steps:
            if binary and others:
                v = CHAIN_BINARY[i % len(CHAIN_BINARY)](v, others[j % len(others)])
            else:
                v = CHAIN_UNARY[i % len(CHAIN_UNARY)](v)
        return v * 0.75 + 0.125

    tol = {} if fp32 else {"rtol": 4e-2, "atol": 4e-2}
    check(fn, [x, *others], **tol)


def test_multiple_outputs_share_one_kernel():
    x = make_input((5, 6), "transposed", requires_grad=True)
    y = make_input((6,), "contiguous", requires_grad=True)
    got, _ = check(lambda x, y: (torch.sigmoid(x) * y, (x + y).relu(), x.exp() - 1), [x, y])
    assert len(got) == 3


def test_generated_kernel_is_reported():
    # The bookkeeping the other tests rely on: a fused chain is one generated kernel.
    x = torch.randn(8, 16)
    with strict_env():
        compiled = ember.compile(lambda x: torch.tanh(x * 2 + 1).exp(), target="triton-interpret")
        assert_close(compiled(x), torch.tanh(x * 2 + 1).exp())
        (graph,) = compiled._ember_backend.log.graphs
        assert graph.error is None
        assert graph.kernels == 1
        generated = graph.placement["generated"]
        for op in ("aten.mul", "aten.add", "aten.tanh", "aten.exp"):
            assert generated[op] >= 1, generated


@pytest.mark.parametrize("shape,repeats", [((4,), (3,)), ((2, 3), (2, 1, 2)), ((2, 1, 3), (1, 4, 2)), ((3,), (0,))],
                         ids=["1d", "new-dim", "middle", "zero"])
def test_repeat_is_a_generated_copy(shape, repeats):
    # repeat decomposes into a broadcast view plus one copy (capture/decompositions.py), so it
    # runs inside a generated kernel and its gradient is a generated sum.
    x = make_input(shape, "contiguous", requires_grad=True)
    expect = ["aten.clone"] if 0 not in repeats else []
    check(lambda t: torch.sin(t.repeat(*repeats) * 2.0), [x], expect_ops=expect)


@pytest.mark.parametrize("kind", ["conv2d", "conv_transpose2d", "conv1d"])
def test_convolution_bias_is_added_by_a_generated_kernel(kind):
    # GPU targets run convolutions without their bias (capture/decompositions.py): the bias add
    # joins the ReLU's kernel and the bias gradient is a generated sum beside ReLU's backward.
    conv = {"conv2d": lambda x, w, b: F.conv2d(x, w, b, padding=1),
            "conv_transpose2d": lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2),
            "conv1d": lambda x, w, b: F.conv1d(x, w, b, padding=1)}[kind]
    x_shape, w_shape = {"conv2d": ((2, 3, 6, 5), (4, 3, 3, 3)), "conv_transpose2d": ((2, 3, 4, 4), (3, 4, 2, 2)),
                        "conv1d": ((2, 3, 7), (4, 3, 3))}[kind]
    x = make_input(x_shape, "contiguous", requires_grad=True)
    w = (torch.randn(w_shape) / 4).requires_grad_()
    b = torch.randn(4).requires_grad_()
    check(lambda x, w, b: torch.relu(conv(x, w, b)) * 1.5, [x, w, b], expect_ops=["aten.add"])
    compiled = ember.compile(lambda x, w, b: torch.relu(conv(x, w, b)), target="triton-interpret")
    compiled(x, w, b).sum().backward()
    fwd, bwd = (next(g for g in compiled._ember_backend.log.graphs if g.kind == k) for k in ("forward", "backward"))
    assert ", None, [" in next(line for line in fwd.program.splitlines() if "convolution" in line), fwd.program
    assert bwd.placement["generated"]["aten.sum"] >= 1, bwd.placement
