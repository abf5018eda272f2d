"""The iteration space of a generated CPU kernel (codegen/cpu_kernel.py): the tensors the kernel
reads and writes, with their stride along every dim of the group's reference shape S; the loop
dims (adjacent S dims that are contiguous in every tensor merge into one loop), ordered by memory;
and the layout (``rows`` when a reduced dim is innermost in memory, else ``columns``). Reduction
levels are the shared writer's (codegen/kernel_writer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ember.schedule.dim_map import dim_strides
from ember.schedule.plan import FusedGroup

_BIG = 1 << 62  # sort key of a broadcast dim: outermost, past any real stride


@dataclass
class Access:
    """One tensor read or written by the kernel, with its stride along every S dim."""

    node: fx.Node
    dims: tuple
    store: bool
    strides: dict[int, int] = field(default_factory=dict)  # S dim -> stride (walked dims only)
    pointer: str = ""

    def stride(self, loop: Loop) -> int:
        """The stride along a loop dim: that of its innermost member (the merged ones are contiguous)."""
        return self.strides.get(loop.members[-1], 0)


@dataclass
class Loop:
    """A loop dim: S dims that merged, outermost first. ``kind`` x (kept) or r (reduced)."""

    members: list[int]
    kind: str
    index: int = 0

    @property
    def var(self) -> str:
        return f"{self.kind}{self.index}"

    @property
    def size_param(self) -> str:
        return f"{self.kind}s{self.index}"


def collect_accesses(group: FusedGroup, pointer: dict[fx.Node, str]) -> list[Access]:
    """Every distinct (tensor, dims, load or store) of ``group``; ``pointer`` names the tensors."""
    shape = group.shape
    seen: dict[tuple, Access] = {}
    for n in group.nodes:
        for a, dims in group.input_dims[n].items():
            seen.setdefault((a, dims, False), Access(a, dims, False))
    for n in group.outputs:
        seen.setdefault((n, group.dims[n], True), Access(n, group.dims[n], True))
    for acc in seen.values():
        for s, stride in dim_strides(acc.dims, acc.node.meta["val"].stride(), shape):
            if shape[s] != 1 and stride != 0:
                acc.strides[s] = acc.strides.get(s, 0) + stride
        acc.pointer = pointer[acc.node]
    return list(seen.values())


def loop_dims(shape: tuple[int, ...], reduced: set[int], accesses: list[Access]) -> tuple[list[Loop], list[Loop]]:
    """The kept and the reduced loop dims, outermost first."""
    # Order by the memory layout of the tensors that walk the most dims (largest first, loads
    # before stores); a dim a tensor broadcasts counts as its outermost.
    prio = sorted(accesses, key=lambda a: -len(a.strides))

    def key(s: int) -> tuple:
        return tuple(-(a.strides.get(s, 0) or _BIG) for a in prio), s

    loops: dict[str, list[Loop]] = {}
    for kind in ("x", "r"):
        dims = sorted((d for d in range(len(shape)) if shape[d] != 1 and (d in reduced) == (kind == "r")),
                      key=key)
        merged: list[Loop] = []
        for s in dims:
            prev = merged[-1].members[-1] if merged else None
            if prev is not None and all(a.strides.get(prev, 0) == a.strides.get(s, 0) * shape[s]
                                        for a in accesses):
                merged[-1].members.append(s)
            else:
                merged.append(Loop([s], kind, len(merged)))
        loops[kind] = merged
    return loops["x"], loops["r"]


def loop_size(shape: tuple[int, ...], loop: Loop) -> int:
    size = 1
    for s in loop.members:
        size *= shape[s]
    return size


def choose_layout(loops_x: list[Loop], loops_r: list[Loop], accesses: list[Access], reduced: set[int]) -> str:
    """``rows`` or ``columns`` (the module docstring of cpu_kernel.py says what each means)."""
    if not loops_r:
        return "columns"  # pointwise: blocks of the innermost kept loop
    if not loops_x:
        return "rows"
    full = [a for a in accesses if not a.store and any(s in reduced for s in a.strides)]
    ref = max(full, key=lambda a: len(a.strides)) if full else accesses[0]
    if not ref.strides:
        return "rows"
    inner = min(ref.strides, key=lambda s: (abs(ref.strides[s]), -s))
    return "rows" if inner in reduced else "columns"


__all__ = ["Access", "Loop", "choose_layout", "collect_accesses", "loop_dims", "loop_size"]
