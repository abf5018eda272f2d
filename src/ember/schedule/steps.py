"""The steps of a kernel plan (schedule/plan.py): what each one holds. Apart from the partitioner
so the passes that rewrite a plan's groups (schedule/group_merge.py) need not import it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ember.schedule.dim_map import Dims, walked_dims
from ember.schedule.range_select import RangeSelect
from ember.schedule.rules import OpClass


@dataclass(eq=False)
class Step:
    index: int
    kind: str
    nodes: list[fx.Node]
    reason: str = ""

    @property
    def node(self) -> fx.Node:
        return self.nodes[0]


@dataclass(eq=False)
class FusedGroup(Step):
    shape: tuple[int, ...] = ()
    rdims: tuple[int, ...] = ()
    dims: dict[fx.Node, Dims] = field(default_factory=dict)
    # For each member: dims of each *external* tensor input it reads, keyed by input node.
    input_dims: dict[fx.Node, dict[fx.Node, Dims]] = field(default_factory=dict)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    # Each member's class as the plan decided it (POINTWISE, REDUCTION or VIEW): code generators
    # read it here instead of classifying again.
    classes: dict[fx.Node, OpClass] = field(default_factory=dict)
    # cat / slice_scatter members (schedule/range_select.py). Their trees' nodes are members
    # (in ``nodes`` and ``classes``) without ``dims``: they are computed at shifted coordinates.
    selects: dict[fx.Node, RangeSelect] = field(default_factory=dict)

    @property
    def is_reduction(self) -> bool:
        return bool(self.rdims)

    def covers(self, node: fx.Node) -> set[int]:
        return walked_dims(self.dims[node])


def reduction_levels(group: FusedGroup) -> dict[fx.Node, int]:
    """How many reductions lie on the longest path into each member (itself included): a
    reduction that reads another reduction's result runs one level (one loop nest) later."""
    level: dict[fx.Node, int] = {}
    members = set(group.nodes)
    for n in group.nodes:
        base = max((level[a] for a in n.all_input_nodes if a in members), default=0)
        level[n] = base + 1 if group.classes[n] == OpClass.REDUCTION else base
    return level
