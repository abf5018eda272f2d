"""Partition an ATen graph into a KernelPlan: an ordered list of steps.

Step kinds:
  extern    a library call (mm, conv, attention ...), run through ATen
  fused     pointwise ops and reductions that become ONE generated kernel
  view      a zero-copy ATen view of a materialised tensor
  constant  a fill (full, scalar_tensor ...); inlined into the kernels that use it
  fallback  an ATen op run as is, with the reason it was not lowered
  getitem   picks one result of a multi-output op
  frozen    values computed from parameters only (folded weights ...): one step, run first,
            and in the program only when a parameter changed (passes/freeze.py)

A fused group has a reference shape S and a set of reduced dims D of S. Every member node
records, for each of its own dims, which dim of S it walks, or a run of S dims a reshape merged
(None for size-1 dims; dim_map.py computes these records). Views change that record and nothing
else, so they fuse for free; a reshape that splits a dim of S first refines S (one dim becomes
two, every record follows). Steps are created in graph order and a node only joins a group if
all its other inputs come from *earlier* steps, so the steps stay topologically ordered with no
cycles.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ember.graph_utils import op_name
from ember.schedule.dim_map import (
    Dims,
    SplitDim,
    aligned_dims,
    complete_dims,
    entry_dims,
    map_pointwise,
    map_view,
    node_shape,
    reduction_dims,
    reduction_keepdim,
    refine,
)
from ember.schedule.group_merge import merge_connected_groups, merge_sibling_reductions
from ember.schedule.op_support import POINTWISE_OPS
from ember.schedule.range_select import (
    RANGE_SELECT_OPS,
    RangeSelect,
    leaf_dims,
    piece_tree,
    select_of,
    tree_view_supported,
)
from ember.schedule.recompute import recompute_into_consumers
from ember.schedule.rules import Classification, OpClass, classify
from ember.schedule.steps import FusedGroup, Step

aten = torch.ops.aten


@dataclass
class KernelPlan:
    graph: fx.Graph
    steps: list[Step]
    step_of: dict[fx.Node, Step]
    constants: dict[fx.Node, Step]
    classes: dict[fx.Node, tuple[OpClass, str]]

    def fusion_decisions(self) -> dict[str, int]:
        """Why each fused group starts a new kernel, with counts (step numbers stripped)."""
        out: dict[str, int] = {}
        for g in self.fused():
            key = re.sub(r"step \d+", "step N", g.reason)
            out[key] = out.get(key, 0) + 1
        return out

    def fused(self) -> list[FusedGroup]:
        return [s for s in self.steps if isinstance(s, FusedGroup)]

    def describe(self) -> str:
        """The plan as text: one line per step."""
        lines = []
        for s in self.steps:
            ops = ", ".join(op_name(n) for n in s.nodes)
            if isinstance(s, FusedGroup):
                kind = "fused-reduction" if s.is_reduction else "fused-pointwise"
                lines.append(f"{s.index:4d} {kind:16s} S={list(s.shape)} D={list(s.rdims)} "
                             f"in={len(s.inputs)} out={len(s.outputs)} [{ops}]  (new group: {s.reason})")
            else:
                extra = f"  ({s.reason})" if s.reason else ""
                lines.append(f"{s.index:4d} {s.kind:16s} {ops}{extra}")
        return "\n".join(lines)


# How many steps back horizontal fusion looks for a group reading the same input.
SIBLING_LOOKBACK = 32


def _reads_any(group: FusedGroup, nodes: list[fx.Node]) -> bool:
    wanted = set(nodes)
    return any(a in wanted for ins in group.input_dims.values() for a in ins)


def _passes_over(group: FusedGroup, shape: tuple[int, ...]) -> bool:
    """May a sibling search look past ``group`` for a value of ``shape``? Pointwise groups of
    another size (a weight gradient's float32 copy, placed where AOTAutograd put it) are
    unrelated work: a LayerNorm backward's row reduction and the rest of it stay one kernel
    across them instead of two, the first storing float32 values for the second."""
    return not group.rdims and not group.selects and math.prod(group.shape) != math.prod(shape)


def _is_tensor(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


class _Partitioner:
    def __init__(self, graph: fx.Graph, fuse_range_select: bool = True, refine_views: bool = True,
                 merge_groups: bool = True, recompute: bool = True, fuse_merged_row_sums: bool = False) -> None:
        self.graph = graph
        self.fuse_merged_row_sums = fuse_merged_row_sums
        self.merge_groups = merge_groups
        self.recompute = recompute
        self.fuse_range_select = fuse_range_select
        self.refine_views = refine_views
        self.selects: dict[fx.Node, RangeSelect] = {}  # planned range selects (cat, slice_scatter)
        self.inlined: dict[fx.Node, fx.Node] = {}  # a tree node -> the select that computes it
        self.steps: list[Step] = []
        self.step_of: dict[fx.Node, Step] = {}
        self.constants: dict[fx.Node, Step] = {}
        self.classes: dict[fx.Node, tuple[OpClass, str]] = {}

    def _new_step(self, kind: str, node: fx.Node, reason: str = "") -> Step:
        step = Step(len(self.steps), kind, [node], reason)
        self.steps.append(step)
        self.step_of[node] = step
        return step

    def _producer_index(self, node: fx.Node) -> int:
        if node in self.constants:
            return -1  # inlined
        step = self.step_of.get(node)
        return -1 if step is None else step.index

    def _try_join(self, group: FusedGroup, node: fx.Node, cls: OpClass, x_domain: bool = False) -> str | None:
        """Add ``node`` to ``group``; None when it joined, else why it could not. ``x_domain``: it
        joins a reduction beside it as a per-kept-point value (``_sibling``)."""
        # Every input from outside the group must come from an earlier step (keeps order acyclic).
        for arg in self._reads(node):
            if arg not in group.dims and self._producer_index(arg) >= group.index \
                    and not self._move_before(self.step_of[arg], group):
                return "an input is computed after the group starts (joining would reorder steps)"
        if node in self.selects:
            return self._join_select(group, node)
        in_dims: dict[fx.Node, Dims] = {}
        if cls == OpClass.REDUCTION:
            if group.selects:
                return "the group has a cat or slice_scatter (shifted loads are written for pointwise groups)"
            src = node.args[0]
            if src not in group.dims:
                return "the reduced tensor is not computed in the group"
            src_dims = group.dims[src]
            rdims = reduction_dims(node)
            red = tuple(sorted({s for d in rdims for s in entry_dims(src_dims[d])}))
            if not red:
                return "reduces only dims the group broadcasts"
            if group.rdims and red != group.rdims:
                return "reduces other dims than the group's reduction"
            if not group.rdims and not self.fuse_merged_row_sums \
                    and any(isinstance(src_dims[d], tuple) for d in rdims) \
                    and any(u is not node and u not in group.dims for m in group.nodes for u in m.users):
                # A bias gradient summed over rows a reshape merged, beside the full gradient the
                # matmuls read: fused, the kernel walks the stored value column-wise; on an H100 bert
                # and convnext_t training steps were 9% and 12% slower when it also computed the
                # value twice, and with one pass (store_before_reductions) convnext_t's kernels
                # still took 2% longer and swin_t's no less (fuse_merged_row_sums: off).
                return "reduces dims a reshape merged while the group also stores a full-size value"
            keep = reduction_keepdim(node)
            dims = tuple(None if d in rdims else s for d, s in enumerate(src_dims) if keep or d not in rdims)
            group.rdims = red
        elif cls == OpClass.VIEW:
            dims = map_view(group, node, regroup=self.refine_views)
            while isinstance(dims, SplitDim):
                refine(group, dims)
                dims = map_view(group, node)
        else:
            dims = map_pointwise(group, node, x_domain)
            if dims is not None:
                for arg in node.all_input_nodes:
                    if arg not in group.dims and arg not in self.constants:
                        in_dims[arg] = aligned_dims(len(node_shape(node)), arg, dims)
        if dims is None:
            what = "view" if cls == OpClass.VIEW else "shape"
            return f"{what} does not map onto the group's iteration space"
        group.nodes.append(node)
        group.dims[node] = dims
        group.input_dims[node] = in_dims
        group.classes[node] = cls
        self.step_of[node] = group
        return None

    def _move_before(self, step: Step, group: FusedGroup) -> bool:
        """Move ``step`` to just before ``group`` if it reads graph inputs only, so a node reading
        both can join ``group``; whether it moved. AOTAutograd places a stochastic-depth scale
        (``bernoulli / keep``) right before its one use, after the LayerNorm backward whose
        output it scales: unmoved, that multiply is a full pass of its own."""
        if not isinstance(step, FusedGroup) or step.rdims or step.selects or step.index < group.index:
            return False
        if any(self._producer_index(x) != -1 for ins in step.input_dims.values() for x in ins):
            return False
        self.steps.remove(step)
        self.steps.insert(group.index, step)
        for i, s in enumerate(self.steps):
            s.index = i
        return True

    def _seed(self, node: fx.Node, cls: OpClass) -> FusedGroup | None:
        if node in self.selects:
            group = FusedGroup(len(self.steps), "fused", [], shape=node_shape(node))
            self.steps.append(group)
            self._add_select(group, node, tuple(None if size == 1 else d for d, size in enumerate(node_shape(node))))
            return group
        if cls == OpClass.REDUCTION:
            src = node.args[0]
            shape = node_shape(src)
            rdims = tuple(d for d in reduction_dims(node) if shape[d] != 1)
            if not rdims:
                return None
            src_dims = tuple(None if size == 1 else d for d, size in enumerate(shape))
            keep = reduction_keepdim(node)
            dims = tuple(None if d in rdims or shape[d] == 1 else d for d in range(len(shape))
                         if keep or d not in reduction_dims(node))
            group = FusedGroup(len(self.steps), "fused", [node], shape=shape, rdims=rdims)
            group.dims[node] = dims
            group.input_dims[node] = {src: src_dims}
        else:
            shape = node_shape(node)
            group = FusedGroup(len(self.steps), "fused", [node], shape=shape)
            dims = tuple(None if size == 1 else d for d, size in enumerate(shape))
            group.dims[node] = dims
            group.input_dims[node] = {a: aligned_dims(len(shape), a, dims) for a in node.all_input_nodes
                                      if a not in self.constants}
        group.classes[node] = cls
        self.steps.append(group)
        self.step_of[node] = group
        return group

    def _place_fusible(self, node: fx.Node, cls: OpClass) -> None:
        """Join the latest fused producer group that can take ``node``, else start a group (and
        record why: the fusion decision explain reports)."""
        candidates = sorted({self.step_of[a] for a in self._reads(node)
                             if isinstance(self.step_of.get(a), FusedGroup)}, key=lambda s: -s.index)
        refusals = []
        for g in candidates:
            why = self._try_join(g, node, cls)
            if why is None:
                return
            refusals.append(f"not into step {g.index}: {why}")
        if cls == OpClass.VIEW:
            self._new_step("view", node)
            return
        sibling = self._sibling(node, cls, candidates)
        if sibling is not None:
            x_domain = sibling.is_reduction and tuple(sibling.shape) != node_shape(node)
            why = self._try_join(sibling, node, cls, x_domain)
            if why is None:
                return
            refusals.append(f"not beside step {sibling.index}: {why}")
        seeded = self._seed(node, cls)
        if seeded is None:
            self._new_step("fallback", node, "reduction over size-1 dims only")
            return
        seeded.reason = "; ".join(refusals) or "no fused producer (inputs come from library calls, fallbacks or graph inputs)"

    def run(self) -> KernelPlan:
        # Values derived from parameters alone form one step that runs first (and, in the program,
        # once per parameter version); they only read graph inputs and each other, so moving them
        # ahead keeps the order topological.
        frozen = [n for n in self.graph.nodes if n.op == "call_function" and classify(n).cls == OpClass.FROZEN]
        if frozen:
            step = Step(0, "frozen", frozen, "computed from parameters only: once per parameter version")
            self.steps.append(step)
            for n in frozen:
                self.step_of[n] = step
                self.classes[n] = (OpClass.FROZEN, step.reason)
        self._hoist_input_views()
        self._plan_selects()
        for node in self.graph.nodes:
            if node.op != "call_function" or node in self.step_of or node in self.inlined:
                continue
            c = self._classify(node)
            cls, reason = c.cls, c.reason
            self.classes[node] = (cls, reason)
            if cls == OpClass.CONSTANT:
                self.constants[node] = self._new_step("constant", node)
                continue
            if cls in (OpClass.POINTWISE, OpClass.REDUCTION, OpClass.VIEW):
                self._place_fusible(node, cls)
                continue
            kind = {OpClass.EXTERN: "extern", OpClass.GETITEM: "getitem"}.get(cls, "fallback")
            self._new_step(kind, node, reason)
            self._place_views_of(node)
        if self.merge_groups:
            self.steps = merge_connected_groups(self.steps, self.step_of, self._producer_index)
        if self.recompute:
            self.steps = recompute_into_consumers(self.graph, self.steps, self.step_of, self.classes,
                                                  self._producer_index)
        if self.merge_groups:
            self.steps = merge_sibling_reductions(self.steps, self.step_of, self._producer_index)
        self._finish_groups()
        return KernelPlan(self.graph, self.steps, self.step_of, self.constants, self.classes)

    # -- range selects (schedule/range_select.py) ---------------------------------------------
    def _classify(self, node: fx.Node) -> Classification:
        c = classify(node)
        if node.target in RANGE_SELECT_OPS and c.cls == OpClass.POINTWISE and not self.fuse_range_select:
            return Classification(OpClass.FALLBACK, "cat / slice_scatter fusion is off (the target's generator "
                                                    "has none, or the fuse_cat option)")
        return c

    def _inlinable(self, node: fx.Node) -> bool:
        """May ``node`` be computed inside a select's piece (at shifted coordinates)?"""
        if node.op != "call_function" or node in self.step_of or node in self.inlined or node in self.selects:
            return False
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return False
        cls = classify(node).cls
        if cls == OpClass.POINTWISE:
            # A fusable cat inlines too (a select evaluated at the outer piece's coordinates): a
            # roll over two dims is a cat of cats (capture/decompositions.py).
            return node.target in POINTWISE_OPS or node.target == aten.cat.default
        return cls == OpClass.VIEW and tree_view_supported(node)

    def _plan_selects(self) -> None:
        """Each fusable cat / slice_scatter, with the producer trees its pieces inline. Latest
        first, so an outer cat claims the inner cats its pieces are made of."""
        if not self.fuse_range_select:
            return
        for node in reversed(self.graph.nodes):
            if (node.op != "call_function" or node.target not in RANGE_SELECT_OPS or node in self.step_of
                    or node in self.inlined):
                continue
            if self._classify(node).cls != OpClass.POINTWISE:
                continue
            sel = select_of(node)
            piece_tree(sel, node, self._inlinable)
            self.selects[node] = sel
            for t in sel.tree:
                self.inlined[t] = node

    def _reads(self, node: fx.Node) -> list[fx.Node]:
        """What ``node`` reads from outside itself: a select's leaves and base, else its inputs."""
        sel = self.selects.get(node)
        if sel is None:
            return node.all_input_nodes
        return sel.leaves + ([sel.base] if sel.base is not None else [])

    def _join_select(self, group: FusedGroup, node: fx.Node) -> str | None:
        sel = self.selects[node]
        if group.rdims:
            return "a cat or slice_scatter joins pointwise groups only"
        if any(leaf in group.dims for leaf in sel.leaves):
            return "a piece's input is computed in the group (pieces read shifted coordinates from memory)"
        known: dict[int, int] = {}
        if sel.base is not None and sel.base in group.dims:
            known = {k: s for k, s in enumerate(group.dims[sel.base]) if s is not None}
        dims = complete_dims(group, node_shape(node), known)
        if dims is None:
            return "shape does not map onto the group's iteration space"
        self._add_select(group, node, dims)
        return None

    def _add_select(self, group: FusedGroup, node: fx.Node, dims: Dims) -> None:
        """``node`` and its pieces' trees join ``group`` (the trees first: graph order)."""
        sel = self.selects[node]
        for t in sel.tree:
            group.nodes.append(t)
            group.input_dims[t] = {}
            c = classify(t)
            group.classes[t] = c.cls
            self.classes[t] = (c.cls, c.reason)
            self.step_of[t] = group
        in_dims: dict[fx.Node, Dims] = {}
        if sel.base is not None and sel.base not in group.dims and sel.base not in self.constants:
            in_dims[sel.base] = aligned_dims(len(node_shape(node)), sel.base, dims)
        for leaf, ldims in leaf_dims(sel, node, dims).items():
            if leaf not in self.constants and isinstance(leaf.meta.get("val"), torch.Tensor):
                in_dims.setdefault(leaf, ldims)
        group.nodes.append(node)
        group.dims[node] = dims
        group.input_dims[node] = in_dims
        group.classes[node] = OpClass.POINTWISE
        group.selects[node] = sel
        self.step_of[node] = group

    def _sibling(self, node: fx.Node, cls: OpClass, tried: list[FusedGroup]) -> FusedGroup | None:
        """Horizontal fusion: a pointwise node with no fused producer that would take joins a
        fused group over the same iteration space. The latest group does when only views,
        getitems and constants lie between them (batch norm backward's ``x - mean`` beside the
        ReLU-mask group that reads the same gradient); an earlier group does when it reads one
        of the node's inputs (the caller still checks that every input is ready when the group
        starts), as the partitioner may place a library call between two uses of one tensor.
        One loop instead of two: the same loads and stores, one kernel fewer, and later nodes
        can fuse with both."""
        if cls != OpClass.POINTWISE:
            return None
        shape = node_shape(node)
        adjacent = True
        for step in reversed(self.steps[-SIBLING_LOOKBACK:]):
            if isinstance(step, FusedGroup):
                if step in tried or step.kind != "fused":
                    return None
                if adjacent:
                    if tuple(step.shape) == shape:
                        return step
                    # A smaller value rides along only as a per-kept-point (x domain) value of a
                    # reduction: computed once per kept point, never once per element. Any
                    # placement on kept dims computes it once; the positional one (a [N, H, W, 1]
                    # row factor beside a LayerNorm over C with H = W) lets later nodes combine
                    # it with the group's values.
                    if step.is_reduction and any(n != 1 for n in shape) \
                            and complete_dims(step, shape, {}, step.rdims) is not None:
                        return step
                elif tuple(step.shape) == shape and not step.rdims and _reads_any(step, self._reads(node)):
                    return step
                if not _passes_over(step, shape):
                    adjacent = False
            elif step.kind not in ("view", "getitem", "constant"):
                adjacent = False
        return None

    def _hoist_input_views(self) -> None:
        """Views of graph inputs (batch norm's ``weight.unsqueeze(-1).unsqueeze(-1)``) become
        steps ahead of everything else. AOTAutograd places them right before their first use,
        after the group computing the normalised value, and a group cannot take an input that
        is produced after it starts: the affine + ReLU tail of every batch norm became two extra
        kernels, each a full pass over the activation. A view reads no data, so moving it first
        keeps the order topological and changes no result."""
        ready = {n for n in self.graph.nodes if n.op == "placeholder"}
        for node in self.graph.nodes:
            if node.op != "call_function" or node in self.step_of:
                continue
            if not node.all_input_nodes or not all(a in ready for a in node.all_input_nodes):
                continue
            if self._view_step(node, "view of a graph input, placed first so groups can read it"):
                ready.add(node)

    def _place_views_of(self, node: fx.Node) -> None:
        """Views of a value in memory (a library call's output) become steps right after it, as
        views of graph inputs go first: a group started between the value and a view of it
        could not read the view. var_mean's shift (each row's first element, capture/var_mean.py)
        is such a view; under autocast the widening of the bf16 convolution output comes before
        it in the graph, and its group, unable to take the statistics, stored an fp32 copy."""
        for user in list(node.users):
            if user.op != "call_function" or user in self.step_of:
                continue
            if not all(a.op == "placeholder" or (a in self.step_of and a not in self.constants and
                                                 not isinstance(self.step_of[a], FusedGroup))
                       for a in user.all_input_nodes):
                continue
            if self._view_step(user, "view of a value in memory, placed right after it so groups can read it"):
                self._place_views_of(user)

    def _view_step(self, node: fx.Node, why: str) -> bool:
        """A step of its own for ``node`` if it is a view; whether it was."""
        c = classify(node)
        if c.cls != OpClass.VIEW:
            return False
        self.classes[node] = (c.cls, c.reason)
        self._new_step("view", node, why)
        return True

    def _finish_groups(self) -> None:
        steps: list[Step] = []
        for step in self.steps:
            steps.append(step)
            if isinstance(step, FusedGroup):
                steps += self._trailing_views(step)
        for i, step in enumerate(steps):
            step.index = i
        self.steps = steps
        for step in self.steps:
            if not isinstance(step, FusedGroup):
                continue
            members = set(step.nodes)
            inputs: dict[fx.Node, None] = {}
            for n in step.nodes:
                for a in step.input_dims[n]:
                    inputs[a] = None
            step.inputs = list(inputs)
            step.outputs = [n for n in step.nodes
                            if any(u not in members for u in n.users) and _is_tensor(n)]


    def _trailing_views(self, group: FusedGroup) -> list[Step]:
        """Views at the end of a group that only steps after it read (a permuted, unsqueezed copy
        of a channels_last activation for the 3-D padding op, passes/layout.py) leave the group and
        become ATen views of the value they view, run right after the kernel: the kernel stores that
        value once instead of storing it and a rearranged copy of it."""
        members = set(group.nodes)
        trailing: list[fx.Node] = []
        for node in reversed(group.nodes):
            if node.target not in _ALWAYS_VIEWS or node in trailing:
                continue
            chain, cur = [], node
            while cur in members and cur.target in _ALWAYS_VIEWS and not any(
                    u in members and u not in chain and u not in trailing for u in cur.users):
                chain.append(cur)
                cur = cur.args[0]
            if chain and cur in members and cur.target not in _ALWAYS_VIEWS and _is_tensor(cur):
                trailing += chain
        if not trailing:
            return []
        order = [n for n in group.nodes if n in set(trailing)]
        group.nodes = [n for n in group.nodes if n not in set(trailing)]
        steps = []
        for n in order:
            del group.dims[n]
            group.input_dims.pop(n, None)
            del group.classes[n]
            step = Step(-1, "view", [n], "a view of the kernel's output, read only after it")
            self.step_of[n] = step
            steps.append(step)
        return steps


# Views ATen always performs without copying (reshape may copy): safe to run on a stored value.
_ALWAYS_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.permute.default, aten.expand.default, aten.alias.default, aten.t.default,
    aten.transpose.int,
}


def plan_graph(graph: fx.Graph, fuse_range_select: bool = True, refine_views: bool = True,
               merge_groups: bool = True, recompute: bool = True, fuse_merged_row_sums: bool = False) -> KernelPlan:
    """Partition ``graph`` into steps (see the module docstring). ``fuse_range_select``: cat and
    slice_scatter become pointwise members of fused groups (schedule/range_select.py); off, they
    run through ATen (targets whose generator has no range select, the fuse_cat option).
    ``refine_views``: a reshape that splits or merges dims joins the group (a merge as a run of S
    dims, a split after refining S: dim_map.refine); off, it ends the group (the fuse_reshapes
    option). ``merge_groups``: a fused group merges into a later one over the same iteration space
    that reads it where the steps between allow (schedule/group_merge.py; the merge_groups option).
    ``recompute``: cheap values a later group reads are computed again there instead of stored
    (schedule/recompute.py; the recompute_values option). Copies of the recomputed ops are added
    to ``graph``. ``fuse_merged_row_sums``: a sum over rows a reshape merged joins the group computing
    the summed value even where that group also stores it in full (a generator that stores such
    values in the loop that sums them: Triton's; the fuse_merged_row_sums setting)."""
    return _Partitioner(graph, fuse_range_select, refine_views, merge_groups, recompute,
                        fuse_merged_row_sums).run()
