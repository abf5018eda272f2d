"""``var_mean``'s decomposition (also training batch norm's statistics): two forms and the rule
that picks one.

Two passes (the general form): the mean, then the sum of centred squares. Both sums sit in one
fused group, but the second reads the mean, so they are two reduction levels: two loops over the
input, and with split reductions (codegen/triton_tiles.py) two partial + combine kernel pairs
before the kernel that stores the outputs (a ResNet-50 batch norm: 5 kernels, 3 reads of x).

One pass (shifted sums): with a shift ``s`` per row, ``S1 = sum(x - s)`` and
``S2 = sum((x - s)^2)`` depend on nothing the group computes, so they are two reductions of one
level: one loop, one read of x (3 kernels, 2 reads of x with the normalising pass, as Inductor's
Welford reduction). ``mean = s + S1/n``, ``var = (S2 - S1^2/n) / (n - correction)`` clamped at 0.
Summing ``x - s`` rather than ``x`` keeps the cancellation in ``S2 - S1^2/n`` to about
``(mean - s)^2 / var``; with ``s`` one element of the row, that is a few units for any row whose
first element is not an outlier, wherever the mean lies (data with mean 100 and spread 0.1 keeps
fp32's digits, where unshifted sums would lose them all).

The rule (``one_pass_form``): the one-pass form where it pays and is safe, else two passes:
  * the ``one_pass_var_mean`` setting: ``auto`` (the default) takes it where the stored tensor
    the shifts come from is bfloat16 or float16 (autocast's activations): its elements carry 8-11
    bits, and the shifted sums' cancellation error (float32 rounding times a few units) lies far
    below that; a float32 tensor keeps two passes, whose statistics are as accurate as eager's
    (measured: float32 instance-norm gradients of style_transfer 30x further from float64 with
    one pass). ``always`` takes it for float32 too, ``off`` never;
  * the input computes in float32 (float32, bfloat16, float16 inputs: the kernels accumulate in
    float32);
  * at least ``one_pass_var_mean_min`` elements per row (shorter rows are persistent reductions,
    one read either way);
  * the shift is a zero-copy view of a tensor already in memory: a graph input or a library
    call's output (convolution, matmul), possibly through views or one dtype conversion (batch
    norm under autocast widens the bf16 convolution output first). A value a fused group computes
    (a biased convolution's ``conv + bias``) would have to be stored for the view to read it,
    which costs more than the pass it saves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from ember import compat
from ember.config import settings
from ember.schedule.rules import EXTERN_OPS

aten = torch.ops.aten
prims = torch.ops.prims

_HALF = (torch.float16, torch.bfloat16)
# Views the shift may look through to the stored tensor (each a zero-copy ATen view step).
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default, aten.alias.default}
_CONVERSIONS = {aten._to_copy.default, prims.convert_element_type.default}


def reduced_count(x: torch.Tensor, dims: Sequence[int] | None) -> int:
    if dims is None or len(dims) == 0:
        return x.numel()
    count = 1
    for d in dims:
        count *= x.shape[d]
    return count


def _stored(node: fx.Node) -> bool:
    """Whether ``node``'s value is in memory before any fused group reads it."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node.op == "placeholder" or (node.op == "call_function" and node.target in EXTERN_OPS)


def _pure_conversion(node: fx.Node) -> bool:
    """A dtype conversion that changes nothing else (no layout, device or memory format)."""
    if node.target not in _CONVERSIONS or not isinstance(node.args[0], fx.Node):
        return False
    return set(node.kwargs) <= {"dtype"}


def shift_source(x: torch.Tensor) -> torch.Tensor | None:
    """The stored tensor whose elements serve as shifts for ``x``'s rows (``x`` itself, or the
    narrower tensor ``x`` widens), None where there is none (see the rule above)."""
    node = compat.traced_producer(x)
    if node is None:
        return None
    if _stored(node):
        return x
    if node.op == "call_function" and _pure_conversion(node) and _stored(node.args[0]):
        source = compat.traced_tensor(node.args[0])
        if source is not None and source.shape == x.shape and source.dtype.is_floating_point:
            return source
    return None


def one_pass_form(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor | None:
    """The rule: the tensor to take shifts from where var_mean of ``x`` over ``dims`` takes the
    one-pass form, None where it keeps two passes."""
    cfg = settings()
    mode = cfg.one_pass_var_mean
    if mode == "off" or x.dtype not in (torch.float32, *_HALF):
        return None
    if reduced_count(x, dims) < max(cfg.one_pass_var_mean_min, 2):
        return None
    source = shift_source(x)
    if source is not None and mode == "auto" and source.dtype not in _HALF:
        return None
    return source


def _first_of_rows(source: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """Each row's first element, kept-dim shaped: slices of ``source`` (a view, no copy)."""
    out = source
    for d in dims:
        out = aten.slice.Tensor(out, d, 0, 1)
    return out


def var_mean_one_pass(x: torch.Tensor, source: torch.Tensor, dims: list[int], n: int,
                      corr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted sums (module docstring); float32 results with kept dims."""
    shift = _first_of_rows(source, dims)
    # A half-float shift promotes to float32 inside the subtraction: no separate conversion op.
    xf = x.float() if x.dtype in _HALF else x
    d = xf - shift
    s1 = aten.sum.dim_IntList(d, dims, True)
    s2 = aten.sum.dim_IntList(d * d, dims, True)
    mean = shift + s1 * (1.0 / n)
    centred_squares = aten.clamp_min.default(s2 - s1 * s1 * (1.0 / n), 0.0)
    # Divide (not multiply by 1/n): eager divides, and n - corr <= 0 must give inf/nan, not raise.
    var = centred_squares / float(max(n - corr, 0))
    return var, mean


def var_mean_two_pass(x: torch.Tensor, dims: list[int], n: int, corr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean, then centred squares, in float32 for half inputs; results with kept dims."""
    xf = x.float() if x.dtype in _HALF else x
    mean = aten.sum.dim_IntList(xf, dims, True) * (1.0 / n)
    centred = xf - mean
    var = aten.sum.dim_IntList(centred * centred, dims, True) / float(max(n - corr, 0))
    return var, mean


def var_mean(x: torch.Tensor, dims: Sequence[int] | None = None, *, correction: float | None = None,
             keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.var_mean.correction`` in ATen sums the scheduler fuses (the form the rule picks)."""
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else [d % max(x.dim(), 1) for d in dims]
    n = reduced_count(x, dims)
    corr = 1.0 if correction is None else float(correction)
    source = one_pass_form(x, dims)
    if source is not None:
        var, mean = var_mean_one_pass(x, source, dims, n, corr)
    else:
        var, mean = var_mean_two_pass(x, dims, n, corr)
    if not keepdim:
        mean = aten.squeeze.dims(mean, dims)
        var = aten.squeeze.dims(var, dims)
    return var.to(x.dtype), mean.to(x.dtype)
