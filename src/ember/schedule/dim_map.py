"""Dim mapping: which dim of a fused group's reference shape S each dim of a node walks.

The planner (plan.py) records, for every member of a fused group, one entry per dim of the
member: the dim of S it walks, a run of S dims (a tuple, outermost first: the member's coordinate
is the run's coordinates read row-major, as a reshape merges them), or None for a size-1 dim (a
``Dims`` tuple). This module computes those records from the records the group already holds, for
pointwise ops (trailing dims align, size-1 dims broadcast) and for views: permutes, broadcasts and
reshapes, which is why views fuse for free. A reshape that splits a dim of S asks the planner to
refine S first (``SplitDim``): a [B*W, h, n, n] attention score viewed as [B, W, h, n, n] to add a
per-window mask runs in one kernel over S = [B, W, h, n, n]. None where a node does not map onto
S. It also reads which dims a reduction node reduces. It holds no planner state: the group is
anything with a ``shape`` and per-node ``dims`` (``GroupSpace``), so plan.py imports this module
and not the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx

aten = torch.ops.aten

Dims = tuple  # per real dim: the S dim it walks, a run of S dims (a tuple), or None


def entry_dims(entry: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """The S dims one entry of a ``Dims`` walks, outermost first."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def walked_dims(dims: Dims) -> set[int]:
    """Every S dim a value with ``dims`` walks."""
    return {s for e in dims for s in entry_dims(e)}


def dim_strides(dims: Dims, strides: Iterable[int], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(S dim, stride) for every S dim a tensor with ``dims`` and ``strides`` walks; a run's dims
    step by the member dim's stride times the sizes inside them. A dim walked twice (a diagonal)
    appears twice: callers add the strides."""
    out = []
    for e, stride in zip(dims, strides):
        inner = 1
        for s in reversed(entry_dims(e)):
            out.append((s, stride * inner))
            inner *= shape[s]
    return out


def _entry(run: list[int]) -> int | tuple[int, ...]:
    return run[0] if len(run) == 1 else tuple(run)


@dataclass(frozen=True)
class SplitDim:
    """A reshape needs S dim ``dim`` cut into (``outer``, size // ``outer``) before it maps."""

    dim: int
    outer: int


class GroupSpace(Protocol):
    """What the mapping reads of a fused group: its reference shape S, its reduced dims, its
    members' dims and the dims of the inputs each member reads (``refine`` rewrites them all)."""

    shape: tuple[int, ...]
    rdims: tuple[int, ...]
    dims: dict[fx.Node, Dims]
    input_dims: dict[fx.Node, dict[fx.Node, Dims]]


def node_shape(node: fx.Node) -> tuple[int, ...]:
    """A graph value's shape, from its fake-tensor metadata."""
    return tuple(node.meta["val"].shape)


def reduction_dims(node: fx.Node) -> list[int]:
    """The dims (of the input) a reduction node reduces, normalised to non-negative ints."""
    rank = len(node_shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if node.target == aten.sum.default or dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank if rank else 0 for d in dims})


def reduction_keepdim(node: fx.Node) -> bool:
    if node.target == aten.sum.default:
        return False
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))


def _default_dim(group: GroupSpace, rank: int, j: int, size: int, used: set[int],
                 avoid: Iterable[int] = ()) -> int | None:
    s = j + len(group.shape) - rank
    if 0 <= s < len(group.shape) and group.shape[s] == size and s not in used and s not in avoid:
        return s
    return None


def _unique_dim(group: GroupSpace, size: int, used: set[int], avoid: Iterable[int] = ()) -> int | None:
    """The one group dim of this size, for a value that shares no dim with the group yet
    (a per-channel [C] vector beside an [N, C, H, W] reduction): any consistent placement
    computes the same value, and a unique size leaves no choice to get wrong."""
    dims = [s for s, n in enumerate(group.shape) if n == size and s not in avoid]
    return dims[0] if len(dims) == 1 and dims[0] not in used else None


def complete_dims(group: GroupSpace, shape: tuple[int, ...], known: dict[int, int],
                  avoid: Iterable[int] = ()) -> Dims | None:
    """Dims for a value of ``shape`` whose dims ``known`` (dim -> S dim) are already placed: the
    rest align with S's trailing dims (or take S's one dim of their size), never on a dim of
    ``avoid``; None if they cannot."""
    used: set[int] = set()
    for e in known.values():
        run = entry_dims(e)
        if used.intersection(run) or len(set(run)) != len(run):
            return None
        used.update(run)
    out: list[int | None] = []
    for j, size in enumerate(shape):
        if size == 1:
            out.append(None)
        elif j in known:
            out.append(known[j])
        else:
            s = _default_dim(group, len(shape), j, size, used, avoid)
            if s is None and not known:
                s = _unique_dim(group, size, used, avoid)
            if s is None:
                return None
            used.add(s)
            out.append(s)
    return tuple(out)


def aligned_dims(out_rank: int, arg: fx.Node, dims_of_out: Dims) -> Dims:
    """The dims an operand ``arg`` is read at by a value of rank ``out_rank`` with dims
    ``dims_of_out`` (broadcasting: trailing dims align, size-1 dims walk none)."""
    shape = node_shape(arg)
    off = out_rank - len(shape)
    return tuple(None if size == 1 else dims_of_out[k + off] for k, size in enumerate(shape))


def map_pointwise(group: GroupSpace, node: fx.Node, x_domain: bool = False) -> Dims | None:
    """Dims of a pointwise ``node`` from those of its inputs already in ``group``. ``x_domain``:
    the node joins a reduction as a per-kept-point value, so dims no input fixes go on kept dims
    only (batch 128 beside 128 channels, or channels equal to the width: a per-channel vector on
    a reduced dim of its size could never meet the reduction's results, and batch norm's backward
    split into three kernels, the group storing two full-size float32 tensors for the third)."""
    shape = node_shape(node)
    known: dict[int, int] = {}
    for arg in node.all_input_nodes:
        if arg not in group.dims:
            continue
        a_shape = node_shape(arg)
        off = len(shape) - len(a_shape)
        if off < 0:
            return None
        for k, s in enumerate(group.dims[arg]):
            if s is None:
                continue
            if shape[k + off] != a_shape[k]:
                return None
            if known.setdefault(k + off, s) != s:
                return None
    return complete_dims(group, shape, known, group.rdims if x_domain else ())


def map_view(group: GroupSpace, node: fx.Node, regroup: bool = True) -> Dims | SplitDim | None:
    """Dims of a view ``node`` of a member of ``group``: permutes, transposes, expands and
    reshapes; a ``SplitDim`` when a reshape cuts a dim of S (the planner refines S and asks
    again); None for any other view, and, without ``regroup``, for a reshape that splits or
    merges dims (one that only inserts or drops size-1 dims still maps)."""
    src = node.args[0]
    if src not in group.dims or not isinstance(node.meta.get("val"), torch.Tensor):
        return None  # split, unbind, chunk: several views, read through getitems of a stored value
    src_dims = group.dims[src]
    src_shape, shape = node_shape(src), node_shape(node)
    target = node.target
    if target == aten.permute.default:
        perm = [p % len(src_shape) for p in node.args[1]]
        return tuple(src_dims[p] for p in perm)
    if target in (aten.t.default, aten.transpose.int):
        if len(src_shape) < 2:
            return src_dims
        a, b = (0, 1) if target == aten.t.default else (node.args[1] % len(src_shape), node.args[2] % len(src_shape))
        out = list(src_dims)
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    if target == aten.expand.default:
        known = {}
        off = len(shape) - len(src_shape)
        for k, s in enumerate(src_dims):
            if s is not None:
                known[k + off] = s
        return complete_dims(group, shape, known)
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                  aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.alias.default):
        if not regroup and [n for n in src_shape if n != 1] != [n for n in shape if n != 1]:
            return None
        return _reshape_dims(group, src_shape, src_dims, shape)
    return None


def _reshape_dims(group: GroupSpace, src_shape: tuple[int, ...], src_dims: Dims,
                  shape: tuple[int, ...]) -> Dims | SplitDim | None:
    """A reshape reads its source row-major: the source's S dims in order (each entry's run
    expanded), cut into consecutive runs whose sizes are the new dims' sizes."""
    atoms: list[int] = []
    for size, e in zip(src_shape, src_dims):
        if size == 1:
            continue
        run = entry_dims(e)
        if not run:
            return None
        atoms += run
    out: list[int | tuple[int, ...] | None] = [None] * len(shape)
    pos = 0
    for j, size in enumerate(shape):
        if size == 1:
            continue
        run, n = [], 1
        while n < size and pos < len(atoms):
            s = atoms[pos]
            if n * group.shape[s] > size:
                outer = size // n
                if size % n or group.shape[s] % outer:
                    return None
                return SplitDim(s, outer)
            run.append(s)
            n *= group.shape[s]
            pos += 1
        if n != size or not run:
            return None
        out[j] = _entry(run)
    if pos != len(atoms):
        return None
    return tuple(out)


def refine(group: GroupSpace, split: SplitDim) -> None:
    """Cut S dim ``split.dim`` into two (outer, inner): every S dim after it moves up one, and every
    entry that walked it walks the pair as a run. The same points in a finer S: no value changes."""
    s, outer = split.dim, split.outer
    inner = group.shape[s] // outer

    def move(e: int | tuple[int, ...] | None) -> int | tuple[int, ...] | None:
        if e is None:
            return None
        run: list[int] = []
        for d in entry_dims(e):
            run += [s, s + 1] if d == s else [d + 1 if d > s else d]
        return _entry(run)

    def move_dims(dims: Dims) -> Dims:
        return tuple(move(e) for e in dims)

    group.shape = tuple(group.shape[:s]) + (outer, inner) + tuple(group.shape[s + 1:])
    group.rdims = tuple(sorted(d for r in group.rdims for d in entry_dims(move(r))))
    for n in group.dims:
        group.dims[n] = move_dims(group.dims[n])
    for ins in group.input_dims.values():
        for a in ins:
            ins[a] = move_dims(ins[a])
