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

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch._prims_common import suggest_memory_format

from ember.runtime.kernels import jit_mode

MAX_WINDOW = 127  # positions are int8
BLOCK = 1024
_JIT: dict[tuple[str, bool], Callable] = {}


def supported(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
              dilation: tuple[int, int], ceil_mode: bool) -> bool:
    """Whether these kernels take this pooling (anything else stays ATen's)."""
    return (x.dim() == 4 and x.is_floating_point() and dilation == (1, 1) and not ceil_mode
            and kernel[0] * kernel[1] <= MAX_WINDOW and min(kernel) >= 1 and min(stride) >= 1
            and all(0 <= p <= k // 2 for p, k in zip(padding, kernel))
            and x.shape[2] + 2 * padding[0] >= kernel[0] and x.shape[3] + 2 * padding[1] >= kernel[1]
            and 0 < x.numel() < 2**31)  # int32 element indices


def output_shape(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int]) -> tuple[int, ...]:
    """(N, C, OH, OW) of the pooled ``x`` (floor mode)."""
    n, c, h, w = x.shape
    return n, c, (h + 2 * padding[0] - kernel[0]) // stride[0] + 1, (w + 2 * padding[1] - kernel[1]) // stride[1] + 1


def _max_pool2d_forward(x_ptr, out_ptr, pos_ptr, total, C, H, W, OH, OW,
                        sxn, sxc, sxh, sxw, son, soc, soh, sow,
                        KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                        PH: tl.constexpr, PW: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    if CHANNELS_LAST:  # neighbouring lanes: neighbouring channels
        c = idx % C
        t = idx // C
        ow = t % OW
        t = t // OW
        oh = t % OH
        n = t // OH
    else:
        ow = idx % OW
        t = idx // OW
        oh = t % OH
        t = t // OH
        c = t % C
        n = t // C
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    # A window of only -inf points at its first real element, as ATen's does.
    pos = (tl.maximum(h0, 0) - h0) * KW + (tl.maximum(w0, 0) - w0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    base = n.to(tl.int64) * sxn + c.to(tl.int64) * sxc
    for i in tl.static_range(KH):
        h = h0 + i
        for j in tl.static_range(KW):
            w = w0 + j
            ok = mask & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            v = tl.load(x_ptr + base + h * sxh + w * sxw, mask=ok, other=float("-inf")).to(tl.float32)
            take = ok & ((v > best) | (v != v))
            best = tl.where(take, v, best)
            pos = tl.where(take, i * KW + j, pos)
    out = n.to(tl.int64) * son + c.to(tl.int64) * soc + oh * soh + ow * sow
    tl.store(out_ptr + out, best.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(pos_ptr + out, pos.to(tl.int8), mask=mask)


def _max_pool2d_backward(g_ptr, pos_ptr, dx_ptr, total, C, H, W, OH, OW,
                         sgn, sgc, sgh, sgw, sdn, sdc, sdh, sdw,
                         KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                         PH: tl.constexpr, PW: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    if CHANNELS_LAST:
        c = idx % C
        t = idx // C
        w = t % W
        t = t // W
        h = t % H
        n = t // H
    else:
        w = idx % W
        t = idx // W
        h = t % H
        t = t // H
        c = t % C
        n = t // C
    acc = tl.full([BLOCK], 0.0, tl.float32)
    base = n.to(tl.int64) * sgn + c.to(tl.int64) * sgc
    # The windows holding (h, w): oh from (h + PH) // SH down while the window still reaches h.
    oh_last = (h + PH) // SH
    ow_last = (w + PW) // SW
    for a in tl.static_range((KH + SH - 1) // SH):
        oh = oh_last - a
        i = h - (oh * SH - PH)
        okh = (oh >= 0) & (oh < OH) & (i < KH)
        for b in tl.static_range((KW + SW - 1) // SW):
            ow = ow_last - b
            j = w - (ow * SW - PW)
            ok = mask & okh & (ow >= 0) & (ow < OW) & (j < KW)
            at = base + oh * sgh + ow * sgw
            p = tl.load(pos_ptr + at, mask=ok, other=-1).to(tl.int32)
            hit = ok & (p == i * KW + j)
            acc += tl.load(g_ptr + at, mask=hit, other=0.0).to(tl.float32)
    if ROUND_BF16:  # the interpreter truncates float32 to bfloat16; round to nearest even as GPUs do
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        acc = tl.where(acc != acc, acc, (bits & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(dx_ptr + n.to(tl.int64) * sdn + c.to(tl.int64) * sdc + h * sdh + w * sdw,
             acc.to(dx_ptr.dtype.element_ty), mask=mask)


def _kernel(fn: Callable, interpret: bool) -> Callable:
    """``fn`` jitted, compiled for the GPU or run by Triton's interpreter (CPU tensors)."""
    key = (fn.__name__, interpret)
    if key not in _JIT:
        with jit_mode(interpret):
            _JIT[key] = triton.jit(fn)
    return _JIT[key]


def _empty_like_layout(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device, memory_format=suggest_memory_format(like))


def _meta(kernel: list[int], stride: list[int], padding: list[int], channels_last: bool) -> dict[str, int]:
    return {"KH": kernel[0], "KW": kernel[1], "SH": stride[0], "SW": stride[1], "PH": padding[0], "PW": padding[1],
            "CHANNELS_LAST": channels_last, "BLOCK": BLOCK}


def _channels_last(t: torch.Tensor) -> bool:
    return suggest_memory_format(t) == torch.channels_last


@torch.library.custom_op("ember::max_pool2d", mutates_args=())
def max_pool2d(x: torch.Tensor, kernel: list[int], stride: list[int],
               padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(maxima, int8 window positions) of 2-D max pooling, both in ``x``'s memory format."""
    n, c, oh, ow = shape = output_shape(x, kernel, stride, padding)
    h, w = x.shape[2], x.shape[3]
    out = _empty_like_layout(shape, x, x.dtype)
    pos = _empty_like_layout(shape, x, torch.int8)
    total = out.numel()
    if total:
        fn = _kernel(_max_pool2d_forward, interpret=x.device.type != "cuda")
        fn[(triton.cdiv(total, BLOCK),)](x, out, pos, total, c, h, w, oh, ow, *x.stride(), *out.stride(),
                                         **_meta(kernel, stride, padding, _channels_last(x)))
    return out, pos


@max_pool2d.register_fake
def _(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = output_shape(x, kernel, stride, padding)
    return _empty_like_layout(shape, x, x.dtype), _empty_like_layout(shape, x, torch.int8)


@torch.library.custom_op("ember::max_pool2d_backward", mutates_args=())
def max_pool2d_backward(grad: torch.Tensor, positions: torch.Tensor, input_size: list[int], kernel: list[int],
                        stride: list[int], padding: list[int]) -> torch.Tensor:
    """The input gradient of ``max_pool2d``: each output's gradient to its window's maximum."""
    n, c, h, w = input_size
    oh, ow = grad.shape[2], grad.shape[3]
    grad = grad if grad.stride() == positions.stride() else grad.contiguous(memory_format=suggest_memory_format(positions))
    dx = _empty_like_layout(tuple(input_size), positions, grad.dtype)
    total = dx.numel()
    if total:
        interpret = grad.device.type != "cuda"
        fn = _kernel(_max_pool2d_backward, interpret)
        fn[(triton.cdiv(total, BLOCK),)](grad, positions, dx, total, c, h, w, oh, ow, *grad.stride(), *dx.stride(),
                                         **_meta(kernel, stride, padding, _channels_last(dx)),
                                         ROUND_BF16=interpret and dx.dtype == torch.bfloat16)
    return dx


@max_pool2d_backward.register_fake
def _(grad: torch.Tensor, positions: torch.Tensor, input_size: list[int], kernel: list[int],
      stride: list[int], padding: list[int]) -> torch.Tensor:
    return _empty_like_layout(tuple(input_size), positions, grad.dtype)
