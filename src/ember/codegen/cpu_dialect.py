"""How numba CPU kernels spell values and ops: the numba ``Dialect`` of codegen/lowering.py.

A generated CPU kernel computes one element at a time inside plain loops (LLVM vectorises
them), so every expression is a scalar. Values compute in their compute dtype as in Triton
kernels (lowering.compute_dtype): float32 for bfloat16 tensors (loads widen, stores round to
nearest even, a cast to bfloat16 rounds but the value stays float32). numba's typing would
otherwise widen (float32 * int64 -> float64, int32 + int32 -> int64), so operands are always
converted explicitly with ``np.<dtype>(...)`` to the dtype torch computes the op in, constants
are typed (``np.float32(1.0)``), and narrow integer results are wrapped back (torch wraps on
overflow).

float32 transcendental functions use the vectorisable polynomials of runtime/cpu_support.py
(``exp32``, ``erf32``, ``tanh32``); float64 uses libm through ``math``.
"""

from __future__ import annotations

import math

import torch

from ember.codegen.lowering import Dialect, KernelValue, compute_dtype

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
NARROW_INTS = (torch.int32, torch.int16, torch.int8, torch.uint8)


class CpuValue(KernelValue):
    """A scalar inside a numba kernel, or a Python scalar of the graph (dtype None; ``kind``
    float | int | bool) held in a kernel parameter or written as a literal."""

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
        value = float(value)
        if math.isinf(value) or math.isnan(value):
            return f"{NP_DTYPE[dtype]}({'-' if value < 0 else ''}np.{'inf' if math.isinf(value) else 'nan'})"
        return f"{NP_DTYPE[dtype]}({value!r})"
    return f"{NP_DTYPE[dtype]}({int(value)})"


def load_expr(element: str, dtype: torch.dtype) -> str:
    """A tensor element read through its pointer (``in0[i]``) as a kernel value of ``dtype``."""
    if dtype == torch.bool:
        return f"({element} != 0)"
    if dtype == torch.bfloat16:  # exact: the bits are the top half of a float32
        return f"_bf16_to_f32({element})"
    return element


def store_expr(value: CpuValue, dtype: torch.dtype) -> str:
    """What a store of ``value`` to a tensor of ``dtype`` writes."""
    if dtype == torch.bool:
        return f"np.uint8({value.as_(torch.bool)})"
    if dtype == torch.bfloat16:  # float32 in the kernel; rounded to nearest even once, here
        return f"_f32_to_bf16({value.as_(torch.float32)})"
    return value.as_(dtype)


# {x}: the operand, {one}: 1 of the dtype; a pair is (float32, float64).
_MATH = {
    "abs": "abs({x})", "exp": ("exp32({x})", "exp64({x})"), "log": "math.log({x})", "sqrt": "math.sqrt({x})",
    "rsqrt": "({one} / math.sqrt({x}))", "sin": "math.sin({x})", "cos": "math.cos({x})",
    "erf": ("erf32({x})", "erf64({x})"), "floor": "np.floor({x})", "ceil": "np.ceil({x})",
    "tanh": ("tanh32({x})", "tanh64({x})"),
}


class CpuDialect(Dialect):
    name = "cpu"

    def type_name(self, dtype: torch.dtype) -> str:
        return NP_DTYPE[dtype]

    def literal(self, value: bool | int | float, dtype: torch.dtype) -> str:
        return typed(value, dtype)

    def select(self, cond: str, if_true: str, if_false: str) -> str:
        return f"({if_true} if {cond} else {if_false})"

    def math(self, fn: str, x: str, dtype: torch.dtype) -> str:
        spelling = _MATH[fn]
        if isinstance(spelling, tuple):
            spelling = spelling[1] if dtype == torch.float64 else spelling[0]
        return spelling.format(x=x, one=typed(1.0, dtype))

    def nan_max_min(self, kind: str, a: str, b: str) -> str:
        return f"_f{kind}({a}, {b})"  # llvm.maximum/minimum propagate NaN like torch

    def logical_not(self, x: str) -> str:
        return f"(not {x})"

    def round_to(self, dtype: torch.dtype, x: str) -> str:
        if dtype != torch.bfloat16:  # float16 groups stay on ATen (schedule/op_support.py)
            raise NotImplementedError(f"no CPU rounding to {dtype}")
        return f"_round_bf16({x})"

    def sign(self, x: str, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return x
        zero = typed(0, dtype)
        return f"({NP_DTYPE[dtype]}({x} > {zero}) - {NP_DTYPE[dtype]}({x} < {zero}))"

    def wrap(self, expr: str, dtype: torch.dtype) -> str:
        return f"{NP_DTYPE[dtype]}({expr})" if dtype in NARROW_INTS else expr


CPU = CpuDialect()
