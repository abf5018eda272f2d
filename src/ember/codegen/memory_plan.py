"""The memory plan of a generated program: when each name is deleted, and which kernel outputs
take over the storage of a buffer that died earlier instead of allocating.

Liveness. The program is a sequence of *slots*: one per op for library calls, fallbacks, views
and ATen-fused groups (eager frees every intermediate as soon as nothing refers to it; holding
a whole fused group's intermediates until its last op raised the peak), one per generated-kernel
launch and one per frozen-value call. A name is deleted (``del``) right after the last slot that
reads it, or right after the slot that makes it if nothing reads it. Values the program returns
are never deleted. Graph inputs are deleted after their last use too: ``run`` owns its argument
list (``args.clear()``), so a saved activation of the backward is freed as soon as it is used up.

Reuse, like a register allocator. A generated kernel's output (an ``_empty`` line of the program)
takes the storage of a dead buffer D (``out = _reuse(D, shape, stride)``) only if all of:

1. D is itself the output of a generated kernel: storage the program allocated. Never a graph
   input, a library call's or fallback's result (those may alias their inputs or each other),
   a frozen value (cached across calls) or a constant.
2. D's storage is free: D and every value that may alias it were last read at an earlier slot,
   and none of them is returned. "May alias" is conservative: views, getitems, any op whose
   schema says its result aliases an input, ``_unsafe_view``, and any callable without a schema.
3. Same device, same dtype and exactly the same storage size in bytes. A larger D would keep
   its extra bytes alive for the new buffer's whole life (and past the program, when the buffer
   is returned as a saved activation), which can raise the peak.
4. No slot between D's last use and the new buffer allocates memory (only views run there).
   Keeping D instead of freeing it then never holds more bytes than freeing D and allocating the
   new buffer would, at any moment: reuse saves allocator work and never raises the peak.
5. At run time ``_reuse`` checks that nothing but D refers to the storage (its use count) and
   allocates a fresh buffer otherwise, so an alias the rules above missed costs one reuse,
   never a wrong result.

A storage that was reused returns to the pool when its new owner dies, so it can be reused again.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ember import compat
from ember.schedule.plan import KernelPlan, Step

SlotKey = tuple[int, "fx.Node | None"]  # (step index, node for per-op slots; None for a whole step)
START: SlotKey = (-1, None)  # after the inputs are unpacked
_ALIASING = {torch.ops.aten._unsafe_view.default}  # shares its input's storage; its schema says not


@dataclass
class _Slot:
    key: SlotKey
    reads: list[fx.Node]
    defines: list[fx.Node]
    kernel: bool = False


@dataclass
class MemoryPlan:
    """What ``program.py`` asks while writing: names to delete after a slot, storage to reuse."""

    dels: dict[SlotKey, list[fx.Node]] = field(default_factory=dict)
    reuse: dict[fx.Node, fx.Node] = field(default_factory=dict)  # kernel output -> dead buffer it takes
    nbytes: dict[fx.Node, int] = field(default_factory=dict)  # storage size of each kernel output

    def deleted_after(self, key: SlotKey) -> list[fx.Node]:
        return self.dels.get(key, [])


def storage_bytes(val: torch.Tensor) -> int:
    """Bytes ``torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)`` allocates."""
    if any(s == 0 for s in val.shape):
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
    return span * val.element_size()


def reuse_storage(dead: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """The program's ``_reuse``: ``dead``'s storage as a new ``shape``/``stride`` buffer, or a fresh
    buffer when anything else still refers to that storage (rule 5 of the module docstring)."""
    storage = dead.untyped_storage()
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    # Two references when nothing else holds it: ``dead`` itself and the ``storage`` object here.
    if compat.storage_use_count(storage._cdata) > 2 or storage.nbytes() < span * dead.element_size():
        return torch.empty_strided(shape, stride, dtype=dead.dtype, device=dead.device)
    # A new tensor on the same storage, not a view: a view would keep ``dead`` alive as its base.
    return torch.empty(0, dtype=dead.dtype, device=dead.device).set_(storage, 0, shape, stride)


def _frozen_outputs(step: Step) -> list[fx.Node]:
    members = set(step.nodes)
    return [n for n in step.nodes if any(u not in members for u in n.users)]


def _slots(plan: KernelPlan, kernels: dict, placeholders: list[fx.Node]) -> list[_Slot]:
    out = [_Slot(START, [], list(placeholders))]
    for step in plan.steps:
        if step.kind == "constant":
            continue  # materialised by the program right before the first op that reads it
        if step.index in kernels:
            out.append(_Slot((step.index, None), list(step.inputs), list(step.outputs), kernel=True))
        elif step.kind == "foreach":
            out.append(_Slot((step.index, None), [n.args[0] for n in step.nodes], list(step.nodes)))
        elif step.kind == "frozen":
            members = set(step.nodes)
            reads = list(dict.fromkeys(a for n in step.nodes for a in n.all_input_nodes if a not in members))
            out.append(_Slot((step.index, None), reads, _frozen_outputs(step)))
        else:
            out += [_Slot((step.index, n), list(n.all_input_nodes), [n]) for n in step.nodes]
    return out


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with one of its inputs."""
    target = node.target
    if target is operator.getitem or target in _ALIASING:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _allocates(slot: _Slot, plan: KernelPlan) -> bool:
    if slot.kernel or slot.key == START:
        return False  # a kernel's fresh outputs are decided (and counted) by the reuse pass
    step = plan.steps[slot.key[0]]
    if step.kind in ("frozen", "foreach"):
        return True  # frozen: recomputed (rarely) when a parameter changes: count it
    # A constant is materialised right before the first op that reads it: count that op.
    if any(a in plan.constants for a in slot.reads):
        return True
    node = slot.key[1]
    return node is not None and not _aliases_input(node)


def plan_memory(plan: KernelPlan, kernels: dict, output: fx.Node,
                in_inputs: frozenset[fx.Node] = frozenset()) -> MemoryPlan:
    """Deletions and storage reuse for the program of ``plan`` (``kernels``: step index -> kernel).
    ``in_inputs``: kernel outputs stored into a graph input's memory (codegen/input_writes.py),
    which neither take a dead buffer's storage nor hand theirs on."""
    graph_nodes = plan.graph.nodes
    placeholders = [n for n in graph_nodes if n.op == "placeholder"]
    slots = _slots(plan, kernels, placeholders)
    returned = set(output.all_input_nodes)
    defined_at: dict[fx.Node, int] = {}
    last_read: dict[fx.Node, int] = {}
    for i, slot in enumerate(slots):
        for n in slot.defines:
            defined_at.setdefault(n, i)
        for a in slot.reads:
            if a.op in ("placeholder", "call_function") and a not in slot.defines:
                last_read[a] = i
    # Constants the program materialises are read by some slot but defined by none.
    bound = set(defined_at) | {a for a in last_read if a in plan.constants}
    death = {n: last_read.get(n, defined_at.get(n, 0)) for n in bound if n not in returned}

    result = MemoryPlan()
    kernel_outputs = [n for s in slots if s.kernel for n in s.defines]
    in_kernel = {n for i in kernels for n in plan.steps[i].nodes}
    free_at = _storage_free_slots([n for n in kernel_outputs if n not in in_inputs], death, returned, in_kernel)
    held_until: dict[fx.Node, int] = {}  # dead buffer -> slot of its reuse (its del moves there)

    pool: dict[tuple, list[tuple[fx.Node, int]]] = {}  # (device, dtype, bytes) -> [(buffer, free slot)]
    freed_at: dict[int, list[fx.Node]] = {}
    for n, f in free_at.items():
        freed_at.setdefault(f, []).append(n)
    last_alloc = 0
    for i, slot in enumerate(slots):
        allocated = _allocates(slot, plan)
        if slot.kernel:
            for n in slot.defines:
                val = n.meta["val"]
                result.nbytes[n] = storage_bytes(val)
                key = (str(val.device), val.dtype, result.nbytes[n])
                # Rule 4: only storage freed since the last slot that allocated.
                free = [(d, f) for d, f in pool.get(key, []) if f >= last_alloc]
                if not free or result.nbytes[n] == 0 or n in in_inputs:
                    allocated = True
                    continue
                dead, _ = max(free, key=lambda t: t[1])  # the most recently freed: warmest in cache
                pool[key].remove((dead, _))
                result.reuse[n] = dead
                held_until[dead] = i
        for n in freed_at.get(i, []):
            val = n.meta["val"]
            pool.setdefault((str(val.device), val.dtype, storage_bytes(val)), []).append((n, i))
        if allocated:
            last_alloc = i
            # Storage freed before this slot can never be taken again (rule 4): drop it.
            pool = {k: [e for e in v if e[1] >= i] for k, v in pool.items()}
    for n, i in death.items():
        at = max(i, held_until.get(n, i))
        result.dels.setdefault(slots[at].key, []).append(n)
    for names in result.dels.values():
        names.sort(key=lambda n: n.name)
    return result


def _storage_free_slots(buffers: list[fx.Node], death: dict[fx.Node, int], returned: set[fx.Node],
                        in_kernel: set[fx.Node]) -> dict[fx.Node, int]:
    """Slot after which nothing refers to each buffer's storage; buffers returned (themselves or
    through an alias) are left out: their storage outlives the program. A view inside a generated
    kernel is index arithmetic, not a tensor: the kernel's slot reading the buffer covers it."""
    out = {}
    for buf in buffers:
        last, stack, seen, escapes = death.get(buf), [buf], {buf}, buf in returned
        while stack and not escapes:
            n = stack.pop()
            for user in n.users:
                if user in seen or user in in_kernel or user.op != "call_function" or not _aliases_input(user):
                    continue
                seen.add(user)
                if user in returned or user not in death:
                    escapes = True  # returned, or a name the program never deletes
                    break
                last = max(last, death[user]) if last is not None else death[user]
                stack.append(user)
        if not escapes and last is not None:
            out[buf] = last
    return out
