"""Recompute a group's cheap values inside a later group instead of storing them for it.

A LayerNorm backward is one row reduction (over C) for the input gradient plus two column sums
(over the rows) for the weight and bias gradients. The column sums reduce other dims, so they
are groups of their own, and the row group stored what they sum: the float32 copy of the bf16
output gradient and its product with the normalised input, 4 bytes a value each, written once and
read once (swin_t: 26 LayerNorms a step, 77 MB a tensor at batch 64). Inductor computes those
values again inside its column-sum kernels from the bf16 inputs.

Here a value ``v`` of group ``a`` that a later group ``b`` reads over the same iteration space
is computed again in ``b`` when the pointwise ops it is made of read only ``a``'s inputs (tensors
already in memory: no reduction of ``a``, no shifted loads), ``b`` then reads fewer bytes
than it saves (the read of ``v`` plus, when nothing else reads ``v``, ``a``'s store of it), and
the inputs kept alive longer for ``b`` hold fewer bytes than ``v`` no longer stored. The
ops are copied into the graph (fresh nodes, members of ``b``); a value no group reads any more
leaves ``a``, and a group left empty leaves the plan. A small value of ``a``'s inputs alone
(``bernoulli / keep``, a stochastic-depth scale) is copied into a group of any shape that reads
it, at the dims it is read at: no kernel of its own. Runs after group merging and before sibling reductions merge (group_merge.py),
which then puts the weight and bias sums, now reading the same inputs, in one kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from ember.schedule.dim_map import Dims, node_shape
from ember.schedule.group_merge import SIBLING_LOOKBACK, node_bytes, reads_of, sibling_reductions
from ember.schedule.rules import OpClass
from ember.schedule.steps import FusedGroup, Step

# Most ops copied for one value (bounds the work added to the consuming kernel).
MAX_RECOMPUTED_OPS = 16


def _cone(a: FusedGroup, v: fx.Node) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """The members of ``a`` that ``v`` is computed from, in ``a``'s order, and the tensors outside
    ``a`` they read; None if one of them is not a plain pointwise op or view of ``a``'s inputs."""
    members = set(a.nodes)
    cone: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    stack = [v]
    while stack:
        n = stack.pop()
        if n in cone:
            continue
        if n not in a.dims or a.classes.get(n) not in (OpClass.POINTWISE, OpClass.VIEW):
            return None
        cone.add(n)
        if len(cone) > MAX_RECOMPUTED_OPS:
            return None
        leaves.update(a.input_dims[n])
        stack += [x for x in n.all_input_nodes if x in members]
    return [n for n in a.nodes if n in cone], leaves


def _last_reader(x: fx.Node, step_of: dict[fx.Node, Step]) -> float:
    """The index of the last step reading ``x`` (infinite for a graph output or an unplanned user)."""
    last = -1.0
    for u in x.users:
        step = step_of.get(u)
        last = max(last, float("inf") if step is None else step.index)
    return last


def _reads_near(steps: list[Step], b: FusedGroup) -> set[fx.Node]:
    """What ``b`` reads, and, for a reduction, what the reductions near it over the same space
    and dims read: merge_sibling_reductions makes them one kernel, so an input one of them reads
    costs the others nothing (a LayerNorm's bias sum reads the gradient its weight sum needs)."""
    out = reads_of(b)
    for s in steps[max(0, b.index - SIBLING_LOOKBACK):b.index + SIBLING_LOOKBACK + 1]:
        if sibling_reductions(s, b):
            out |= reads_of(s)
    return out


def _copy_into(graph: fx.Graph, a: FusedGroup, b: FusedGroup, v: fx.Node, cone: list[fx.Node],
               read: Dims | None, step_of: dict[fx.Node, Step], classes: dict) -> None:
    """Copy ``cone`` into ``b`` for its reads of ``v``. ``read``: None when both groups walk one
    iteration space (each copy keeps its dims); else the dims ``b`` reads ``v`` at, which every
    copy and what it reads take (a value of ``v``'s shape)."""
    readers = [n for n in b.nodes if v in n.all_input_nodes]
    first = readers[0]
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first):
        for n in cone:
            c = graph.node_copy(n, lambda x: copies.get(x, x))
            copies[n] = c
            b.dims[c] = a.dims[n] if read is None else read
            b.classes[c] = a.classes[n]
            b.input_dims[c] = dict(a.input_dims[n]) if read is None else dict.fromkeys(a.input_dims[n], read)
            step_of[c] = b
            classes[c] = classes[n]
    at = b.nodes.index(first)
    b.nodes[at:at] = [copies[n] for n in cone]
    for n in readers:
        n.replace_input_with(v, copies[v])
        b.input_dims[n].pop(v, None)
    # What nothing reads any more leaves ``a`` (latest first: a value's inputs may free up too).
    for n in reversed(cone):
        if not n.users:
            a.nodes.remove(n)
            del a.dims[n], a.input_dims[n], a.classes[n]
            step_of.pop(n, None)
            classes.pop(n, None)
            graph.erase_node(n)


def recompute_into_consumers(graph: fx.Graph, steps: list[Step], step_of: dict[fx.Node, Step],
                             classes: dict, producer_index: Callable[[fx.Node], int]) -> list[Step]:
    """``steps`` with each value worth recomputing copied into the later groups that read it (see
    the module docstring) and groups left empty removed. ``classes``: the plan's node classes,
    kept in step with the copies."""
    # Two sweeps: a copy made in the first can keep an input alive that a value turned down in the
    # first then reads for free (a LayerNorm's gradient, read again by both sums).
    for b in list(steps) * 2:
        if not isinstance(b, FusedGroup) or b.selects or not b.nodes:
            continue
        for v in sorted(reads_of(b), key=lambda x: (producer_index(x), x.name)):
            a = step_of.get(v)
            if not isinstance(a, FusedGroup) or a is b or a.selects:
                continue
            reads = {ins[v] for ins in b.input_dims.values() if v in ins}
            found = _cone(a, v) if len(reads) == 1 else None
            if found is None:
                continue
            cone, leaves = found
            if tuple(a.shape) == tuple(b.shape):
                if a.rdims == b.rdims:
                    # Over the same dims group merging is the tool; copying a ReLU mask into each
                    # batch-norm backward reading it moved resnet18's CPU peak above eager's.
                    continue
                if reads != {a.dims[v]}:
                    continue  # read at other coordinates than computed (a transposed read)
                read = None
            elif not a.rdims and all(node_shape(x) == node_shape(v) for x in [*cone, *leaves]):
                read = reads.pop()  # a small value of inputs only (a stochastic-depth scale)
            else:
                continue
            already = _reads_near(steps, b)
            added = [x for x in leaves if x not in already]
            others = [u for u in v.users if u not in a.dims and step_of.get(u) is not b]
            if sum(map(node_bytes, added)) > node_bytes(v) * (1 if others else 2):
                continue
            # Memory: what ``b`` newly reads stays alive until ``b``; only where ``v`` stops being
            # stored, and by no more bytes than ``v`` holds (two batch norms reading one masked
            # gradient would each keep the mask's inputs alive and still need it stored).
            # Strictly fewer over a full iteration space: at a tie the program's memory plan may lose
            # a buffer reuse it had (the stored value took a dead buffer's storage; the input kept
            # alive now blocks one). A small value of inputs alone may tie.
            extended = sum(node_bytes(x) for x in added if _last_reader(x, step_of) < b.index)
            room = 0 if others else node_bytes(v)
            if extended and (extended > room if read is not None else extended >= room):
                continue
            _copy_into(graph, a, b, v, cone, read, step_of, classes)
    kept = [s for s in steps if s.nodes]
    for i, s in enumerate(kept):
        s.index = i
    return kept
