"""Pointwise ATen ops and reduction steps, each written once for every kernel dialect.

Values inside a generated kernel are computed in their *compute dtype*: float32 for
float16/bfloat16 tensors (loads widen, stores round), the tensor's own dtype otherwise. A lowering
receives its operands as ``KernelValue``s, converts each with ``value.as_(dtype)`` to the dtype
torch computes the op in, and returns one expression. What the Triton and the numba kernels
spell differently goes through their ``Dialect`` (codegen/triton_dialect.py, cpu_dialect.py): a
literal, a select, a math function, a NaN-propagating max/min, a logical not, a rounding cast;
the one op the two compute by different formulas (``sign``) is a dialect method too.

Which ops are listed, and on what conditions they fuse, is the planner's table
(schedule/op_support.py); this one holds exactly those ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's values have inside a kernel: half floats compute in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def value_dtype(node: fx.Node) -> torch.dtype:
    """The dtype ``node``'s values have inside a kernel (its compute dtype)."""
    return compute_dtype(node.meta["val"].dtype)


def promoted_dtype(node: fx.Node) -> torch.dtype:
    """The compute dtype torch promotes ``node``'s tensor and scalar operands to (comparisons use it)."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    scalars = [a for a in node.args if isinstance(a, (int, float, bool)) and not isinstance(a, fx.Node)]
    if not tensors:
        return value_dtype(node)
    dtype = tensors[0].meta["val"].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.meta["val"].dtype)
    for s in scalars:
        if isinstance(s, float) and not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        elif isinstance(s, int) and not isinstance(s, bool) and dtype == torch.bool:
            dtype = torch.int64
    return compute_dtype(dtype)


@dataclass
class KernelValue:
    """A value inside a kernel: an expression with its compute dtype, or a Python scalar (dtype
    None; ``kind`` says bool, int or float where the dialect needs it). Each dialect's subclass
    spells the conversion ``as_``."""

    expr: str
    dtype: torch.dtype | None
    kind: str = ""

    def __post_init__(self) -> None:
        if self.dtype is not None:
            self.dtype = compute_dtype(self.dtype)

    def as_(self, dtype: torch.dtype) -> str:
        """The value as an expression of ``dtype``'s compute dtype."""
        raise NotImplementedError


Lowering = Callable[[fx.Node, list[KernelValue], "Dialect"], str]


class Dialect:
    """How one kernel language spells the pieces the shared lowerings are built of."""

    name = ""

    def type_name(self, dtype: torch.dtype) -> str:
        """The language's name of a compute dtype (``tl.float32``, ``np.float32``)."""
        raise NotImplementedError

    def literal(self, value: bool | int | float, dtype: torch.dtype) -> str:
        """A constant of ``dtype`` (nan and infinities included)."""
        raise NotImplementedError

    def select(self, cond: str, if_true: str, if_false: str) -> str:
        raise NotImplementedError

    def math(self, fn: str, x: str, dtype: torch.dtype) -> str:
        """``fn`` (abs exp log sqrt rsqrt sin cos erf floor ceil tanh) of ``x``, in ``dtype``."""
        raise NotImplementedError

    def nan_max_min(self, kind: str, a: str, b: str) -> str:
        """The float max (``kind`` "max") or min of ``a`` and ``b``, NaN if either is NaN (as torch)."""
        raise NotImplementedError

    def logical_not(self, x: str) -> str:
        raise NotImplementedError

    def round_to(self, dtype: torch.dtype, x: str) -> str:
        """float32 ``x`` rounded as eager rounds to the half-float ``dtype``; it stays float32."""
        raise NotImplementedError

    def sign(self, x: str, dtype: torch.dtype) -> str:
        """-1, 0 or 1 in ``dtype`` (``x`` itself for bool)."""
        raise NotImplementedError

    def wrap(self, expr: str, dtype: torch.dtype) -> str:
        """An op's result as a value of its compute dtype (numba widens narrow integers)."""
        return expr


# -- the lowerings -----------------------------------------------------------------------------

def _binary(op: str, operand_dtype: Callable[[fx.Node], torch.dtype] = value_dtype) -> Lowering:
    def lower(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
        dt = operand_dtype(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _compare(op: str) -> Lowering:
    return _binary(op, promoted_dtype)


def _logical(op: str) -> Lowering:
    return _binary(op, lambda node: torch.bool)


def _math(fn: str) -> Lowering:
    """A math function; integer inputs compute in the (float) output dtype, as torch does."""
    def lower(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
        dt = value_dtype(node)
        return d.math(fn, ops[0].as_(dt), dt)
    return lower


def _add(node: fx.Node, ops: list[KernelValue], d: Dialect, sign: str = "+") -> str:
    dt = value_dtype(node)
    alpha = node.kwargs.get("alpha", 1)
    b = ops[1].as_(dt)
    if alpha != 1:
        b = f"({d.literal(alpha, dt)} * {b})"
    return f"({ops[0].as_(dt)} {sign} {b})"


def _sub(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return _add(node, ops, d, "-")


def _rsub(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return _add(node, [ops[1], ops[0]], d, "-")


def _neg(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return f"(-{ops[0].as_(value_dtype(node))})"


def _sigmoid(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    one = d.literal(1.0, dt)
    return f"({one} / ({one} + {d.math('exp', f'-{ops[0].as_(dt)}', dt)}))"


def _reciprocal(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    return f"({d.literal(1.0, dt)} / {ops[0].as_(dt)})"


def _relu(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    a, zero = ops[0].as_(dt), d.literal(0, dt)
    return d.select(f"{a} < {zero}", zero, a)


def _clamp(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    # NaN-propagating like torch.clamp: comparisons with NaN are false, so NaN passes through.
    dt = value_dtype(node)
    out = ops[0].as_(dt)
    lo = ops[1] if len(ops) > 1 else None
    hi = ops[2] if len(ops) > 2 else None
    if node.target == aten.clamp_max.default:
        lo, hi = None, ops[1]
    if lo is not None and lo.expr != "None":
        out = d.select(f"{out} < {lo.as_(dt)}", lo.as_(dt), out)
    if hi is not None and hi.expr != "None":
        out = d.select(f"{out} > {hi.as_(dt)}", hi.as_(dt), out)
    return out


def max_min(d: Dialect, kind: str, a: str, b: str, dtype: torch.dtype) -> str:
    """max (``kind`` "max") or min of ``a`` and ``b``; floats propagate NaN as torch does."""
    if dtype.is_floating_point:
        return d.nan_max_min(kind, a, b)
    return d.select(f"{a} {'>' if kind == 'max' else '<'} {b}", a, b)


def _max_min(kind: str) -> Lowering:
    def lower(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
        dt = value_dtype(node)
        return max_min(d, kind, ops[0].as_(dt), ops[1].as_(dt), dt)
    return lower


def _where(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    return d.select(ops[0].as_(torch.bool), ops[1].as_(dt), ops[2].as_(dt))


def _masked_fill(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    return d.select(ops[1].as_(torch.bool), ops[2].as_(dt), ops[0].as_(dt))


def _pow(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    # The exponent is structural (schedule/op_support.py: POW_EXPONENTS, STRUCTURAL_ARGS).
    dt = value_dtype(node)
    a = ops[0].as_(dt)
    exponent = node.args[1]
    if exponent == 1:
        return a
    if exponent in (2, 3):
        return "(" + " * ".join([a] * int(exponent)) + ")"
    if exponent == 0.5:
        return d.math("sqrt", a, dt)
    if exponent == -0.5:
        return d.math("rsqrt", a, dt)
    one = d.literal(1.0, dt)
    return {-1: f"({one} / {a})", -2: f"({one} / ({a} * {a}))"}[exponent]


def _cast(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    # A cast to a narrower float type must round exactly as eager does, even though the value
    # stays float32 inside the kernel.
    target = node.meta["val"].dtype
    if target in (torch.bfloat16, torch.float16):
        return d.round_to(target, ops[0].as_(torch.float32))
    return ops[0].as_(target)


def _logical_not(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return d.logical_not(ops[0].as_(torch.bool))


def _bitwise_not(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    return d.logical_not(ops[0].as_(dt)) if dt == torch.bool else f"(~{ops[0].as_(dt)})"


def _sign(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    dt = value_dtype(node)
    return d.sign(ops[0].as_(dt), dt)


def _isnan(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return f"({ops[0].expr} != {ops[0].expr})"


def _identity(node: fx.Node, ops: list[KernelValue], d: Dialect) -> str:
    return ops[0].as_(value_dtype(node))


POINTWISE_LOWERINGS: dict[object, Lowering] = {
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: _sub, aten.sub.Scalar: _sub,
    aten.rsub.Scalar: _rsub,
    aten.mul.Tensor: _binary("*"), aten.mul.Scalar: _binary("*"),
    aten.div.Tensor: _binary("/"), aten.div.Scalar: _binary("/"),
    aten.neg.default: _neg,
    aten.abs.default: _math("abs"),
    aten.exp.default: _math("exp"),
    aten.log.default: _math("log"),
    aten.sqrt.default: _math("sqrt"),
    aten.rsqrt.default: _math("rsqrt"),
    aten.sin.default: _math("sin"),
    aten.cos.default: _math("cos"),
    aten.erf.default: _math("erf"),
    aten.floor.default: _math("floor"),
    aten.ceil.default: _math("ceil"),
    aten.tanh.default: _math("tanh"),
    aten.sigmoid.default: _sigmoid,
    aten.reciprocal.default: _reciprocal,
    aten.relu.default: _relu,
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
    aten.logical_not.default: _logical_not,
    aten.logical_and.default: _logical("&"), aten.logical_or.default: _logical("|"),
    aten.bitwise_and.Tensor: _binary("&"), aten.bitwise_or.Tensor: _binary("|"),
    aten.bitwise_xor.Tensor: _binary("^"), aten.bitwise_not.default: _bitwise_not,
    aten.isnan.default: _isnan,
    aten.pow.Tensor_Scalar: _pow,
    aten.sign.default: _sign,
    aten._to_copy.default: _cast,
    prims.convert_element_type.default: _cast,
    aten.clone.default: _identity,
    aten.lift_fresh_copy.default: _identity,
}


def lower_pointwise(node: fx.Node, ops: list[KernelValue], dialect: Dialect) -> str:
    """The expression for pointwise ``node`` in ``dialect``, as a value of its compute dtype."""
    return dialect.wrap(POINTWISE_LOWERINGS[node.target](node, ops, dialect), value_dtype(node))


# -- reductions ----------------------------------------------------------------------------------

def reduction_kind(node: fx.Node) -> str:
    """sum (also mean), max or min."""
    return {aten.amax.default: "max", aten.amin.default: "min"}.get(node.target, "sum")


def reduction_identity(kind: str, dtype: torch.dtype) -> bool | int | float:
    """The value a reduction of ``kind`` starts from (and masked lanes hold) in ``dtype``; narrow
    integers' identities fit their type."""
    if kind == "sum":
        return 0
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    if dtype == torch.bool:
        return kind != "max"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def accumulate(d: Dialect, kind: str, acc: str, value: str, dtype: torch.dtype) -> str:
    """The accumulator ``acc`` after taking in ``value`` (both of ``dtype``)."""
    if kind == "sum":
        return f"{acc} + {value}"
    return max_min(d, kind, value, acc, dtype)
