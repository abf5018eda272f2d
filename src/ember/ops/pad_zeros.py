"""``ember::pad_zeros``: a tensor copied into a larger one whose extra trailing rows/columns are zeros.

The matmul padding pass (passes/pad_matmul.py) pads operands with it. ATen's ``constant_pad_nd``
would do the same, but it writes its whole output twice (a fill, then the copy) and returns a
contiguous tensor whatever the input's layout: a transposed weight would come back row-major, a
transposing copy instead of a plain one, and a different cuBLAS kernel. This op allocates the
output in the input's own dimension order, copies the input once and zeroes only the pad: one
read and one write of the data, two kernels, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch


def stride_order(x: torch.Tensor) -> list[int]:
    """``x``'s dimensions from outermost to innermost in memory, the ``physical_layout`` of
    ``torch.empty_permuted``. Ties: the later dim inner. A broadcast dim (stride 0, an expanded
    batch) goes outermost: its copies are materialised one after the other."""
    return sorted(range(x.dim()), key=lambda d: (x.stride(d) != 0, -x.stride(d), -d))


def _padded_empty(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return torch.empty_permuted(shape, stride_order(x), dtype=x.dtype, device=x.device)


@torch.library.custom_op("ember::pad_zeros", mutates_args=())
def pad_zeros(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``x`` in the leading corner of a zero tensor of ``shape`` (each dim at least ``x``'s), laid out
    in ``x``'s dimension order."""
    if len(shape) != x.dim() or any(s < d for s, d in zip(shape, x.shape)):
        raise ValueError(f"ember::pad_zeros: shape {list(shape)} does not contain {list(x.shape)}")
    out = _padded_empty(x, list(shape))
    body = out
    for d, size in enumerate(x.shape):
        body = body.narrow(d, 0, size)
    body.copy_(x)
    for d, (size, want) in enumerate(zip(x.shape, shape)):
        if want > size:
            out.narrow(d, size, want - size).zero_()
    return out


@pad_zeros.register_fake
def _(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return _padded_empty(x, list(shape))
