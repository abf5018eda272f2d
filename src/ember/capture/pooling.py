"""Max pooling with non-overlapping windows as generated pointwise kernels (GPU targets).

VGG-style pooling (kernel == stride, no padding, no dilation, the window tiling the plane) is the
elementwise maximum of the kh * kw strided views of the input (``x.view(N, C, H/kh, kh, W/kw, kw)``
with one window element selected each), and each window's first maximum position is a chain of
``where`` over the same views: one kernel reads the input once and writes the maxima and the
positions (int8). The backward sends each output gradient to that position, as ATen's kernel
does (ties: the first in row-major window order; NaN counts as the maximum): a pointwise kernel
over the input's shape comparing every element's window position with the saved one. The
partitioner saves the int8 positions (the backward recomputes them from the input, and CSE joins
the two), where ATen's kernels save int64 indices; its NHWC kernels took 3.2 of 24.5 ms of a
vgg16 training step on the H100.

The indices output is still computed (a small arange-based expression) for callers that use
it; in training the backward does not read it, so dead-code elimination drops it. Overlapping
windows (ResNet's 3x3, stride 2, padding 1) go to Ember's own Triton kernels
(ops/max_pool.py); any other pooling configuration returns ``NotImplemented`` and stays
ATen's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember.ops import max_pool

aten = torch.ops.aten


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _pairs(kernel_size: Sequence[int], stride: Sequence[int], padding: int | Sequence[int],
           dilation: int | Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(kernel, stride, padding, dilation) as pairs, as ATen reads them (no stride: the kernel)."""
    k = _pair(kernel_size)
    return k, (_pair(stride) if stride else k), _pair(padding), _pair(dilation)


def _tiling_window(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
                   padding: int | Sequence[int], dilation: int | Sequence[int]) -> tuple[int, int] | None:
    """(kh, kw) when the windows tile the plane exactly, else None."""
    if x.dim() != 4:
        return None
    k, s, p, d = _pairs(kernel_size, stride, padding, dilation)
    if s != k or p != (0, 0) or d != (1, 1):
        return None
    if x.shape[2] % k[0] or x.shape[3] % k[1]:
        return None
    return k


def _window_params(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
                   padding: int | Sequence[int], dilation: int | Sequence[int],
                   ceil_mode: bool) -> tuple[list[int], list[int], list[int]] | None:
    """(kernel, stride, padding) when ops/max_pool.py's kernels take this pooling, else None."""
    k, s, p, d = _pairs(kernel_size, stride, padding, dilation)
    if not max_pool.supported(x, k, s, p, d, ceil_mode):
        return None
    return list(k), list(s), list(p)


def _overlapping(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], padding: int | Sequence[int],
                 dilation: int | Sequence[int], ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping windows (ResNet's 3x3, stride 2, padding 1) through ``ember::max_pool2d``;
    ATen's flat indices rebuilt from its int8 window positions."""
    params = _window_params(x, kernel_size, stride, padding, dilation, ceil_mode)
    if params is None:
        return NotImplemented
    (kh, kw), (sh, sw), (ph, pw) = params
    top, positions = max_pool.max_pool2d(x, *params)
    oh, ow = top.shape[2], top.shape[3]
    rows = aten.view.default(aten.arange.start_step(-ph, oh * sh - ph, sh, dtype=torch.int64, device=x.device),
                             [1, 1, oh, 1])
    cols = aten.view.default(aten.arange.start_step(-pw, ow * sw - pw, sw, dtype=torch.int64, device=x.device),
                             [1, 1, 1, ow])
    row = aten.add.Tensor(rows, aten.div.Tensor_mode(positions, kw, rounding_mode="floor"))
    col = aten.add.Tensor(cols, aten.remainder.Scalar(positions, kw))
    return top, aten.add.Tensor(aten.mul.Tensor(row, x.shape[3]), col)


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

    def position_dtype(self) -> torch.dtype:
        # A byte per pooled value where the positions fit (ATen saves int64 indices).
        return torch.int8 if self.kh * self.kw < 127 else torch.int32

    def positions(self, device: torch.device) -> torch.Tensor:
        """Each window element's row-major position, shaped to broadcast over the window view:
        a view of one arange, so no kernel computes it."""
        shape = [1] * 6
        shape[self.window_dims[0]], shape[self.window_dims[1]] = self.kh, self.kw
        flat = aten.arange.start_step(0, self.kh * self.kw, 1, dtype=self.position_dtype(), device=device)
        return aten.view.default(flat, shape)

    def first_max(self, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(window maxima, each window's first argmax position), both (kh = kw = 1) window views.

        Pointwise over the kh * kw strided views of the window elements, not a reduction: one
        generated kernel reads the input once and writes the maxima and the int8 positions,
        where a reduction needed a second pass over the input for the positions."""
        dh, dw = self.window_dims
        parts = [aten.unsqueeze.default(aten.unsqueeze.default(
            aten.select.int(aten.select.int(xv, dw, j), dh, i), dh), dw)
            for i in range(self.kh) for j in range(self.kw)]
        top = parts[0]
        for p in parts[1:]:
            top = aten.maximum.default(top, p)  # NaN propagates, as in ATen's pooling
        small = self.position_dtype()
        first = aten.scalar_tensor.default(len(parts), dtype=small, device=xv.device)  # no hit: sorts last
        for k in reversed(range(len(parts))):
            hit = aten.logical_or.default(aten.eq.Tensor(parts[k], top), aten.isnan.default(parts[k]))
            first = aten.where.self(hit, aten.scalar_tensor.default(k, dtype=small, device=xv.device), first)
        return top, first


def max_pool2d_with_indices(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                            ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    window = _tiling_window(x, kernel_size, stride, padding, dilation)
    if window is None:
        return _overlapping(x, kernel_size, stride, padding, dilation, ceil_mode)
    kh, kw = window
    f = _Frame(x, kh, kw)
    oh, ow = f.h // kh, f.w // kw
    top, first = f.first_max(f.split(x, kh, kw))
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
        params = _window_params(x, kernel_size, stride, padding, dilation, ceil_mode)
        if params is None:
            return NotImplemented
        _, positions = max_pool.max_pool2d(x, *params)  # the forward's call: CSE joins them
        return max_pool.max_pool2d_backward(grad, positions, list(x.shape), *params)
    kh, kw = window
    f = _Frame(x, kh, kw)
    _, first = f.first_max(f.split(x, kh, kw))
    g = f.split(grad, 1, 1)
    hit = aten.eq.Tensor(f.positions(x.device), first)
    spread = aten.where.self(hit, g, aten.scalar_tensor.default(0, dtype=g.dtype, device=g.device))
    return f.merge(spread, f.h, f.w)
