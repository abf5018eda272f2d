"""Max pooling with non-overlapping windows as reductions the scheduler fuses (GPU targets).

VGG-style pooling (kernel == stride, no padding, no dilation, the window tiling the plane) is a
``max`` over two extra dims of a view: ``x.view(N, C, H/kh, kh, W/kw, kw).amax((3, 5))``. Its
backward sends each output gradient to the first position of the window holding the maximum,
as ATen's kernel does (ties: the first in row-major window order; NaN counts as the maximum),
computed from the input and recomputed maximum instead of from the saved indices. Both become
generated kernels fused with their neighbours (the ReLU before, the ReLU's backward after),
where ATen's NHWC pooling kernels took 3.2 of 24.5 ms of a vgg16 training step on the H100.

The indices output is still computed (a small arange-based expression) for callers that use
it; in training the backward no longer reads it, so dead-code elimination drops it. Any other
pooling configuration returns ``NotImplemented`` and stays ATen's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

aten = torch.ops.aten


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _tiling_window(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
                   padding: int | Sequence[int], dilation: int | Sequence[int]) -> tuple[int, int] | None:
    """(kh, kw) when the windows tile the plane exactly, else None."""
    if x.dim() != 4:
        return None
    k = _pair(kernel_size)
    s = _pair(stride) if stride else k
    if s != k or _pair(padding) != (0, 0) or _pair(dilation) != (1, 1):
        return None
    if x.shape[2] % k[0] or x.shape[3] % k[1]:
        return None
    return k


class _Frame:
    """The window view of a 4-d tensor: NCHW as (n, c, h/kh, kh, w/kw, kw), or, for a
    channels_last tensor, NHWC as (n, h/kh, kh, w/kw, kw, c), so that results keep the input's
    memory format as ATen's pooling does."""

    def __init__(self, x: torch.Tensor, kh: int, kw: int) -> None:
        self.n, self.c, self.h, self.w = x.shape
        self.kh, self.kw = kh, kw
        self.nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        self.window_dims = [2, 4] if self.nhwc else [3, 5]

    def split(self, t: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
        """A (n, c, h*kh, w*kw)-shaped tensor (kh = kw = 1 for the pooled one) as windows."""
        h, w = t.shape[2] // kh, t.shape[3] // kw
        if self.nhwc:
            return aten.reshape.default(aten.permute.default(t, [0, 2, 3, 1]), [self.n, h, kh, w, kw, self.c])
        return aten.reshape.default(t, [self.n, self.c, h, kh, w, kw])

    def merge(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Windows back to a logical (n, c, h, w) tensor."""
        if self.nhwc:
            return aten.permute.default(aten.reshape.default(t, [self.n, h, w, self.c]), [0, 3, 1, 2])
        return aten.reshape.default(t, [self.n, self.c, h, w])

    def along(self, values: torch.Tensor, window_dim: int) -> torch.Tensor:
        """A 1-d tensor laid along one of the six dims (broadcast over the others)."""
        shape = [1] * 6
        shape[window_dim] = -1
        return aten.view.default(values, shape)

    def first_max(self, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(window maxima keepdim, each window's first argmax position, the positions)."""
        kh, kw = self.kh, self.kw
        # Window positions in int8 where they fit: if the backward's partition saves ``first``,
        # it is a byte per pooled value (ATen saves int64 indices).
        small = torch.int8 if kh * kw < 127 else torch.int32
        top = aten.amax.default(xv, self.window_dims, True)
        hit = aten.logical_or.default(aten.eq.Tensor(xv, top), aten.isnan.default(xv))
        rows = aten.arange.start_step(0, kh * kw, kw, dtype=small, device=xv.device)
        cols = aten.arange.start_step(0, kw, 1, dtype=small, device=xv.device)
        pos = aten.add.Tensor(self.along(rows, self.window_dims[0]), self.along(cols, self.window_dims[1]))
        past = aten.scalar_tensor.default(kh * kw, dtype=small, device=xv.device)  # "no hit" sorts last
        first = aten.amin.default(aten.where.self(hit, pos, past), self.window_dims, True)
        return top, first, pos


def max_pool2d_with_indices(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                            ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    window = _tiling_window(x, kernel_size, stride, padding, dilation)
    if window is None:
        return NotImplemented
    kh, kw = window
    f = _Frame(x, kh, kw)
    oh, ow = f.h // kh, f.w // kw
    top, first, _ = f.first_max(f.split(x, kh, kw))
    # Flat index into the input plane, as ATen returns it: (row * W + col) of the first maximum.
    row0 = f.along(aten.arange.start_step(0, f.h, kh, dtype=torch.int64, device=x.device), f.window_dims[0] - 1)
    col0 = f.along(aten.arange.start_step(0, f.w, kw, dtype=torch.int64, device=x.device), f.window_dims[1] - 1)
    row = aten.add.Tensor(row0, aten.div.Tensor_mode(first, kw, rounding_mode="floor"))
    col = aten.add.Tensor(col0, aten.remainder.Scalar(first, kw))
    flat = aten.add.Tensor(aten.mul.Tensor(row, f.w), col)
    return f.merge(top, oh, ow), f.merge(flat, oh, ow)


def max_pool2d_with_indices_backward(grad: torch.Tensor, x: torch.Tensor, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: int | Sequence[int],
                                     dilation: int | Sequence[int], ceil_mode: bool,
                                     indices: torch.Tensor) -> torch.Tensor:
    window = _tiling_window(x, kernel_size, stride, padding, dilation)
    if window is None:
        return NotImplemented
    kh, kw = window
    f = _Frame(x, kh, kw)
    _, first, pos = f.first_max(f.split(x, kh, kw))
    g = f.split(grad, 1, 1)
    spread = aten.where.self(aten.eq.Tensor(pos, first), g, aten.zeros_like.default(g))
    return f.merge(spread, f.h, f.w)
