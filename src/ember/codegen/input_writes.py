"""Writes into graph inputs that AOTAutograd keeps in the graph, and which of them a generated
kernel can store straight into the input's memory.

With ``input_mutations_in_graph`` (capture/backend.py) AOTAutograd ends a graph that writes into
its inputs (batch norm's running statistics and ``num_batches_tracked``, ``self.count += 1``) with
``aten.copy_(input, new_value)`` nodes. The program runs them like any op (an ATen ``copy_``), so
they happen inside the program and its CUDA graph. Where the new value is an output of a
generated kernel, the kernel writes it into the input itself (``new_value = input`` instead of a
fresh buffer) and the ``copy_`` disappears: one kernel less per written input, the same bytes.

That store is done only when it cannot change what any op reads (otherwise the ``copy_`` stays):

1. The ``copy_`` is ``copy_(placeholder, value)``, the only ``copy_`` into that input, and only the
   graph's output reads its result (the written input);
   ``value`` is an output of a generated kernel that nothing else reads.
2. ``value`` and the input have the same shape, strides, dtype and device, and the input's
   memory is dense and non-overlapping (every element its own address).
3. No op of a later step reads the input, through any view of it: they would see the new value.
4. The kernel that stores ``value`` reads the input only if it is a pointwise kernel over the
   input's own shape that reads the input directly (no view): then every element is read and
   written by the same program at the same index, the read first. Or the kernel is a reduction
   that reads the input directly as a per-kept-point value (a running statistic beside batch
   norm's sums) and nothing that walks the reduced dims, no reduction and no other output depends
   on what it read: a program that reads the element after another stored it (a split
   reduction's chunks) only computes that one value, which the first chunk alone stores.

The runtime learns of a write into an input from its version counter (the CUDA-graph runner
compares versions across the recorded call: runtime/cudagraphs/recording.py). ATen's ``copy_``
bumps it; a kernel's store does not, so where the ``copy_`` would have run the program calls
``_bump(input, value)``, which bumps the input's version. Where the program checked the input's
strides and ``_expect`` handed the kernels a copy with other strides (Dynamo guards the strides of
its inputs, so this is not expected), the kernel stored into that copy and ``_bump`` copies it
into the caller's tensor as the ``copy_`` would have.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ember.graph_utils import is_dense
from ember.schedule.dim_map import walked_dims
from ember.schedule.plan import FusedGroup, KernelPlan
from ember.schedule.rules import OpClass

aten = torch.ops.aten


@dataclass
class InputWrites:
    """The kept ``copy_`` nodes of one program, and those a kernel does as a store."""

    copies: list[fx.Node] = field(default_factory=list)  # every copy_(placeholder, value)
    stored: dict[fx.Node, fx.Node] = field(default_factory=dict)  # kernel output -> input it is stored into
    elided: dict[fx.Node, fx.Node] = field(default_factory=dict)  # copy_ node -> input (done by the store)

    def targets(self) -> set[fx.Node]:
        """Inputs the program writes into."""
        return {c.args[0] for c in self.copies}


def input_copies(graph: fx.Graph) -> list[fx.Node]:
    """``copy_(placeholder, value)`` nodes: AOTAutograd's kept input mutations."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"]


def plan_input_writes(plan: KernelPlan, kernels: dict, enabled: bool = True) -> InputWrites:
    """The program's input writes; with ``enabled``, those a generated kernel stores (rules above)."""
    copies = input_copies(plan.graph)
    out = InputWrites(copies=copies)
    if not enabled:
        return out
    per_input: dict[fx.Node, int] = {}
    for c in copies:
        per_input[c.args[0]] = per_input.get(c.args[0], 0) + 1
    for c in copies:
        p, value = c.args[0], c.args[1]
        if per_input[p] == 1 and _storable(plan, kernels, c, p, value):
            out.stored[value] = p
            out.elided[c] = p
    return out


def _storable(plan: KernelPlan, kernels: dict, copy: fx.Node, p: fx.Node, value: object) -> bool:
    if not isinstance(value, fx.Node) or copy.kwargs.get("non_blocking") or len(copy.args) > 2:
        return False
    if any(u.op != "output" for u in copy.users):  # rule 1 (returned: ``_bump`` returns the input, as copy_)
        return False
    step = plan.step_of.get(value)
    if not isinstance(step, FusedGroup) or step.index not in kernels or value not in step.outputs:
        return False
    if set(value.users) != {copy}:  # rule 1
        return False
    pv, vv = p.meta.get("val"), value.meta.get("val")
    if not isinstance(pv, torch.Tensor) or not isinstance(vv, torch.Tensor):
        return False
    if (pv.shape, pv.stride(), pv.dtype, pv.device) != (vv.shape, vv.stride(), vv.dtype, vv.device) \
            or not is_dense(pv):  # rule 2
        return False
    for reader, direct in _readers(p, copy):
        at = plan.step_of.get(reader)
        if at is None:
            return False  # a read the plan does not place (the output, say): keep the copy_
        if at.index > step.index:
            return False  # rule 3
        if at is step and not (direct and step.classes.get(reader) is OpClass.POINTWISE and (
                (not step.rdims and tuple(step.shape) == tuple(pv.shape))
                or (step.rdims and _only_feeds(step, reader, value)))):
            return False  # rule 4
    return True


def _only_feeds(step: FusedGroup, reader: fx.Node, value: fx.Node) -> bool:
    """Whether everything in ``step`` computed from ``reader`` is a per-kept-point value that ends
    in ``value`` alone (rule 4 for a reduction kernel)."""
    members = set(step.nodes)
    stack, seen = [reader], {reader}
    while stack:
        n = stack.pop()
        if step.classes.get(n) is not OpClass.POINTWISE or walked_dims(step.dims[n]) & set(step.rdims) \
                or (n in step.outputs and n is not value):
            return False
        for u in n.users:
            if u in members and u not in seen:
                seen.add(u)
                stack.append(u)
    return True


def _readers(p: fx.Node, copy: fx.Node) -> list[tuple[fx.Node, bool]]:
    """Every op that reads ``p``'s memory (through views too), with whether it reads ``p`` itself.
    Views are followed, not counted: reading a view is what its users do."""
    out: list[tuple[fx.Node, bool]] = []
    stack, seen = [p], {p, copy}
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                continue  # returning the input returns the written tensor either way
            if _view_of_input(user):
                stack.append(user)
            out.append((user, n is p))
    return out


def _view_of_input(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)
