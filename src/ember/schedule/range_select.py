"""Range selects: ``cat`` and ``slice_scatter`` as pointwise ops of a fused group.

Along its dim d, output position ``c`` of ``cat([a0, a1, ...], d)`` is ``a_k`` at ``c - lo_k``
for the one input k whose range ``[lo_k, hi_k)`` holds ``c``; ``slice_scatter(base, src, d,
start, end)`` is ``src`` at ``c - start`` inside ``[start, end)`` and ``base`` at ``c`` outside.
Each piece is a masked load at shifted coordinates, and the pieces are joined by selects, so the
consumers of the cat fuse with it (as Inductor does).

The producers of a piece fuse too: a piece's *tree* is the pointwise ops and structural views
(slice, unsqueeze, squeeze, size-1 reshapes, expand, permute) that compute it and are read by
nothing else. Their nodes are members of the select's group without a place in its iteration
space: the kernel writer evaluates them at the piece's shifted coordinates (codegen/kernel_writer.py),
and a group run through ATen runs them in graph order. A tree's *leaves* (everything else it
reads) must be materialised before the group starts and are never members of the group (a member
is computed at the group's coordinates, not at shifted ones). RoPE's
``cat((-x[..., h:], x[..., :h]), -1)`` becomes one masked load of ``x`` per half and a negation.

Which nodes qualify is ``range_select_supported`` (the rule) and ``piece_tree`` (the planner).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.fx as fx

aten = torch.ops.aten

RANGE_SELECT_OPS = frozenset({aten.cat.default, aten.slice_scatter.default})

# More inputs than this: the cat stays one ATen call (each piece is a select in every element).
MAX_CAT_INPUTS = 8
# Most nodes one piece's tree inlines (bounds the kernel's size).
MAX_TREE_NODES = 32

# Views a tree evaluates by rewriting coordinates (``source_coords``).
TREE_VIEWS = frozenset({
    aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
    aten.expand.default, aten.permute.default, aten.transpose.int,
})

C = TypeVar("C")


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


@dataclass
class Piece:
    lo: int  # the piece covers [lo, hi) of the output's select dim, and reads its root at c - lo
    hi: int
    root: fx.Node


@dataclass
class RangeSelect:
    dim: int  # the output dim the pieces split
    pieces: list[Piece]
    base: fx.Node | None = None  # slice_scatter's input: the value outside every piece
    tree: list[fx.Node] = field(default_factory=list)  # inlined producers, in graph order
    leaves: list[fx.Node] = field(default_factory=list)  # what the pieces read from memory


def _norm_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _slice_start(start: int | None, size: int) -> int:
    start = 0 if start is None else start
    if start < 0:
        start += size
    return min(max(start, 0), size)


def _slice_end(end: int | None, size: int) -> int:
    if end is None:
        return size
    if end < 0:
        end += size
    return min(max(end, 0), size)


def select_of(node: fx.Node) -> RangeSelect:
    """``node``'s pieces (without trees): cat inputs of size 0 along the dim have none."""
    out = _shape(node)
    if node.target == aten.cat.default:
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out))
        pieces, lo = [], 0
        for a in node.args[0]:
            size = _shape(a)[dim]
            if size:
                pieces.append(Piece(lo, lo + size, a))
            lo += size
        return RangeSelect(dim, pieces)
    args = list(node.args) + [None] * (6 - len(node.args))
    base, src = args[0], args[1]
    dim = _norm_dim(args[2] if args[2] is not None else node.kwargs.get("dim", 0), len(out))
    start = _slice_start(args[3] if args[3] is not None else node.kwargs.get("start"), out[dim])
    end = _slice_end(args[4] if args[4] is not None else node.kwargs.get("end"), out[dim])
    pieces = [Piece(start, end, src)] if end > start else []
    return RangeSelect(dim, pieces, base)


def range_select_supported(node: fx.Node, tensor_ok: Callable[[object], bool]) -> str:
    """Empty if ``node`` (an op of RANGE_SELECT_OPS) can be a fused range select; else why not."""
    val = node.meta.get("val")
    if not tensor_ok(val):
        return f"{node.target.__name__} over an unsupported dtype/layout"
    if val.dim() == 0 or val.numel() == 0:
        return f"{node.target.__name__} with an empty or 0-d result"
    if node.target == aten.cat.default:
        inputs = node.args[0]
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(a, fx.Node) for a in inputs):
            return "cat of a non-tensor list"
        if len(inputs) > MAX_CAT_INPUTS:
            return f"cat of more than {MAX_CAT_INPUTS} tensors (one select per input in every element)"
        for a in inputs:
            if not tensor_ok(a.meta.get("val")):
                return "cat over an unsupported dtype/layout"
            if a.meta["val"].dim() != val.dim():
                return "cat of a legacy empty 1-D tensor"
        return ""
    args = list(node.args) + [None] * (6 - len(node.args))
    step = args[5] if args[5] is not None else node.kwargs.get("step", 1)
    if step != 1:
        return "slice_scatter with a step other than 1"
    if not all(isinstance(a, fx.Node) and tensor_ok(a.meta.get("val")) for a in args[:2]):
        return "slice_scatter over an unsupported dtype/layout"
    sel = select_of(node)
    if sel.pieces and _shape(args[1])[sel.dim] != sel.pieces[0].hi - sel.pieces[0].lo:
        return "slice_scatter whose source does not fill its slice"
    return ""


# -- coordinates through a tree ---------------------------------------------------------------------

def _big_dims(shape: tuple[int, ...]) -> list[int]:
    return [j for j, size in enumerate(shape) if size != 1]


def tree_view_supported(node: fx.Node) -> bool:
    """A view ``source_coords`` can follow (a reshape only when it inserts or drops size-1 dims)."""
    if node.target not in TREE_VIEWS or not isinstance(node.args[0], fx.Node):
        return False
    if node.target == aten.slice.Tensor:
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        return isinstance(step, int) and step >= 1
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
                       aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        src, out = _shape(node.args[0]), _shape(node)
        return [src[j] for j in _big_dims(src)] == [out[j] for j in _big_dims(out)]
    return True


def source_coords(node: fx.Node, arg: fx.Node, coords: list[C], zero: C,
                  affine: Callable[[C, int, int], C]) -> list[C]:
    """The coordinates (one per dim of ``arg``) at which ``node``'s value at ``coords`` reads
    ``arg``: broadcasting for pointwise ops, the view's index map for views. ``zero`` is the
    coordinate of a size-1 dim; ``affine(c, start, step)`` the coordinate ``start + step * c``."""
    shape, src = _shape(node), _shape(arg)
    target = node.target
    if target == aten.slice.Tensor:
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(src))
        start = _slice_start(node.args[2] if len(node.args) > 2 else node.kwargs.get("start"), src[dim])
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        out = list(coords)
        out[dim] = affine(coords[dim], start, step)
        return [zero if size == 1 else c for size, c in zip(src, out)]
    if target == aten.permute.default:
        out = [zero] * len(src)
        for j, p in enumerate(node.args[1]):
            out[p % len(src)] = coords[j]
        return out
    if target == aten.transpose.int:
        out = list(coords)
        a, b = node.args[1] % len(src), node.args[2] % len(src)
        out[a], out[b] = out[b], out[a]
        return out
    if target in TREE_VIEWS and target not in (aten.expand.default,):
        out = [zero] * len(src)
        for j_src, j_out in zip(_big_dims(src), _big_dims(shape)):
            out[j_src] = coords[j_out]
        return out
    # A pointwise operand or an expand: trailing dims align, size-1 dims broadcast.
    off = len(shape) - len(src)
    return [zero if size == 1 else coords[k + off] for k, size in enumerate(src)]


def piece_tree(sel: RangeSelect, node: fx.Node, inlinable: Callable[[fx.Node], bool]) -> None:
    """Fill ``sel.tree`` and ``sel.leaves``: the producers of ``node``'s pieces that only the
    pieces read (``inlinable`` says which nodes may be inlined at all), and what they read."""
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    tree: set[fx.Node] = set()
    heap = [(-position[p.root], p.root) for p in sel.pieces]
    heapq.heapify(heap)
    seen: set[fx.Node] = set()
    while heap:  # latest first: every user of a candidate is decided before it
        _, cand = heapq.heappop(heap)
        if cand in seen:
            continue
        seen.add(cand)
        if (len(tree) < MAX_TREE_NODES and cand is not sel.base and inlinable(cand)
                and all(u is node or u in tree for u in cand.users)):
            tree.add(cand)
            for a in cand.all_input_nodes:
                heapq.heappush(heap, (-position[a], a))
    sel.tree = sorted(tree, key=position.__getitem__)
    leaves: dict[fx.Node, None] = {}
    for p in sel.pieces:
        if p.root not in tree:
            leaves[p.root] = None
    for t in sel.tree:
        for a in t.all_input_nodes:
            if a not in tree:
                leaves[a] = None
    sel.leaves = list(leaves)


def leaf_dims(sel: RangeSelect, node: fx.Node, out_dims: tuple) -> dict[fx.Node, tuple]:
    """For each leaf, the group dim each of its dims walks (the first path that reaches it):
    the memory-order and input bookkeeping of the group (the loads compute their own offsets)."""
    tree = set(sel.tree)
    found: dict[fx.Node, tuple] = {}
    visited: set[tuple] = set()

    def walk(n: fx.Node, labels: list) -> None:
        if (n, tuple(labels)) in visited:
            return
        visited.add((n, tuple(labels)))
        if n not in tree:
            found.setdefault(n, tuple(None if size == 1 else lab for size, lab in zip(_shape(n), labels)))
            return
        for a in n.all_input_nodes:
            walk(a, source_coords(n, a, labels, None, lambda c, start, step: c))

    for p in sel.pieces:
        walk(p.root, list(out_dims) if len(_shape(p.root)) == len(out_dims) else [None] * len(_shape(p.root)))
    return {leaf: found[leaf] for leaf in sel.leaves if leaf in found}
