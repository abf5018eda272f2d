"""Merge a fused group into a later one that reads it, when the steps between allow it.

The partitioner (plan.py) places nodes greedily in graph order, so a group that a library call
or another group separates from its consumer stays a kernel of its own and stores what the
consumer reads. Two batch-norm patterns of every ResNet downsampling block pay for it:

* forward: the main branch's batch norm stores its normalised output, and the shortcut's batch
  norm, after the shortcut convolution, reads it back to add it (Inductor computes both
  normalisations in the one kernel that adds them);
* backward: the first batch-norm backward stores its masked float32 gradient, and the second
  (a convolution backward runs between them) reads it back for its own sums.

Here a pair of fused groups over one iteration space, the later reading the earlier, becomes one
group: at the earlier group's place when every other input of the later is ready by then, or at
the later's place when no step between reads the earlier group. Values only the other group read
are no longer stored; both reductions share one pass over memory. Each merge is recorded in the
group's ``reason`` (``explain`` shows it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx

from ember.schedule.dim_map import walked_dims
from ember.schedule.rules import OpClass
from ember.schedule.steps import FusedGroup, Step, reduction_levels


def reads_of(step: Step) -> set[fx.Node]:
    """What a step reads from outside itself."""
    if isinstance(step, FusedGroup):
        return {a for ins in step.input_dims.values() for a in ins}
    members = set(step.nodes)
    return {a for n in step.nodes for a in n.all_input_nodes if a not in members}


def _writes(step: Step) -> bool:
    """Whether a step writes into memory (a kept ``copy_`` into a graph input, an in-place op): a
    group moved across it would read the other value."""
    for n in step.nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def _mergeable(a: FusedGroup, b: FusedGroup) -> bool:
    if a.selects or b.selects:
        return False
    if tuple(a.shape) != tuple(b.shape):
        return False
    if a.rdims and b.rdims and a.rdims != b.rdims:
        return False
    # Every value of ``a`` that ``b`` reads is read at the coordinates ``a`` computes it at.
    for ins in b.input_dims.values():
        for node, dims in ins.items():
            if node in a.dims and a.dims[node] != dims:
                return False
    return True


def node_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def traffic(group: FusedGroup) -> int:
    """Bytes a group's kernels move, as they are written (codegen/triton_reductions.py): one pass
    per reduction level, reading what that level's reductions are computed from, and a last pass
    reading what the stored full-size values are computed from; plus every stored value. A
    reduction of an earlier pass is loaded, not recomputed, so what it reads is not read again."""
    members = set(group.nodes)
    level = reduction_levels(group)
    reductions = {n for n in group.nodes if group.classes[n] is OpClass.REDUCTION}
    outputs = [n for n in group.nodes if any(u not in members for u in n.users)]
    full = [n for n in outputs if not group.rdims or walked_dims(group.dims[n]) & set(group.rdims)]
    passes = [[r for r in reductions if level[r] == lv] for lv in sorted({level[r] for r in reductions})]
    total = sum(node_bytes(n) for n in outputs)
    for roots in passes + ([full] if full else []):
        needed, stack = set(roots), list(roots)
        while stack:
            n = stack.pop()
            for x in n.all_input_nodes:
                if x in members and x not in needed and x not in reductions:
                    needed.add(x)
                    stack.append(x)
        total += sum(node_bytes(x) for x in {x for n in needed for x in group.input_dims[n] if x not in members})
    return total


def _merged(a: FusedGroup, b: FusedGroup, at: FusedGroup, reason: str) -> FusedGroup:
    """One group holding ``a``'s and ``b``'s members in graph order, in ``at``'s place (one of them)."""
    dims = {**a.dims, **b.dims}
    input_dims = {n: {x: d for x, d in ins.items() if x not in dims}
                  for n, ins in {**a.input_dims, **b.input_dims}.items()}
    return dataclasses.replace(at, nodes=a.nodes + b.nodes, dims=dims, input_dims=input_dims,
                               classes={**a.classes, **b.classes}, rdims=a.rdims or b.rdims,
                               reason=f"{at.reason}; {reason}")


def _replace(steps: list[Step], step_of: dict[fx.Node, Step], a: FusedGroup, b: FusedGroup, keep: FusedGroup,
             reason: str) -> list[Step] | None:
    """``steps`` with ``a`` and ``b`` made one group in ``keep``'s place (``step_of`` updated), or
    None when the merged kernels would move more bytes than the two apart."""
    merged = _merged(a, b, keep, reason)
    if traffic(merged) > traffic(a) + traffic(b):
        return None
    for n in merged.nodes:
        step_of[n] = merged
    drop = b if keep is a else a
    steps = [merged if s is keep else s for s in steps if s is not drop]
    for k, s in enumerate(steps):
        s.index = k
    return steps


def _until_stable(steps: list[Step], merge_one: Callable[[list[Step]], list[Step] | None]) -> list[Step]:
    """Apply ``merge_one`` (the steps with one pair merged, or None) until it finds no pair."""
    while (merged := merge_one(steps)) is not None:
        steps = merged
    return steps


def merge_connected_groups(steps: list[Step], step_of: dict[fx.Node, Step],
                           producer_index: Callable[[fx.Node], int]) -> list[Step]:
    """``steps`` with each mergeable pair of fused groups made one (see the module docstring);
    ``step_of`` is updated. ``producer_index(node)``: the index of the step computing ``node``
    (-1 for graph inputs and inlined constants)."""

    def merge_one(steps: list[Step]) -> list[Step] | None:
        position = {id(s): i for i, s in enumerate(steps)}
        for j, b in enumerate(steps):
            if not isinstance(b, FusedGroup):
                continue
            reads = reads_of(b)
            producers = sorted({step_of[x] for x in reads if isinstance(step_of.get(x), FusedGroup)},
                               key=lambda s: -position[id(s)])
            for a in producers:
                i = position[id(a)]
                if i >= j or not _mergeable(a, b) or any(_writes(s) for s in steps[i + 1:j]):
                    continue
                outside = [x for x in reads if x not in a.dims]
                if all(producer_index(x) < a.index for x in outside):
                    keep, where = a, "the earlier group's place"
                elif not any(set(a.dims) & reads_of(s) for s in steps[i + 1:j]):
                    keep, where = b, "the later group's place"
                else:
                    continue
                merged = _replace(steps, step_of, a, b, keep,
                                  f"merged with the group it {'feeds' if keep is a else 'reads'} ({where})")
                if merged is not None:  # None: recomputing reads more than the store saves
                    return merged
        return None

    return _until_stable(steps, merge_one)


# How many steps back a reduction looks for a sibling reduction to merge with.
SIBLING_LOOKBACK = 8


def _read_dims(group: FusedGroup, node: fx.Node) -> set:
    return {ins[node] for ins in group.input_dims.values() if node in ins}


def sibling_reductions(a: Step, b: FusedGroup) -> bool:
    """Whether ``a`` is a reduction over ``b``'s iteration space and reduced dims (neither with
    shifted loads): the groups merge_sibling_reductions may make one."""
    return (isinstance(a, FusedGroup) and a is not b and bool(a.rdims) and a.rdims == b.rdims
            and not a.selects and not b.selects and tuple(a.shape) == tuple(b.shape))


def merge_sibling_reductions(steps: list[Step], step_of: dict[fx.Node, Step],
                             producer_index: Callable[[fx.Node], int]) -> list[Step]:
    """``steps`` with reductions over the same space and the same reduced dims that read a
    common input at the same coordinates made one group: one pass over what they share (a
    LayerNorm's weight and bias sums once recompute.py has them read the same bf16 gradient).
    Only groups that views alone separate merge: moved past a library call, one group's outputs
    (or the other's inputs) would stay allocated across it (a downsampling block's two batch-norm
    backwards around a convolution backward raised resnet18's peak). The later moves to the
    earlier's place when its inputs are ready by then, else the earlier to the later's place."""

    def merge_one(steps: list[Step]) -> list[Step] | None:
        for j, b in enumerate(steps):
            if not isinstance(b, FusedGroup) or not b.rdims or b.selects:
                continue
            b_reads = reads_of(b)
            for i in range(j - 1, max(-1, j - 1 - SIBLING_LOOKBACK), -1):
                a = steps[i]
                if _writes(a):
                    break
                if not sibling_reductions(a, b):
                    if a.kind not in ("view", "getitem", "constant"):
                        break  # a step that allocates: moving either group past it holds memory longer
                    continue
                assert isinstance(a, FusedGroup)
                shared = [x for x in reads_of(a) & b_reads
                          if len(_read_dims(a, x)) == 1 and _read_dims(a, x) == _read_dims(b, x)]
                if not shared or b_reads & set(a.dims):
                    continue
                if all(producer_index(x) < a.index for x in b_reads):
                    keep = a
                elif not any(set(a.dims) & reads_of(s) for s in steps[i + 1:j]):
                    keep = b
                else:
                    continue
                merged = _replace(steps, step_of, a, b, keep, "merged with a reduction reading the same values")
                if merged is not None:
                    return merged
        return None

    return _until_stable(steps, merge_one)
