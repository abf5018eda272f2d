"""Which ATen ops Ember's kernel writers lower, and on what conditions: the table the planner
decides fusion by (schedule/rules.py) and both code generators are held to (codegen/lowering.py
writes every op listed here once, for Triton and for numba).

An op listed here fuses when its tensors have a FUSABLE_DTYPES dtype and ``pointwise_supported``
finds nothing against its arguments. Where a target computes fewer dtypes exactly, its group
stays on ATen with the reason ``kernel_dtype_unsupported`` gives.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

POINTWISE_OPS: frozenset = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
    aten.neg.default, aten.abs.default, aten.exp.default, aten.log.default, aten.sqrt.default,
    aten.rsqrt.default, aten.sin.default, aten.cos.default, aten.erf.default, aten.floor.default,
    aten.ceil.default, aten.tanh.default, aten.sigmoid.default, aten.reciprocal.default, aten.relu.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.maximum.default, aten.minimum.default, aten.where.self, aten.masked_fill.Scalar,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.bitwise_not.default,
    aten.isnan.default, aten.pow.Tensor_Scalar, aten.sign.default,
    aten._to_copy.default, prims.convert_element_type.default, aten.clone.default, aten.lift_fresh_copy.default,
})

# pow with these exponents is written as products, square roots and reciprocals.
POW_EXPONENTS = frozenset({2, 3, 1, 0.5, -0.5, -1, -2})

# Arguments a lowering reads from the node itself (structure, not data): never kernel parameters.
STRUCTURAL_ARGS: dict[object, frozenset[int]] = {aten.pow.Tensor_Scalar: frozenset({1})}

# Dtypes a fused group's tensors may have (pointwise ops, reductions, constants).
FUSABLE_DTYPES = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
})

# Per target, the dtypes its kernels compute exactly. The CPU (numba) kernels have no exact
# vectorisable float16 conversion yet.
KERNEL_DTYPES: dict[str, frozenset] = {
    "triton": FUSABLE_DTYPES,
    "cpu": FUSABLE_DTYPES - {torch.float16},
}


def pointwise_supported(node: fx.Node) -> str:
    """Empty if ``node`` (an op of POINTWISE_OPS) can be generated; otherwise why it falls back."""
    target = node.target
    if target in (aten.div.Tensor, aten.div.Scalar) and node.kwargs.get("rounding_mode") is not None:
        return "div with rounding_mode"
    if target == aten.pow.Tensor_Scalar and node.args[1] not in POW_EXPONENTS:
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


def kernel_dtype_unsupported(target: str, dtype: torch.dtype) -> str:
    """Empty if ``target``'s kernels ("triton" or "cpu") compute ``dtype`` exactly; else why not."""
    if dtype in KERNEL_DTYPES[target]:
        return ""
    return f"{dtype} tensors stay on the ATen path (no exact {'CPU' if target == 'cpu' else target} kernel for them)"
