"""Accumulating index writes as ``index_add`` on GPU targets.

The backward of ``table[index]`` (a relative-position bias, swin_t's 12 per training step) is
``zeros.index_put_([index], grad, accumulate=True)``, and an embedding's backward is
``embedding_dense_backward``. On CUDA, ATen runs both as a sort of the indices followed by
segment sums: about ten kernels each (radix sort passes, a bounds check with an
``_assert_async``, gathers); swin_t spent 0.45 ms of a 21 ms step there on an H100.
``index_add`` along dim 0 is the same sum as one kernel of atomic adds, the way Inductor
writes it. The order of the additions differs, so float results may differ in the last bits,
as they do between Inductor and eager; under ``torch.use_deterministic_algorithms``, and where
many indices may meet on one row (``MAX_INDICES_PER_ROW``), the ops stay whole.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


# Most indices per destination row for which atomic adds are used: every index of BERT's
# token-type embedding is 0 (8,192 adds into one row of 768 floats at batch 64), and adds into one
# address run one after another; a sort groups them instead. swin_t's bias tables: 2,401 indices
# into 169 rows.
MAX_INDICES_PER_ROW = 32


def _one_index(x: torch.Tensor, indices: list) -> torch.Tensor | None:
    """The single 1-D integer index of dim 0, if that is what ``indices`` is."""
    if len(indices) != 1 or indices[0] is None:
        return None
    index = indices[0]
    if index.dtype not in (torch.int64, torch.int32) or index.dim() != 1 or x.dim() < 1:
        return None
    return index if index.shape[0] <= MAX_INDICES_PER_ROW * x.shape[0] else None


def index_put(x: torch.Tensor, indices: list, values: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    index = None if not accumulate or torch.are_deterministic_algorithms_enabled() else _one_index(x, indices)
    if index is None or values.dtype != x.dtype:
        return NotImplemented
    shape = (index.shape[0], *x.shape[1:])
    try:
        source = values.expand(shape)
    except RuntimeError:
        return NotImplemented
    return aten.index_add.default(x, 0, index, source)


def embedding_dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> torch.Tensor:
    if scale_grad_by_freq or torch.are_deterministic_algorithms_enabled() or indices.is_floating_point() \
            or indices.numel() > MAX_INDICES_PER_ROW * num_weights:
        return NotImplemented
    dim = grad.shape[-1]
    flat_index = indices.reshape(-1)
    rows = grad.reshape(-1, dim)
    if padding_idx >= 0:
        # The padding row gets no gradient: its entries add zeros, spread over all rows so that
        # a batch of mostly padding does not queue its adds on one row.
        pad = flat_index == padding_idx
        rows = torch.where(pad.unsqueeze(-1), 0, rows)
        spread = torch.arange(flat_index.shape[0], device=flat_index.device, dtype=flat_index.dtype) % num_weights
        flat_index = torch.where(pad, spread, flat_index)
    out = grad.new_zeros((num_weights, dim))
    return aten.index_add.default(out, 0, flat_index, rows)


def register(table: dict) -> None:
    """GPU targets: both ops through ``index_add``, which stays whole (torch's table turns it back
    into ``index_put``)."""
    for overload in aten.index_add.overloads():
        table.pop(getattr(aten.index_add, overload), None)
    table[aten.index_put.default] = index_put
    table[aten.embedding_dense_backward.default] = embedding_dense_backward
