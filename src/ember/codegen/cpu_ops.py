"""Pointwise ATen ops as numba scalar expressions: the CPU twin of triton_ops.py.

A generated CPU kernel computes one element at a time inside plain loops (LLVM vectorises
them), so every lowering returns a scalar expression. Values are computed in their *compute
dtype*, as in Triton kernels (triton_ops.compute_dtype): float32 for bfloat16 tensors (loads
widen, stores round to nearest even, a cast to bfloat16 rounds but the value stays float32),
the tensor's own dtype otherwise; numba's typing would otherwise widen (float32 * int64 -> float64, int32 + int32 ->
int64), so operands are always converted explicitly with ``np.<dtype>(...)`` to the dtype torch
computes the op in, and narrow integer results are wrapped back (torch wraps on overflow).

float32 transcendental functions use the vectorisable polynomials of runtime/cpu_support.py
(``exp32``, ``erf32``, ``tanh32``); float64 uses libm through ``math``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ember.codegen.triton_ops import _promoted, compute_dtype

aten = torch.ops.aten
prims = torch.ops.prims

NP_DTYPE = {
    torch.float32: "np.float32", torch.float64: "np.float64", torch.int64: "np.int64", torch.int32: "np.int32",
    torch.int16: "np.int16", torch.int8: "np.int8", torch.uint8: "np.uint8", torch.bool: "np.uint8",
}
# Pointers to tensor data (bool tensors hold one byte per element, 0 or 1; bfloat16 tensors are
# read and written as their 16-bit patterns: _bf16_to_f32 / _f32_to_bf16 in runtime/cpu_support.py).
POINTER = {
    torch.float32: "_p_f32", torch.float64: "_p_f64", torch.int64: "_p_i64", torch.int32: "_p_i32",
    torch.int16: "_p_i16", torch.int8: "_p_i8", torch.uint8: "_p_u8", torch.bool: "_p_u8",
    torch.bfloat16: "_p_u16",
}
# float16 has no exact vectorisable conversion here yet: its groups stay on ATen.
SUPPORTED_DTYPES = frozenset(NP_DTYPE) | {torch.bfloat16}
NARROW_INTS = (torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class Value:
    """A value inside a kernel: an expression with its dtype, or a Python scalar (dtype None;
    ``kind`` float | int | bool) held in a kernel parameter or written as a literal."""

    expr: str
    dtype: torch.dtype | None  # a compute dtype: a bfloat16 tensor's values are float32 here
    kind: str = ""

    def __post_init__(self) -> None:
        if self.dtype is not None:
            self.dtype = compute_dtype(self.dtype)

    def as_(self, dtype: torch.dtype) -> str:
        dtype = compute_dtype(dtype)
        if dtype == torch.bool:
            if self.dtype == torch.bool or self.kind == "bool":
                return self.expr
            return f"({self.expr} != 0)"
        if self.dtype == dtype:
            return self.expr
        return f"{NP_DTYPE[dtype]}({self.expr})"


def typed(value: float | int, dtype: torch.dtype) -> str:
    """A literal constant of ``dtype`` (``np.float32(1.0)``): a bare literal would widen."""
    dtype = compute_dtype(dtype)
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        return f"{NP_DTYPE[dtype]}({float(value)!r})"
    return f"{NP_DTYPE[dtype]}({int(value)})"


def load_expr(element: str, dtype: torch.dtype) -> str:
    """A tensor element read through its pointer (``in0[i]``) as a kernel value of ``dtype``."""
    if dtype == torch.bool:
        return f"({element} != 0)"
    if dtype == torch.bfloat16:  # exact: the bits are the top half of a float32
        return f"_bf16_to_f32({element})"
    return element


def store_expr(value: Value, dtype: torch.dtype) -> str:
    """What a store of ``value`` to a tensor of ``dtype`` writes."""
    if dtype == torch.bool:
        return f"np.uint8({value.as_(torch.bool)})"
    if dtype == torch.bfloat16:  # float32 in the kernel; rounded to nearest even once, here
        return f"_f32_to_bf16({value.as_(torch.float32)})"
    return value.as_(dtype)


def value_dtype(node: fx.Node) -> torch.dtype:
    """The dtype ``node``'s values have inside a kernel (its compute dtype)."""
    return compute_dtype(node.meta["val"].dtype)



Lowering = Callable[[fx.Node, list[Value]], str]


def _binary(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = value_dtype(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _add(node: fx.Node, ops: list[Value], sign: str = "+") -> str:
    dt = value_dtype(node)
    alpha = node.kwargs.get("alpha", 1)
    b = ops[1].as_(dt)
    if alpha != 1:
        b = f"({typed(alpha, dt)} * {b})"
    return f"({ops[0].as_(dt)} {sign} {b})"


def _math(f32: str, f64: str) -> Lowering:
    """A float function; integer inputs compute in the (float) output dtype, as torch does."""
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = value_dtype(node)
        fn = f64 if dt == torch.float64 else f32
        return fn.format(a=ops[0].as_(dt), one=typed(1.0, dt))
    return lower


def _unary(fmt: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = value_dtype(node)
        return fmt.format(a=ops[0].as_(dt), zero=typed(0, dt), one=typed(1, dt))
    return lower


def _compare(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = _promoted(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _where(node: fx.Node, ops: list[Value]) -> str:
    dt = value_dtype(node)
    return f"({ops[1].as_(dt)} if {ops[0].as_(torch.bool)} else {ops[2].as_(dt)})"


def _masked_fill(node: fx.Node, ops: list[Value]) -> str:
    dt = value_dtype(node)
    return f"({ops[2].as_(dt)} if {ops[1].as_(torch.bool)} else {ops[0].as_(dt)})"


def _clamp(node: fx.Node, ops: list[Value]) -> str:
    # Comparisons with NaN are false, so NaN passes through as in torch.clamp.
    dt = value_dtype(node)
    out = ops[0].as_(dt)
    lo = ops[1] if len(ops) > 1 else None
    hi = ops[2] if len(ops) > 2 else None
    if node.target == aten.clamp_max.default:
        lo, hi = None, ops[1]
    if lo is not None and lo.expr != "None":
        out = f"({lo.as_(dt)} if {out} < {lo.as_(dt)} else {out})"
    if hi is not None and hi.expr != "None":
        out = f"({hi.as_(dt)} if {out} > {hi.as_(dt)} else {out})"
    return out


def _max_min(kind: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = value_dtype(node)
        a, b = ops[0].as_(dt), ops[1].as_(dt)
        if dt.is_floating_point:  # llvm.maximum/minimum propagate NaN like torch
            return f"_f{kind}({a}, {b})"
        return f"({a} if {a} {'>' if kind == 'max' else '<'} {b} else {b})"
    return lower


def _pow(node: fx.Node, ops: list[Value]) -> str:
    dt = value_dtype(node)
    a = ops[0].as_(dt)
    one = typed(1, dt)
    table = {2: f"({a} * {a})", 3: f"({a} * {a} * {a})", 1: a, 0.5: f"math.sqrt({a})",
             -0.5: f"({one} / math.sqrt({a}))", -1: f"({one} / {a})", -2: f"({one} / ({a} * {a}))"}
    return table[node.args[1]]


def _cast(node: fx.Node, ops: list[Value]) -> str:
    # A cast to bfloat16 rounds exactly as eager does, though the value stays float32 here.
    if node.meta["val"].dtype == torch.bfloat16:
        return f"_round_bf16({ops[0].as_(torch.float32)})"
    return ops[0].as_(value_dtype(node))


def _sign(node: fx.Node, ops: list[Value]) -> str:
    dt = value_dtype(node)
    a = ops[0].as_(dt)
    if dt == torch.bool:
        return a
    return f"({NP_DTYPE[dt]}({a} > {typed(0, dt)}) - {NP_DTYPE[dt]}({a} < {typed(0, dt)}))"


def _logical(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        return f"({ops[0].as_(torch.bool)} {op} {ops[1].as_(torch.bool)})"
    return lower


def _bitwise(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Value]) -> str:
        dt = value_dtype(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _bitwise_not(node: fx.Node, ops: list[Value]) -> str:
    dt = value_dtype(node)
    return f"(not {ops[0].as_(dt)})" if dt == torch.bool else f"(~{ops[0].as_(dt)})"


def _isnan(node: fx.Node, ops: list[Value]) -> str:
    return f"({ops[0].expr} != {ops[0].expr})"


def _identity(node: fx.Node, ops: list[Value]) -> str:
    return ops[0].as_(value_dtype(node))


CPU_POINTWISE_OPS: dict[object, Lowering] = {
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: lambda n, o: _add(n, o, "-"), aten.sub.Scalar: lambda n, o: _add(n, o, "-"),
    aten.rsub.Scalar: lambda n, o: _add(n, [o[1], o[0]], "-"),
    aten.mul.Tensor: _binary("*"), aten.mul.Scalar: _binary("*"),
    aten.div.Tensor: _binary("/"), aten.div.Scalar: _binary("/"),
    aten.neg.default: _unary("(-{a})"),
    aten.abs.default: _unary("abs({a})"),
    aten.exp.default: _math("exp32({a})", "exp64({a})"),
    aten.log.default: _math("math.log({a})", "math.log({a})"),
    aten.sqrt.default: _math("math.sqrt({a})", "math.sqrt({a})"),
    aten.rsqrt.default: _math("({one} / math.sqrt({a}))", "({one} / math.sqrt({a}))"),
    aten.sin.default: _math("math.sin({a})", "math.sin({a})"),
    aten.cos.default: _math("math.cos({a})", "math.cos({a})"),
    aten.erf.default: _math("erf32({a})", "erf64({a})"),
    aten.floor.default: _unary("np.floor({a})"),
    aten.ceil.default: _unary("np.ceil({a})"),
    aten.tanh.default: _math("tanh32({a})", "tanh64({a})"),
    aten.sigmoid.default: _math("({one} / ({one} + exp32(-{a})))", "({one} / ({one} + exp64(-{a})))"),
    aten.reciprocal.default: _math("({one} / {a})", "({one} / {a})"),
    aten.relu.default: _unary("({zero} if {a} < {zero} else {a})"),
    aten.clamp.default: _clamp, aten.clamp_min.default: _clamp, aten.clamp_max.default: _clamp,
    aten.maximum.default: _max_min("max"), aten.minimum.default: _max_min("min"),
    aten.where.self: _where,
    aten.masked_fill.Scalar: _masked_fill,
    aten.eq.Tensor: _compare("=="), aten.eq.Scalar: _compare("=="),
    aten.ne.Tensor: _compare("!="), aten.ne.Scalar: _compare("!="),
    aten.lt.Tensor: _compare("<"), aten.lt.Scalar: _compare("<"),
    aten.le.Tensor: _compare("<="), aten.le.Scalar: _compare("<="),
    aten.gt.Tensor: _compare(">"), aten.gt.Scalar: _compare(">"),
    aten.ge.Tensor: _compare(">="), aten.ge.Scalar: _compare(">="),
    aten.logical_not.default: lambda n, o: f"(not {o[0].as_(torch.bool)})",
    aten.logical_and.default: _logical("&"), aten.logical_or.default: _logical("|"),
    aten.bitwise_and.Tensor: _bitwise("&"), aten.bitwise_or.Tensor: _bitwise("|"),
    aten.bitwise_xor.Tensor: _bitwise("^"), aten.bitwise_not.default: _bitwise_not,
    aten.isnan.default: _isnan,
    aten.pow.Tensor_Scalar: _pow,
    aten.sign.default: _sign,
    aten._to_copy.default: _cast,
    prims.convert_element_type.default: _cast,
    aten.clone.default: _identity,
    aten.lift_fresh_copy.default: _identity,
}

# Arguments a lowering reads from the node itself (structure, not data): never kernel parameters.
STRUCTURAL_ARGS = {aten.pow.Tensor_Scalar: {1}}


def lower_pointwise(node: fx.Node, ops: list[Value]) -> str:
    """The expression for ``node``; narrow integer results wrap to their dtype as in torch."""
    expr = CPU_POINTWISE_OPS[node.target](node, ops)
    dt = value_dtype(node)
    if dt in NARROW_INTS:
        expr = f"{NP_DTYPE[dt]}({expr})"
    return expr
