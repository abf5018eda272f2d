"""The decomposition table: which ATen ops are rewritten into Ember's small core op set.

Starts from PyTorch's core ATen decompositions and adds the composite ops whose forward
passes core ATen keeps whole (batch/layer/instance norm, softmax, gelu ...), so that
every normalisation and activation reaches the scheduler as pointwise ops plus
sum/amax reductions it can fuse. ``var_mean`` gets a decomposition written in ATen sums (instead
of the ``prims.var`` the reference uses) so it fuses like any reduction: one pass of shifted sums
or two passes, by the rule in capture/var_mean.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch._decomp
from torch._decomp import core_aten_decompositions, get_decompositions

from ember.capture import pooling, scatter_add, var_mean
from ember.config import settings
from ember.ops import reflection_pad

aten = torch.ops.aten

_EXTRA = [
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten.native_batch_norm,
    aten.native_layer_norm,
    aten.native_group_norm,
    aten._softmax,
    aten._log_softmax,
    aten.gelu,
    aten.hardswish,
    aten.hardsigmoid,
    aten.silu,
]

# Kept whole: library calls and ops whose decompositions only add work.
_KEEP = [
    aten.native_dropout,  # one RNG call, same stream as eager
    aten.embedding,
    aten.embedding_dense_backward,
    aten.max_pool2d_with_indices,
    aten.max_pool2d_with_indices_backward,
    aten.avg_pool2d,
    aten.avg_pool2d_backward,
    aten.convolution_backward,
    # Padding and nearest upsampling are one gather kernel each in ATen; their decompositions
    # are index ops with clamped aranges, and the backward ones dozens of index/index_put ops
    # per layer (171 per CycleGAN training step). On GPU targets 2-D reflection padding goes to
    # Ember's gather kernels instead (ops/reflection_pad.py).
    aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d,
    aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward,
    aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d,
    aten.replication_pad1d_backward, aten.replication_pad2d_backward, aten.replication_pad3d_backward,
    aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
    aten.upsample_nearest1d_backward, aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
    # Attention is a library call (flash / memory-efficient / cuDNN). PyTorch's decomposition of
    # the CPU flash kernel also gives wrong gradients (seen on torch 2.14.1 with BERT).
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
]


def _reduced_count(x: torch.Tensor, dims: Sequence[int] | None) -> int:
    return var_mean.reduced_count(x, dims)


def _var(x: torch.Tensor, dims: Sequence[int] | None = None, *, correction: float | None = None,
         keepdim: bool = False) -> torch.Tensor:
    return var_mean.var_mean(x, dims, correction=correction, keepdim=keepdim)[0]


def _mean(x: torch.Tensor, dims: Sequence[int] | None = None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    # PyTorch's reference decomposes mean into prims; this keeps it in ATen sum + div, accumulated
    # in fp32 for half inputs like eager, so the scheduler fuses it as any reduction.
    out_dtype = dtype or x.dtype
    xf = x.to(out_dtype)
    if xf.dtype in (torch.float16, torch.bfloat16):
        xf = xf.float()
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else list(dims)
    total = aten.sum.dim_IntList(xf, dims, keepdim)
    return (total / float(_reduced_count(x, dims))).to(out_dtype)


def _repeat(x: torch.Tensor, repeats: Sequence[int]) -> torch.Tensor:
    # repeat = a broadcast view materialised by one copy (a pointwise op the scheduler fuses)
    # instead of ATen's repeat kernel; instance norm repeats its affine parameters per sample.
    lead = len(repeats) - x.dim()
    shape = [1] * lead + list(x.shape)
    interleaved = [d for s in shape for d in (1, s)]
    expanded = [d for r, s in zip(repeats, shape) for d in (r, s)]
    y = aten.expand.default(aten.view.default(x, interleaved), expanded)
    out = aten.clone.default(y, memory_format=torch.contiguous_format)
    return aten.view.default(out, [r * s for r, s in zip(repeats, shape)])


def _any(x: torch.Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> torch.Tensor:
    # any = amax over "is nonzero" as int32: a reduction the scheduler fuses with its producer
    # (transformers' attention masks: one per layer) instead of an ATen kernel.
    nonzero = x if x.dtype == torch.bool else aten.ne.Scalar(x, 0)
    dims = list(range(x.dim())) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    if not dims or x.dim() == 0:
        return aten._to_copy.default(nonzero, dtype=torch.bool)
    flags = aten._to_copy.default(nonzero, dtype=torch.int32)
    return aten._to_copy.default(aten.amax.default(flags, dims, keepdim), dtype=torch.bool)


def _convolution_bias_apart(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                            padding: list[int], dilation: list[int], transposed: bool,
                            output_padding: list[int], groups: int) -> torch.Tensor:
    # GPU targets: the convolution runs without its bias and the bias add joins the pointwise
    # kernel after it (ReLU, a norm's prologue), where ATen's cuDNN path adds it in a kernel of
    # its own; in training the bias gradient becomes a generated reduction fused with the
    # activation's backward instead of convolution_backward's ATen reduction (vgg16: 13 adds and
    # 13 reductions, 4.2 of 24.5 ms per step on the H100).
    if bias is None:
        return NotImplemented
    out = aten.convolution.default(x, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    return aten.add.Tensor(out, aten.view.default(bias, [1, -1] + [1] * (out.dim() - 2)))


def _convolution_backward_bias_apart(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                     bias_sizes: list[int] | None, stride: list[int], padding: list[int],
                                     dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
                                     output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    # Autograd differentiates the convolution before it is decomposed, so the backward still
    # asks convolution_backward for the bias gradient: a sum of the output gradient over every
    # dim but the channels, which a generated reduction computes beside the activation's backward.
    if not output_mask[2]:
        return NotImplemented
    grad_bias = aten.sum.dim_IntList(grad, [0, *range(2, grad.dim())])
    if not (output_mask[0] or output_mask[1]):
        return None, None, grad_bias
    grad_x, grad_w, _ = aten.convolution_backward.default(
        grad, x, weight, None, stride, padding, dilation, transposed, output_padding, groups,
        [output_mask[0], output_mask[1], False])
    return grad_x, grad_w, grad_bias


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _mean(x, None, False, dtype=dtype)


# CPU inference keeps these activations whole: oneDNN runs them as post-ops of the convolution
# or linear layer before them (passes/cpu_library.py), and ATen's own kernels are vectorised.
CPU_INFERENCE_WHOLE = [aten.gelu, aten.hardswish, aten.hardsigmoid, aten.silu]


def _stack(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``cat`` of unsqueezed inputs, the result in its stacked shape. PyTorch's reference cats
    along ``dim`` and then splits that dim with a view, which a fused group cannot follow: the
    consumers of the stack could not join the generated cat (schedule/range_select.py)."""
    dim = dim % (tensors[0].dim() + 1)
    return torch.cat([t.unsqueeze(dim) for t in tensors], dim)


def _roll(x: torch.Tensor, shifts: int | Sequence[int], dims: int | Sequence[int] = ()) -> torch.Tensor:
    """``roll`` as a ``cat`` of two slices per rolled dim (nested for several dims), which the
    scheduler fuses as masked shifted loads into the consumers (schedule/range_select.py, a
    nested cat is inlined into the outer one's pieces). PyTorch's reference is an
    ``index_select`` per dim, an ATen gather kernel each (swin's shifted windows: two rolls per
    block forward and two backward)."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims or len(shifts) != len(dims) or x.dim() == 0 or x.numel() == 0:
        return NotImplemented  # flattened roll, invalid arguments, empty: the reference handles them
    out = x
    for shift, dim in zip(shifts, dims):
        dim = dim % x.dim()
        size = x.shape[dim]
        shift = shift % size
        if shift:
            out = torch.cat([aten.slice.Tensor(out, dim, size - shift, size), aten.slice.Tensor(out, dim, 0, size - shift)],
                            dim)
    return aten.clone.default(out) if out is x else out


def _constant_pad(x: torch.Tensor, pad: Sequence[int], value: float = 0.0) -> torch.Tensor:
    """``constant_pad_nd`` as slices (negative pads) and a cat with fills (positive pads) per dim,
    which the scheduler fuses like roll's cats; a zero pad is a clone. ATen's kernel is a copy of
    its own (swin pads every window attention's input to a multiple of the window, by zero at
    224x224, and its gradient crops it back)."""
    if len(pad) % 2 or len(pad) // 2 > x.dim() or x.numel() == 0:
        return NotImplemented
    out = x
    for i in range(len(pad) // 2):
        dim, lo, hi = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        size = out.shape[dim]
        start, end = max(-lo, 0), size - max(-hi, 0)
        if end <= start:
            return NotImplemented  # cropped to nothing: ATen's kernel
        if start or end < size:
            out = aten.slice.Tensor(out, dim, start, end)
        pieces = []
        for width in (max(lo, 0), None, max(hi, 0)):
            if width is None:
                pieces.append(out)
            elif width:
                shape = list(out.shape)
                shape[dim] = width
                pieces.append(aten.full.default(shape, value, dtype=x.dtype, device=x.device))
        if len(pieces) > 1:
            out = torch.cat(pieces, dim)
    return aten.clone.default(out, memory_format=torch.contiguous_format)


def core_aten_table() -> dict[object, Callable]:
    """PyTorch's core ATen decompositions without the entries that only run an op's own C++
    CompositeImplicitAutograd kernel.

    ``core_aten_decompositions()`` (torch >= 2.6) builds export's ``CustomDecompTable``: the core
    list plus an entry for every ATen op with a CompositeImplicitAutograd kernel, found by walking
    the whole ``aten`` namespace (0.43 s of a 4.4 s cold first call of resnet18 on a 2-core CPU).
    An entry that runs the op's C++ composite kernel changes nothing (the dispatcher runs that
    kernel anyway for an op without an entry); the ops whose composite kernel is a Python
    decomposition (nearest upsampling's) are added by name. tests/capture/test_decompositions.py
    checks that the two tables agree on every other op and that traced graphs are the same.
    """
    core = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    if core is None:
        return dict(core_aten_decompositions())
    table = dict(core())
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    for packet in _PYTHON_COMPOSITE:
        op = packet.default
        kernel = op.py_kernels.get(composite)
        if kernel is not None and not isinstance(kernel, torch._C.DispatchKey):
            table.setdefault(op, kernel)
    return table


# ATen ops whose CompositeImplicitAutograd kernel is registered from Python (torch._decomp): the
# walk in ``core_aten_decompositions`` finds them; ``core_aten_table`` names them.
_PYTHON_COMPOSITE = [
    aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
    aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d,
]


def decomposition_table(cpu_inference: bool = False, gpu: bool = False) -> dict[object, Callable]:
    """The table handed to AOTAutograd (``cpu_inference``: activations stay whole, see above;
    ``gpu``: a Triton target, where convolution biases are added by generated kernels)."""
    table = core_aten_table()
    table.update(get_decompositions([op for op in _EXTRA if not (cpu_inference and op in CPU_INFERENCE_WHOLE)]))
    if cpu_inference:
        for op in CPU_INFERENCE_WHOLE:
            for overload in op.overloads():
                table.pop(getattr(op, overload), None)
    for op in _KEEP:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    for op, fn in ((aten.var_mean, var_mean.var_mean), (aten.var, _var)):
        table[op.correction] = fn
    table[aten.mean.dim] = _mean
    table[aten.mean.default] = _mean_all
    table[aten.repeat.default] = _repeat
    table[aten.any.dim] = _any
    table[aten.any.dims] = _any
    table[aten.any.default] = _any
    if gpu:
        table[aten.convolution.default] = _convolution_bias_apart
        table[aten.convolution_backward.default] = _convolution_backward_bias_apart
        table[aten.max_pool2d_with_indices.default] = pooling.max_pool2d_with_indices
        table[aten.stack.default] = _stack
        table[aten.roll.default] = _roll
        table[aten.constant_pad_nd.default] = _constant_pad
        table[aten.max_pool2d_with_indices_backward.default] = pooling.max_pool2d_with_indices_backward
        scatter_add.register(table)
        if settings().reflection_pad:  # EMBER_REFLECTION_PAD=0: ATen's padding kernels
            table[aten.reflection_pad2d.default] = reflection_pad.decompose_forward
            table[aten.reflection_pad2d_backward.default] = reflection_pad.decompose_backward
    return table
