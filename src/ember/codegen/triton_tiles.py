"""How a fused group's iteration space is walked: dim order, tile shape, reduction split.

Memory order. The kept dims K (``xindex``) and reduced dims D (``rindex``) are decomposed in
the memory order of the group's *reference tensor* (the largest tensor in memory that walks
every dim of S, an input for reductions, an output for pointwise groups; a broadcast view counts
only the elements it stores): its stride-1 dim varies fastest.
On channels_last tensors a pointwise kernel then walks N, H, W, C, so neighbouring lanes load
and store neighbouring addresses, as on NCHW tensors.

Channel-contiguous reductions. When the reference's stride-1 dim is a kept dim (per-channel
statistics over N, H, W of a channels_last activation), a tile is ``[XBLOCK, RBLOCK]`` with
XBLOCK consecutive channels: each row of the tile is one coalesced load.

Split reductions. A looped reduction whose kept extent gives fewer than
``split_target_programs`` (a setting in config.py) programs (64 channels of a batch-norm: 64 or even one program on a
132-SM GPU) is split along D into ``split`` chunks: one kernel per reduction level writes
per-chunk partial results to a float32 workspace, and the last kernel combines them and stores
the outputs (codegen/triton_kernel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ember.schedule.dim_map import dim_strides, walked_dims
from ember.schedule.plan import FusedGroup


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Tiling:
    kept: list[int]  # kept dims of S, outermost first (the last varies fastest in xindex)
    reduced: list[int]  # reduced dims of S, outermost first
    x_contiguous: bool  # the reference tensor's stride-1 dim is a kept dim


def _reference(group: FusedGroup, walked: set[int]) -> tuple[fx.Node, tuple] | None:
    """The largest tensor that walks every dim in ``walked``, with its dims."""
    candidates: list[tuple[fx.Node, tuple]] = []
    outputs = [(n, group.dims[n]) for n in group.outputs]
    inputs: list[tuple[fx.Node, tuple]] = []
    seen: set[fx.Node] = set()
    for member in group.nodes:
        for node, dims in group.input_dims[member].items():
            if node not in seen:
                seen.add(node)
                inputs.append((node, dims))
    ordered = (inputs + outputs) if group.rdims else (outputs + inputs)
    for node, dims in ordered:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and walked <= walked_dims(dims):
            candidates.append((node, dims))
    if not candidates:
        return None
    # The largest by elements in memory, first of equals: a broadcast view (a pooled gradient
    # expanded back over H and W) walks every dim with stride 0 on some, and would order the
    # tile by dims that do not move in memory (on H100 a ResNet-50 batch-norm backward read
    # channels_last activations a channel per program at 156 GB/s).
    return max(candidates, key=lambda c: _stored_elements(c[0].meta["val"]))


def _stored_elements(t: torch.Tensor) -> int:
    """Elements ``t`` reads from memory: its numel without the dims it broadcasts (stride 0)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def order_dims(group: FusedGroup, kept: list[int], reduced: list[int]) -> Tiling:
    """The kept and the reduced dims in the reference tensor's memory order (see the module docstring)."""
    ref = _reference(group, set(kept) | set(reduced))
    if ref is None:
        return Tiling(list(kept), list(reduced), False)
    node, dims = ref
    stride_of = dict(dim_strides(dims, node.meta["val"].stride(), group.shape))
    # Larger stride first; equal strides keep S order. Stable sort of the logical order.
    key = lambda s: -stride_of.get(s, 0)  # noqa: E731
    k_sorted, r_sorted = sorted(kept, key=key), sorted(reduced, key=key)
    inner = min(stride_of, key=lambda s: (stride_of[s], -s)) if stride_of else None
    x_contiguous = bool(reduced) and inner in kept and stride_of.get(inner) == 1
    return Tiling(k_sorted, r_sorted, x_contiguous)


def _tensors(group: FusedGroup) -> list[tuple[fx.Node, tuple]]:
    """Every input and output of the group with its dims, each once."""
    found: dict[fx.Node, tuple] = {n: group.dims[n] for n in group.outputs}
    for member in group.nodes:
        for node, dims in group.input_dims[member].items():
            found.setdefault(node, dims)
    return [(n, d) for n, d in found.items() if isinstance(n.meta.get("val"), torch.Tensor)]


def transposed_dims(group: FusedGroup, min_side: int = 8) -> list[int]:
    """For a pointwise group: the dims to walk along the second axis of a 2-D tile, outermost first
    ([]: none; the kernel walks one index).

    A pointwise kernel walks one index in the memory order of its largest tensor, so a tensor whose
    stride-1 dim is another dim (a permute made contiguous, NCHW <-> channels_last, the q/k/v
    gradients of attention stacked from transposed matmul results) is read or written a strided
    element per lane. Walking that tensor's stride-1 dim, with the dims contiguous with it in that
    tensor (H and W of an NCHW activation: one 3136-long row), along a second tile axis makes both
    accesses coalesced (Triton moves the tile through shared memory between them). Only a tensor
    holding at least a quarter of the group's elements counts, and both sides must be ``min_side``
    long."""
    shape = group.shape
    walked = {d for d in range(len(shape)) if shape[d] != 1}
    ref = _reference(group, walked)
    if ref is None or len(walked) < 2:
        return []
    numel = 1
    for d in walked:
        numel *= shape[d]
    ref_strides = dict(dim_strides(ref[1], ref[0].meta["val"].stride(), shape))
    inner = [d for d in walked if ref_strides.get(d) == 1]
    if len(inner) != 1 or shape[inner[0]] < min_side:
        return []
    best: tuple[int, list[int]] | None = None  # (stored elements, dims)
    for node, dims in _tensors(group):
        stored = _stored_elements(node.meta["val"])
        strides = dict(dim_strides(dims, node.meta["val"].stride(), shape))
        if stored * 4 < numel or strides.get(inner[0], 0) in (0, 1):
            continue
        own = [d for d in walked if strides.get(d) == 1]
        if len(own) != 1:
            continue
        run, extent = own, shape[own[0]]
        while True:  # outward through the dims contiguous with the run in this tensor
            nxt = [d for d in walked - set(run) - {inner[0]} if strides.get(d) == extent]
            if len(nxt) != 1:
                break
            run, extent = [nxt[0], *run], extent * shape[nxt[0]]
        if extent >= min_side and (best is None or stored > best[0]):
            best = (stored, run)
    return [] if best is None else best[1]


@dataclass
class Split:
    split: int  # chunks of D, each reduced by its own program (1: no split)
    chunk: int  # elements of D per chunk, a multiple of RBLOCK
    sblock: int  # partials combined per step when the last kernel reads the workspace


def plan_split(xnumel: int, rnumel: int, xblock: int, rblock: int, target_programs: int) -> Split:
    """How many chunks to cut D into so that ~``target_programs`` programs run."""
    xprog = _cdiv(xnumel, xblock)
    chunks = _cdiv(rnumel, rblock)
    if target_programs <= 0 or xprog >= target_programs or chunks < 2:
        return Split(1, rnumel, 1)
    split = min(chunks, _cdiv(target_programs, xprog))
    chunk = _cdiv(chunks, split) * rblock
    split = _cdiv(rnumel, chunk)
    if split < 2:
        return Split(1, rnumel, 1)
    sblock = min(next_pow2(split), max(1, 4096 // xblock))
    return Split(split, chunk, sblock)
