"""How Triton kernels spell values and ops: the Triton ``Dialect`` of codegen/lowering.py.

Blocks of values compute in their compute dtype (float32 for half floats, lowering.py); Python
scalars stay literals that Triton types at the op (``x * 2.0``).
"""

from __future__ import annotations

import math

import torch

from ember.codegen.lowering import Dialect, KernelValue, compute_dtype

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


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


class TritonValue(KernelValue):
    """A block of values (or a Python scalar literal) inside a Triton kernel."""

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


# {x}: the operand. tanh as 1 - 2/(e^{2x}+1): exact at the saturated ends, accurate to float32
# rounding elsewhere.
_MATH = {
    "abs": "tl.abs({x})", "exp": "tl.exp({x})", "log": "tl.log({x})", "sqrt": "tl.sqrt({x})",
    "rsqrt": "tl.rsqrt({x})", "sin": "tl.sin({x})", "cos": "tl.cos({x})", "erf": "tl.math.erf({x})",
    "floor": "tl.math.floor({x})", "ceil": "tl.math.ceil({x})",
    "tanh": "(1.0 - 2.0 / (tl.exp(2.0 * {x}) + 1.0))",
}


class TritonDialect(Dialect):
    name = "triton"

    def type_name(self, dtype: torch.dtype) -> str:
        return TL_DTYPE[dtype]

    def literal(self, value: bool | int | float, dtype: torch.dtype) -> str:
        return literal(value)  # Triton types a literal at its use

    def select(self, cond: str, if_true: str, if_false: str) -> str:
        return f"tl.where({cond}, {if_true}, {if_false})"

    def math(self, fn: str, x: str, dtype: torch.dtype) -> str:
        return _MATH[fn].format(x=x)

    def nan_max_min(self, kind: str, a: str, b: str) -> str:
        return f"tl.where(({a} {'>' if kind == 'max' else '<'} {b}) | ({a} != {a}), {a}, {b})"

    def logical_not(self, x: str) -> str:
        return f"({x} == 0)"

    def round_to(self, dtype: torch.dtype, x: str) -> str:
        return f"_round_to_{'bf16' if dtype == torch.bfloat16 else 'fp16'}({x})"

    def sign(self, x: str, dtype: torch.dtype) -> str:
        return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({TL_DTYPE[dtype]})"


TRITON = TritonDialect()
