"""Max pooling with overlapping windows through Ember's own Triton kernels (GPU targets).

ResNet's stem pools 3x3 windows with stride 2 and padding 1. ATen's NHWC kernels took 0.43 ms
(forward) and 0.90 ms (backward) of a bf16 ResNet-50 training step at batch 128 on the H100,
where Inductor's generated kernels took 0.19 and 0.73. Two costs: ATen saves int64 indices
(8 bytes per output element, written by the forward and read by the backward), and its backward
scatters. Here the forward saves each output's window position as int8 (the window's row-major
offset, at most 127 of them), and the backward is a gather: every input element visits the at
most ceil(kh/sh) * ceil(kw/sw) windows that contain it and sums the gradients of those whose
maximum it was.

``ember::max_pool2d`` returns (maxima, positions); ``ember::max_pool2d_backward`` takes the
output gradient and the positions. The decompositions (capture/pooling.py) rebuild ATen's
flat indices from the positions for callers that read them (dead code in training) and recompute
the positions from the input in the backward, which the joint graph's CSE joins with the
forward's call, so the partitioner saves the int8 positions. Semantics follow ATen's kernels:
a NaN counts as the maximum (the last NaN of the window wins), otherwise the first maximum in
row-major window order, padding never wins, and a window of only -inf points at its first real
element. CPU tensors (the interpreter in CI) run the same kernels through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
from torch._prims_common import suggest_memory_format

from ember.ops.windows import KERNEL_DTYPES, WINDOW_KERNELS, channels_last, empty_like_layout, window_kernels
from ember.runtime import precompile

MAX_WINDOW = 127  # positions are int8
BLOCK = 1024


def supported(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
              dilation: tuple[int, int], ceil_mode: bool) -> bool:
    """Whether these kernels take this pooling (anything else stays ATen's)."""
    return (x.dim() == 4 and x.dtype in KERNEL_DTYPES and dilation == (1, 1) and not ceil_mode
            and kernel[0] * kernel[1] <= MAX_WINDOW and min(kernel) >= 1 and min(stride) >= 1
            and all(0 <= p <= k // 2 for p, k in zip(padding, kernel))
            and x.shape[2] + 2 * padding[0] >= kernel[0] and x.shape[3] + 2 * padding[1] >= kernel[1]
            and 0 < x.numel() < 2**31)  # int32 element indices


def output_shape(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int]) -> tuple[int, ...]:
    """(N, C, OH, OW) of the pooled ``x`` (floor mode)."""
    n, c, h, w = x.shape
    return n, c, (h + 2 * padding[0] - kernel[0]) // stride[0] + 1, (w + 2 * padding[1] - kernel[1]) // stride[1] + 1


def _meta(kernel: list[int], stride: list[int], padding: list[int], channels_last: bool) -> dict[str, int]:
    return {"KH": kernel[0], "KW": kernel[1], "SH": stride[0], "SW": stride[1], "PH": padding[0], "PW": padding[1],
            "CHANNELS_LAST": channels_last, "BLOCK": BLOCK}


@torch.library.custom_op("ember::max_pool2d", mutates_args=())
def max_pool2d(x: torch.Tensor, kernel: list[int], stride: list[int],
               padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(maxima, int8 window positions) of 2-D max pooling, both in ``x``'s memory format."""
    n, c, oh, ow = shape = output_shape(x, kernel, stride, padding)
    h, w = x.shape[2], x.shape[3]
    out = empty_like_layout(shape, x, x.dtype)
    pos = empty_like_layout(shape, x, torch.int8)
    total = out.numel()
    if total:
        fn = window_kernels(x.device.type != "cuda").max_pool2d_forward
        fn[(triton.cdiv(total, BLOCK),)](x, out, pos, total, c, h, w, oh, ow, *x.stride(), *out.stride(),
                                         **_meta(kernel, stride, padding, channels_last(x)))
    return out, pos


@max_pool2d.register_fake
def _(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = output_shape(x, kernel, stride, padding)
    return empty_like_layout(shape, x, x.dtype), empty_like_layout(shape, x, torch.int8)


@torch.library.custom_op("ember::max_pool2d_backward", mutates_args=())
def max_pool2d_backward(grad: torch.Tensor, positions: torch.Tensor, input_size: list[int], kernel: list[int],
                        stride: list[int], padding: list[int]) -> torch.Tensor:
    """The input gradient of ``max_pool2d``: each output's gradient to its window's maximum."""
    n, c, h, w = input_size
    oh, ow = grad.shape[2], grad.shape[3]
    grad = grad if grad.stride() == positions.stride() else grad.contiguous(memory_format=suggest_memory_format(positions))
    dx = empty_like_layout(tuple(input_size), positions, grad.dtype)
    total = dx.numel()
    if total:
        interpret = grad.device.type != "cuda"
        fn = window_kernels(interpret).max_pool2d_backward
        fn[(triton.cdiv(total, BLOCK),)](grad, positions, dx, total, c, h, w, oh, ow, *grad.stride(), *dx.stride(),
                                         **_meta(kernel, stride, padding, channels_last(dx)),
                                         ROUND_BF16=interpret and dx.dtype == torch.bfloat16)
    return dx


@max_pool2d_backward.register_fake
def _(grad: torch.Tensor, positions: torch.Tensor, input_size: list[int], kernel: list[int],
      stride: list[int], padding: list[int]) -> torch.Tensor:
    return empty_like_layout(tuple(input_size), positions, grad.dtype)


def compile_jobs(gm: torch.fx.GraphModule) -> list[precompile.CompileJob]:
    """The pooling kernels a graph launches, as compile jobs for the workers: one per dtype, window,
    memory format and shape, read from the graph after Ember's passes (the layout pass decides the
    format). The kernels specialise on their integer arguments (sizes and strides), so each job
    carries the values the launch will pass (precompile.int_arg)."""
    jobs = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.ember.max_pool2d.default):
        x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        outs = node.meta.get("val")
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or not isinstance(outs, (tuple, list)):
            continue
        out = outs[0]
        kernel, stride, padding = node.args[1:4]
        n, c, oh, ow = out.shape
        ints = [out.numel(), c, x.shape[2], x.shape[3], oh, ow, *x.stride(), *out.stride()]
        jobs.append(precompile.job_for(WINDOW_KERNELS, "max_pool2d_forward",
                                       [x.dtype, x.dtype, torch.int8, *map(precompile.int_arg, ints)],
                                       _meta(kernel, stride, padding, channels_last(x))))
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.ember.max_pool2d_backward.default):
        dx = node.meta.get("val")
        grad, positions = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
        if not all(isinstance(t, torch.Tensor) for t in (dx, grad, positions)) or dx.device.type != "cuda":
            continue
        kernel, stride, padding = node.args[3:6]
        # The op lays the gradient out like the positions when its strides differ.
        g_strides = grad.stride() if grad.stride() == positions.stride() else positions.stride()
        ints = [dx.numel(), dx.shape[1], dx.shape[2], dx.shape[3], grad.shape[2], grad.shape[3], *g_strides,
                *dx.stride()]
        jobs.append(precompile.job_for(WINDOW_KERNELS, "max_pool2d_backward",
                                       [grad.dtype, torch.int8, dx.dtype, *map(precompile.int_arg, ints)],
                                       {**_meta(kernel, stride, padding, channels_last(dx)), "ROUND_BF16": False}))
    return jobs
