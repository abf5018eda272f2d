"""Pointwise ATen ops as Triton expressions.

Values inside a generated kernel are computed in their *compute dtype*: float32 for
float16/bfloat16 tensors (loads upcast, stores downcast), the tensor's own dtype otherwise.
Each lowering receives its operands already converted to the node's compute dtype where
the op's semantics need it, and returns one expression string.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def literal(value: object) -> str:
    """A Python scalar as Triton source."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"no Triton literal for {value!r}")


@dataclass
class Operand:
    """A value inside a kernel: a Triton expression with its compute dtype, or a Python scalar."""

    expr: str
    dtype: torch.dtype | None  # None: a Python scalar literal

    def as_(self, dtype: torch.dtype) -> str:
        dtype = compute_dtype(dtype)
        if self.dtype is None:
            if dtype == torch.bool:
                return self.expr
            if dtype.is_floating_point and "float(" not in self.expr and "." not in self.expr and "e" not in self.expr:
                return self.expr + ".0"
            return self.expr
        if self.dtype == dtype:
            return self.expr
        if dtype == torch.bool:
            return f"({self.expr} != 0)"
        return f"({self.expr}).to({TL_DTYPE[dtype]})"


def _out(node: fx.Node) -> torch.dtype:
    return compute_dtype(node.meta["val"].dtype)


def _promoted(node: fx.Node, *ops: Operand) -> torch.dtype:
    """The dtype torch promotes tensor/scalar operands of ``node`` to (comparisons use it)."""
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    scalars = [a for a in node.args if isinstance(a, (int, float, bool)) and not isinstance(a, fx.Node)]
    if not tensors:
        return _out(node)
    dtype = tensors[0].meta["val"].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.meta["val"].dtype)
    for s in scalars:
        if isinstance(s, float) and not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        elif isinstance(s, int) and not isinstance(s, bool) and dtype == torch.bool:
            dtype = torch.int64
    return compute_dtype(dtype)


Lowering = Callable[[fx.Node, list[Operand]], str]


def _binary(fmt: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        dt = _out(node)
        return fmt.format(a=ops[0].as_(dt), b=ops[1].as_(dt))
    return lower


def _unary(fmt: str, float_only: bool = False) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        return fmt.format(a=ops[0].as_(_out(node)))
    return lower


def _compare(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        dt = _promoted(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _add(node: fx.Node, ops: list[Operand], sign: str = "+") -> str:
    dt = _out(node)
    alpha = node.kwargs.get("alpha", 1)
    b = ops[1].as_(dt)
    if alpha != 1:
        b = f"({literal(alpha)} * {b})"
    return f"({ops[0].as_(dt)} {sign} {b})"


def _where(node: fx.Node, ops: list[Operand]) -> str:
    dt = _out(node)
    return f"tl.where({ops[0].as_(torch.bool)}, {ops[1].as_(dt)}, {ops[2].as_(dt)})"


def _clamp(node: fx.Node, ops: list[Operand]) -> str:
    # NaN-propagating like torch.clamp: comparisons with NaN are false, so NaN passes through.
    dt = _out(node)
    out = ops[0].as_(dt)
    lo = ops[1] if len(ops) > 1 else None
    hi = ops[2] if len(ops) > 2 else None
    if node.target == aten.clamp_max.default:
        lo, hi = None, ops[1]
    if lo is not None and lo.expr != "None":
        out = f"tl.where({out} < {lo.as_(dt)}, {lo.as_(dt)}, {out})"
    if hi is not None and hi.expr != "None":
        out = f"tl.where({out} > {hi.as_(dt)}, {hi.as_(dt)}, {out})"
    return out


def _max_min(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        dt = _out(node)
        a, b = ops[0].as_(dt), ops[1].as_(dt)
        if dt.is_floating_point:
            return f"tl.where(({a} {op} {b}) | ({a} != {a}), {a}, {b})"
        return f"tl.where({a} {op} {b}, {a}, {b})"
    return lower


def _pow(node: fx.Node, ops: list[Operand]) -> str:
    dt = _out(node)
    a = ops[0].as_(dt)
    e = node.args[1]
    table = {2: f"({a} * {a})", 3: f"({a} * {a} * {a})", 1: a, 0.5: f"tl.sqrt({a})",
             -0.5: f"tl.rsqrt({a})", -1: f"(1.0 / {a})", -2: f"(1.0 / ({a} * {a}))"}
    return table[e]


def _cast(node: fx.Node, ops: list[Operand]) -> str:
    # A cast to a narrower float type must round exactly as eager does, even though the
    # value stays float32 inside the kernel.
    target = node.meta["val"].dtype
    if target in (torch.bfloat16, torch.float16):
        return f"_round_to_{'bf16' if target == torch.bfloat16 else 'fp16'}({ops[0].as_(torch.float32)})"
    return ops[0].as_(target)


def _sign(node: fx.Node, ops: list[Operand]) -> str:
    dt = _out(node)
    a = ops[0].as_(dt)
    return f"tl.where({a} > 0, 1, tl.where({a} < 0, -1, 0)).to({TL_DTYPE[dt]})"


def _logical(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        return f"({ops[0].as_(torch.bool)} {op} {ops[1].as_(torch.bool)})"
    return lower


def _bitwise(op: str) -> Lowering:
    def lower(node: fx.Node, ops: list[Operand]) -> str:
        dt = _out(node)
        return f"({ops[0].as_(dt)} {op} {ops[1].as_(dt)})"
    return lower


def _bitwise_not(node: fx.Node, ops: list[Operand]) -> str:
    dt = _out(node)
    return f"({ops[0].as_(dt)} == 0)" if dt == torch.bool else f"(~{ops[0].as_(dt)})"


def _masked_fill(node: fx.Node, ops: list[Operand]) -> str:
    dt = _out(node)
    return f"tl.where({ops[1].as_(torch.bool)}, {ops[2].as_(dt)}, {ops[0].as_(dt)})"


def _identity(node: fx.Node, ops: list[Operand]) -> str:
    return ops[0].as_(_out(node))


POINTWISE_OPS: dict[object, Lowering] = {
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: lambda n, o: _add(n, o, "-"), aten.sub.Scalar: lambda n, o: _add(n, o, "-"),
    aten.rsub.Scalar: lambda n, o: _add(n, [o[1], o[0]], "-"),
    aten.mul.Tensor: _binary("({a} * {b})"), aten.mul.Scalar: _binary("({a} * {b})"),
    aten.div.Tensor: _binary("({a} / {b})"), aten.div.Scalar: _binary("({a} / {b})"),
    aten.neg.default: _unary("(-{a})"),
    aten.abs.default: _unary("tl.abs({a})"),
    aten.exp.default: _unary("tl.exp({a})"),
    aten.log.default: _unary("tl.log({a})"),
    aten.sqrt.default: _unary("tl.sqrt({a})"),
    aten.rsqrt.default: _unary("tl.rsqrt({a})"),
    aten.sin.default: _unary("tl.sin({a})"),
    aten.cos.default: _unary("tl.cos({a})"),
    aten.erf.default: _unary("tl.math.erf({a})"),
    aten.floor.default: _unary("tl.math.floor({a})"),
    aten.ceil.default: _unary("tl.math.ceil({a})"),
    # 1 - 2/(e^{2x}+1): exact at the saturated ends, accurate to float32 rounding elsewhere.
    aten.tanh.default: _unary("(1.0 - 2.0 / (tl.exp(2.0 * {a}) + 1.0))"),
    aten.sigmoid.default: _unary("(1.0 / (1.0 + tl.exp(-{a})))"),
    aten.reciprocal.default: _unary("(1.0 / {a})"),
    aten.relu.default: _unary("tl.where({a} < 0, 0, {a})"),
    aten.clamp.default: _clamp, aten.clamp_min.default: _clamp, aten.clamp_max.default: _clamp,
    aten.maximum.default: _max_min(">"), aten.minimum.default: _max_min("<"),
    aten.where.self: _where,
    aten.masked_fill.Scalar: _masked_fill,
    aten.eq.Tensor: _compare("=="), aten.eq.Scalar: _compare("=="),
    aten.ne.Tensor: _compare("!="), aten.ne.Scalar: _compare("!="),
    aten.lt.Tensor: _compare("<"), aten.lt.Scalar: _compare("<"),
    aten.le.Tensor: _compare("<="), aten.le.Scalar: _compare("<="),
    aten.gt.Tensor: _compare(">"), aten.gt.Scalar: _compare(">"),
    aten.ge.Tensor: _compare(">="), aten.ge.Scalar: _compare(">="),
    aten.logical_not.default: lambda n, o: f"({o[0].as_(torch.bool)} == 0)",
    aten.logical_and.default: _logical("&"), aten.logical_or.default: _logical("|"),
    aten.bitwise_and.Tensor: _bitwise("&"), aten.bitwise_or.Tensor: _bitwise("|"),
    aten.bitwise_xor.Tensor: _bitwise("^"), aten.bitwise_not.default: _bitwise_not,
    aten.isnan.default: lambda n, o: f"({o[0].expr} != {o[0].expr})",
    aten.pow.Tensor_Scalar: _pow,
    aten.sign.default: _sign,
    aten._to_copy.default: _cast,
    prims.convert_element_type.default: _cast,
    aten.clone.default: _identity,
    aten.lift_fresh_copy.default: _identity,
}

_POW_EXPONENTS = {2, 3, 1, 0.5, -0.5, -1, -2}


def pointwise_supported(node: fx.Node) -> str:
    """Empty if ``node`` can be generated; otherwise the reason it falls back."""
    target = node.target
    if target in (aten.div.Tensor, aten.div.Scalar) and node.kwargs.get("rounding_mode") is not None:
        return "div with rounding_mode"
    if target == aten.pow.Tensor_Scalar and node.args[1] not in _POW_EXPONENTS:
        return f"pow with exponent {node.args[1]!r}"
    if target == aten._to_copy.default:
        val = node.meta["val"]
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if src is None or src.device != val.device:
            return "device transfer"
    for a in node.args:
        if isinstance(a, complex):
            return "complex scalar"
    return ""
