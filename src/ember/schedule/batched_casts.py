"""Casts of graph inputs in one launch: a plan pass over the finished kernel plan.

Under autocast every weight a matmul or convolution reads is cast to bf16 where it is used, and
the backward casts parameters again. Each cast is a group of one op over its own shape: one small
kernel launch apiece, 103 of them in swin_t's forward, 148 in BERT's. Their inputs are graph inputs,
so all of them may run at the first one's place; ``torch._foreach_copy_`` into fresh buffers of the
cast dtype does them in a few multi-tensor kernels. On the H100 (one CUDA graph, the weights of
each model cast fp32 -> bf16): swin_t 201.6 -> 85.6 us, BERT 485.8 -> 250.3, resnet50 151.4 -> 66.8.

A batch holds casts with the same source and result dtypes and device. Moving a cast earlier
keeps its result alive from there: a batch closes once its results hold ``max_bytes`` (so at
most that much memory is allocated earlier than before), and the next cast starts a new batch;
a cast whose result is larger than ``MAX_EARLY_CAST_BYTES`` stays where it is.

The backward's casts of weight gradients (bf16 matmul results to float32) read no graph input,
but their results are only returned: they run last, in one batch. That holds each bf16 input
until the end instead of the float32 result from its cast on (the program returns it): fewer
bytes held in between, never more.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.graph_utils import is_dense
from ember.schedule.group_merge import node_bytes
from ember.schedule.plan import KernelPlan
from ember.schedule.steps import FusedGroup, Step

aten = torch.ops.aten

MAX_BATCH_BYTES = 64 << 20  # results of one batch: memory allocated earlier than the casts were
# A cast moved earlier holds its result longer. Weights are small; a large cast of a graph input
# (an activation a backward saved) gains little from a batch and would hold its result longest.
MAX_EARLY_CAST_BYTES = 16 << 20
_PLAIN_KWARGS = {"dtype", "layout", "device", "memory_format", "pin_memory", "non_blocking"}


def plain_cast(step: Step) -> fx.Node | None:
    """The cast if ``step`` is a group of one ``_to_copy`` that changes only the dtype (same
    device, same strides, a dense input): what a foreach copy does exactly."""
    if not isinstance(step, FusedGroup) or step.rdims or step.selects or len(step.nodes) != 1:
        return None
    node = step.nodes[0]
    if node.target != aten._to_copy.default or len(node.args) != 1 or set(node.kwargs) - _PLAIN_KWARGS:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    a, b = src.meta.get("val"), node.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype == b.dtype:
        return None
    if node.kwargs.get("layout", torch.strided) != torch.strided or node.kwargs.get("pin_memory"):
        return None
    if not all(type(d) is int for d in (*a.shape, *a.stride(), *b.shape, *b.stride())):
        return None  # symbolic sizes: no byte count to batch by
    if a.device != b.device or a.shape != b.shape or a.stride() != b.stride() or a.numel() == 0:
        return None
    if not is_dense(a) or b.storage_offset() != 0:
        return None
    return node


def _returned_only(node: fx.Node) -> bool:
    return bool(node.users) and all(u.op == "output" for u in node.users)


def batch_input_casts(plan: KernelPlan, max_bytes: int = MAX_BATCH_BYTES) -> int:
    """Replace groups of one cast by ``foreach`` steps of several: casts of graph inputs at the
    first one's place, casts whose results are only returned at the end. Returns how many casts
    moved into batches. The plan's steps are renumbered."""
    early: list[list[tuple[Step, fx.Node]]] = []
    late: dict[tuple, list[tuple[Step, fx.Node]]] = {}
    open_batch: dict[tuple, tuple[list[tuple[Step, fx.Node]], list[int]]] = {}
    for step in plan.steps:
        node = plain_cast(step)
        if node is None:
            continue
        src = node.args[0]
        a, b = src.meta["val"], node.meta["val"]  # type: ignore[union-attr]
        key = (a.dtype, b.dtype, a.device)
        if src.op != "placeholder":  # type: ignore[union-attr]
            if _returned_only(node):
                late.setdefault(key, []).append((step, node))
            continue
        size = node_bytes(node)
        if size > MAX_EARLY_CAST_BYTES:
            continue
        current = open_batch.get(key)
        if current is None or current[1][0] + size > max_bytes:
            current = ([], [0])
            open_batch[key] = current
            early.append(current[0])
        current[0].append((step, node))
        current[1][0] += size
    replace: dict[Step, Step] = {}
    drop: set[Step] = set()
    tail: list[Step] = []
    for batch in early + list(late.values()):
        if len(batch) < 2:
            continue
        nodes = [n for _, n in batch]
        dtype = nodes[0].meta["val"].dtype
        first = batch[0][0]
        if nodes[0].args[0].op == "placeholder":  # type: ignore[union-attr]
            merged = Step(first.index, "foreach", nodes,
                          reason=f"{len(nodes)} casts of graph inputs to {dtype} in one foreach copy")
            replace[first] = merged
        else:
            merged = Step(first.index, "foreach", nodes,
                          reason=f"{len(nodes)} casts to {dtype} of values only returned, last, in one foreach copy")
            tail.append(merged)
            drop.add(first)
        drop.update(s for s, _ in batch[1:])
        for n in nodes:
            plan.step_of[n] = merged
    if not drop and not replace:
        return 0
    plan.steps = [replace.get(s, s) for s in plan.steps if s not in drop] + tail
    for i, step in enumerate(plan.steps):
        step.index = i
    return sum(len(s.nodes) for s in (*replace.values(), *tail))
