"""What a captured CUDA graph's memory is, for the runner (runtime/cudagraphs/runner.py): the pool and
the graphs captured into it (``PoolState``), how each output leaf is handed out after a replay
(``Slot``), the outputs that share one block of the pool (``OutputGroup``), one capture
(``CapturedGraph``), and the checks on them: who still holds a group's memory, which groups a
replay would overwrite, how outputs are copied out or re-based onto the caller's tensors."""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import compat


class PoolState:
    """One CUDA memory pool and every graph captured into it.

    Graphs are never dropped from it: the allocator asserts that a pool captured into again still
    has a graph using it. A tensor handed out after a replay lies on a view of the pool's memory
    that holds ``anchors`` (``CudaBackend.view``): the pool's CUDA graphs and the graph that
    pre-sized it, so the pool stays valid while anybody can read it. Not this object: it holds the
    views (through its graphs' output groups), and a cycle that passes through a storage's deleter
    is one Python's collector cannot see, so a dropped model kept its pool reserved for good
    (resnet50 training: 5,148 MiB on the H100)."""

    def __init__(self, handle: object, shared: bool) -> None:
        self.handle = handle
        self.shared = shared
        self.graphs: list[CapturedGraph] = []
        self.live: dict[int, list[OutputGroup]] = {}  # address -> output groups of live graphs there
        self.consts: set[int] = set()  # ids of host tensors that live graphs hand out unchanged
        self._keeper: object = None
        self.anchors: list[object] = []  # what views of the pool's memory hold (see above)
        self.spans: dict[int, int] = {}  # address -> bytes of every output group ever handed out
        # Output groups handed out (by a capture or a replay) and not yet seen free, by id: a group
        # nobody holds cannot be held again until its graph hands it out anew, so the overwrite
        # check before each replay reads these, not every group of every graph in the pool.
        self.handed: dict[int, OutputGroup] = {}

    @property
    def keeper(self) -> object:
        """The graph that pre-sized the pool (runtime/cudagraphs/pool.py), or None."""
        return self._keeper

    @keeper.setter
    def keeper(self, graph: object) -> None:
        self._keeper = graph
        if graph is not None:
            self.anchors.append(graph)

    def hand_out(self, groups: list[OutputGroup], none_copied: bool = False) -> None:
        """``groups`` were just handed out (``none_copied``: the caller knows no group is copied)."""
        if not self.shared:  # the overwrite check reads these only in a shared pool
            return
        if none_copied:
            self.handed.update(zip(map(id, groups), groups))
            return
        for grp in groups:
            if not grp.copy:  # a copy group hands out fresh tensors, not this pool's memory
                self.handed[id(grp)] = grp

    def add(self, g: CapturedGraph) -> None:
        self.graphs.append(g)
        self.anchors.append(g.graph)
        for grp in g.groups:
            self.live.setdefault(grp.ptr, []).append(grp)
            self.spans[grp.ptr] = max(self.spans.get(grp.ptr, 0), grp.nbytes)
        self.consts.update(id(s.value) for s in g.slots if s.kind == "const")

    def retire(self, g: CapturedGraph) -> None:
        """``g`` is replayed no more (its outputs may still be held: it stays in ``graphs``)."""
        for grp in g.groups:
            at = self.live.get(grp.ptr, [])
            if grp in at:
                at.remove(grp)
            if not at:
                self.live.pop(grp.ptr, None)
        self.consts.difference_update(id(s.value) for s in g.slots if s.kind == "const")

    def source(self, t: object) -> OutputGroup | None:
        """The output group of a live graph that ``t`` lies in (None: not this pool's memory)."""
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        at = self.live.get(t.untyped_storage().data_ptr())
        return at[-1] if at else None

    def span(self, t: object) -> tuple[int, int] | None:
        """The pool memory ``t`` lies in, [start, end), if it is an output a graph of this pool ever
        handed out (retired graphs' too: their outputs stay valid while held)."""
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
        nbytes = self.spans.get(ptr)
        return None if nbytes is None else (ptr, ptr + nbytes)

    def holds(self, t: object) -> bool:
        return id(t) in self.consts or self.source(t) is not None


@dataclass
class Slot:
    """How one leaf of the program's output is handed to the caller after a replay."""

    kind: str  # value | const | input | alias | pool | same | empty
    value: object = None  # non-tensor value, host tensor (const), or shape/strides/dtype on "meta"
    index: int = 0  # input index (input, alias), group index (pool), earlier slot (same)
    delta: int = 0  # alias: bytes from the input's first element; pool: storage offset (elements)


@dataclass
class OutputGroup:
    """Outputs that share one storage (one block) of the graph's pool.

    The runner holds none of them: the outputs of the capturing call are the allocator's own
    tensors (``own``, watched through a weak reference); after a replay they are handed out on
    ``view``, a storage on the same memory that the allocator does not know of. Either way a
    reference count above the runner's own says that somebody holds one."""

    ptr: int
    nbytes: int
    members: list[int]  # slot indices
    own: StorageWeakRef
    own_base: int = 0  # references to ``own`` that are not the caller's (recording.GraphRecorder._baseline)
    lo: int = 0  # byte range the members cover
    hi: int = 0
    copy: bool = False
    view: torch.UntypedStorage | None = None
    view_base: int = 0
    bases: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> tensor on ``view``
    copy_leaves: set[int] | None = None  # the owning runner's set: marked here from other graphs


@dataclass
class CapturedGraph:
    graph: object
    state: PoolState
    static_idx: list[int]
    static_ptrs: list[int]
    dynamic_idx: list[int]
    buffers: list[torch.Tensor]
    writeback: list[int]  # positions in dynamic_idx the graph mutates
    bump: list[int]  # static inputs the graph mutates (their versions are bumped per replay)
    slots: list[Slot]
    groups: list[OutputGroup]
    container: type | None  # tuple or list of leaves; None: a single leaf
    final: bool
    device: torch.device
    sources: dict[int, OutputGroup] = field(default_factory=dict)  # static input -> pool group it was read from
    protected: list[tuple[int, int]] = field(default_factory=list)  # pool ranges held throughout capture
    dyn_ptrs: list[int] = field(default_factory=list)
    same_calls: list[int] = field(default_factory=list)
    pooled: dict[int, tuple[int, int]] = field(default_factory=dict)  # input -> its buffer's (address, bytes) in the pool
    candidates: tuple[int, list, set[int]] | None = None  # (graphs in the pool, protected, hazard_candidates' answer)
    # hand_out_fresh's plan: the pool slots and their base tensors, the input slots and their
    # inputs, the other slots (fixed with the views).
    fresh_plan: tuple[list[int], list[torch.Tensor], list[tuple[int, int]], list[int]] | None = None
    # held_groups' per-group handles and baselines, fixed once the groups' views exist.
    counts: tuple[list[int], list[int], list[int], list[int]] | None = None

    @property
    def expanded(self) -> bool:
        """Whether a copied input's buffer is expanded (replays copy it with ``copy_in``)."""
        if self._expanded is None:
            self._expanded = any(broadcast_dims(b) for b in self.buffers)
        return self._expanded

    _expanded: bool | None = None

    def pick_static(self, args: list) -> Sequence:
        """The inputs the graph reads in place, in ``static_idx`` order (one C call)."""
        if self._pick is None:
            self._pick = picker(self.static_idx)
        return self._pick(args)

    _pick: Callable[[list], Sequence] | None = None


def picker(idx: Sequence[int]) -> Callable[[list], Sequence]:
    """``args -> [args[i] for i in idx]`` as ``operator.itemgetter`` (a tuple even for one index)."""
    if len(idx) == 1:
        only = idx[0]
        return lambda args: (args[only],)
    if not idx:
        return lambda args: ()
    return operator.itemgetter(*idx)


def broadcast_dims(t: torch.Tensor) -> tuple[int, ...]:
    """Dimensions along which ``t`` repeats one element (stride 0, size above 1: an expanded tensor)."""
    return tuple(d for d, (n, st) in enumerate(zip(t.shape, t.stride())) if st == 0 and n > 1)


def one_of_each(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``t`` with each of ``dims`` narrowed to its first element: what a copy into an expanded
    buffer writes (a copy into the buffer itself would write each memory location many times)."""
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def copy_in(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Tensors into a capture's buffers: one ``copy_`` for one tensor, else one multi-tensor copy
    (a single launch where the tensors share a dtype). An expanded destination gets one element
    per broadcast dimension (its source repeats it there too: ``expanded_moved`` checks)."""
    if any(broadcast_dims(d) for d in dsts):
        pairs = [(one_of_each(d, dims), one_of_each(x, dims)) for d, x in zip(dsts, srcs)
                 for dims in (broadcast_dims(d),)]
        dsts, srcs = [d for d, _ in pairs], [x for _, x in pairs]
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0], non_blocking=non_blocking)
    elif dsts:
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def copyable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be copied into a buffer of its own strides: no two elements share memory,
    except along broadcast dimensions, whose one element ``copy_in`` writes once."""
    return torch._debug_has_internal_overlap(one_of_each(t, broadcast_dims(t))) == 0


def uses(grp: OutputGroup) -> int:
    """References to the group's memory beyond the runner's own."""
    # A use count of 0 is an expired weak reference: the same answer as ``own.expired()``,
    # one call cheaper (this runs for every output group of the pool before each replay).
    n = compat.storage_use_count(grp.own.cdata)
    n = n - grp.own_base if n else 0
    if grp.view is not None:
        n += compat.storage_use_count(grp.view._cdata) - grp.view_base
    return n


def is_held(grp: OutputGroup) -> bool:
    # Anybody else holding the storage (a tensor, a view, autograd's saved tensors) raises its
    # reference count.
    return uses(grp) > 0


def held_groups(g: CapturedGraph) -> list[int]:
    """Indices of ``g``'s output groups that somebody holds (``is_held`` of each), in one pass.

    Runs before every replay over every output group (a training forward saves hundreds of
    tensors for its backward): once the groups' views exist (the first replay makes them, and
    they stay for the graph's life) their handles and baselines are kept as lists, and the
    reference counts are read by ``map`` over torch's own function, no Python call per group."""
    groups = g.groups
    if not groups or groups[0].view is None:
        return [k for k, grp in enumerate(groups) if is_held(grp)]
    if g.counts is None:
        g.counts = ([grp.own.cdata for grp in groups], [grp.own_base for grp in groups],
                    [grp.view._cdata for grp in groups], [grp.view_base for grp in groups])  # type: ignore[union-attr]
    own, own_base, view, view_base = g.counts
    count = compat.storage_use_count
    return [k for k, (n, nb, v, vb) in enumerate(zip(map(count, own), own_base, map(count, view), view_base))
            if (n - nb if n else 0) + v - vb > 0]


_DETACH = torch.Tensor.detach


def other_leaf(g: CapturedGraph, s: Slot, refs: list, leaves: list) -> object:
    """The leaf a slot of any kind but ``pool`` hands out after a replay (``leaves``: the earlier ones)."""
    kind = s.kind
    if kind in ("value", "const"):
        return s.value
    if kind == "input":
        return refs[s.index]
    if kind == "alias":
        return rebase(s.value, refs[s.index], s.delta)  # type: ignore[arg-type]
    if kind == "same":
        return leaves[s.index]
    t = s.value  # empty
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=g.device)  # type: ignore[union-attr]


def hand_out_fresh(g: CapturedGraph, refs: list) -> list:
    """The leaves of a replay none of whose output groups is copied: a fresh tensor on the pool's
    memory per pool output, made by ``map`` over the groups' base tensors (a training forward hands
    out hundreds), then the other slots in order. Needs the groups' views (``_views``)."""
    plan = g.fresh_plan
    if plan is None:
        pool_at: list[int] = []
        bases: list[torch.Tensor] = []
        inputs: list[tuple[int, int]] = []  # a forward hands parameters to its backward as they are
        others: list[int] = []
        for j, s in enumerate(g.slots):
            if s.kind == "pool":
                pool_at.append(j)
                bases.append(g.groups[s.index].bases[j])
            elif s.kind == "input":
                inputs.append((j, s.index))
            else:
                others.append(j)
        plan = g.fresh_plan = (pool_at, bases, inputs, others)
    pool_at, bases, inputs, others = plan
    leaves: list = [None] * len(g.slots)
    for j, t in zip(pool_at, map(_DETACH, bases)):
        leaves[j] = t
    for j, i in inputs:
        leaves[j] = refs[i]
    slots = g.slots
    for j in others:
        leaves[j] = other_leaf(g, slots[j], refs, leaves)
    return leaves


def unclean(state: PoolState, refs: dict[int, int]) -> bool:
    """Whether a tensor handed out after a replay is still held, beyond ``refs`` (storage ->
    references): the allocator does not know that its memory is in use, so a capture into the
    pool could place new buffers on it."""
    return any(grp.view is not None
               and compat.storage_use_count(grp.view._cdata) - refs.get(grp.view._cdata, 0) > grp.view_base
               for y in state.graphs for grp in y.groups)


def inside(grp: OutputGroup, ranges: list[tuple[int, int]]) -> bool:
    """Whether the group's memory lies within one of ``ranges`` (sorted, disjoint: ``merged``)."""
    k = bisect.bisect_right(ranges, (grp.ptr, math.inf)) - 1
    return k >= 0 and grp.ptr + grp.nbytes <= ranges[k][1]


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, overlapping or touching ones joined: a block inside the union of the
    originals lies inside one of these."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def hazard_candidates(g: CapturedGraph) -> set[int]:
    """The output groups (by id) of the pool's other graphs that ``g``'s replay may write over: those
    outside the memory held throughout its capture. Graphs only join a pool, and a graph's groups
    and protected ranges are fixed at capture, so the list is kept until the pool gains a graph
    (or ``protected`` is replaced)."""
    graphs = g.state.graphs
    if g.candidates is None or g.candidates[0] != len(graphs) or g.candidates[1] is not g.protected:
        ranges = merged(g.protected)
        g.candidates = (len(graphs), g.protected, {id(grp) for y in graphs if y is not g for grp in y.groups
                                                   if not inside(grp, ranges)})
    return g.candidates[2]


def overwrite_hazards(g: CapturedGraph, args: list) -> list[OutputGroup]:
    """Output groups of the pool's other graphs that ``g``'s replay may overwrite and that somebody
    other than this call's arguments (which the program consumes) still holds.

    A replay writes only memory its capture allocated, and the allocator hands out no block that is
    in use: memory held throughout the capture (``g.protected``) is never written."""
    if not g.state.shared:
        return []
    handed = g.state.handed
    if not handed:
        return []
    # Groups held throughout g's capture are no candidates: its replay never writes there. The
    # intersection runs in C: a backward's check sees every activation its forward handed out.
    refs: dict[int, int] | None = None
    out = []
    for key in handed.keys() & hazard_candidates(g):
        grp = handed[key]
        n = uses(grp)
        if n <= 0:
            del handed[key]  # free: held again only once its graph hands it out anew
            continue
        if refs is None:
            refs = storage_refs(args)
        if not grp.own.expired():
            n -= refs.get(grp.own.cdata, 0)
        if grp.view is not None:
            n -= refs.get(grp.view._cdata, 0)
        if n > 0:
            out.append(grp)
    return out


def pooled_clash(g: CapturedGraph, args: list) -> list[int]:
    """Inputs whose buffers in the pool overlap the memory of this call's inputs there.

    A pooled buffer is memory the capture allocated and freed; another graph of the pool may
    hand out outputs there since (a forward replayed while this graph's capture read the
    outputs of an uncaptured one), and the copy-in would overwrite an input before reading
    it. In a pool of its own a graph's inputs never lie there: its own held outputs make the
    call run uncaptured before any copy."""
    if not g.pooled or not g.state.shared:
        return []
    spans = [sp for i in g.dynamic_idx if (sp := g.state.span(args[i])) is not None]
    if not spans:
        return []
    return [i for i, (ptr, nbytes) in g.pooled.items() if any(ptr < hi and lo < ptr + nbytes for lo, hi in spans)]


def storage_refs(args: list) -> dict[int, int]:
    """Storage -> how many of ``args`` (distinct tensors, one reference each) refer to it."""
    counts: dict[int, int] = {}
    seen: set[int] = set()
    for a in args:
        if isinstance(a, torch.Tensor) and id(a) not in seen:
            seen.add(id(a))
            cdata = a.untyped_storage()._cdata
            counts[cdata] = counts.get(cdata, 0) + 1
    return counts


def copy_group(grp: OutputGroup, slots: list[Slot], storage: torch.UntypedStorage) -> dict[int, torch.Tensor]:
    """Copies of a group's outputs (on ``storage``) in one new storage, aliasing between them kept."""
    first = slots[grp.members[0]].value
    assert isinstance(first, torch.Tensor)
    device = storage.device
    raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, grp.lo, (grp.hi - grp.lo,), (1,))
    new = raw.clone().untyped_storage()
    out = {}
    for j in grp.members:
        t = slots[j].value
        assert isinstance(t, torch.Tensor)
        size = t.element_size()
        offset = (slots[j].delta * size - grp.lo) // size
        out[j] = torch.empty(0, dtype=t.dtype, device=device).set_(new, offset, t.shape, t.stride())
    return out


def rebase(captured: torch.Tensor, caller: torch.Tensor, delta: int) -> torch.Tensor:
    """The output that aliased an input during capture, as the same view of the caller's tensor."""
    size = captured.element_size()
    if captured.dtype == caller.dtype and delta % size == 0:
        return caller.as_strided(captured.shape, captured.stride(), caller.storage_offset() + delta // size)
    offset = (caller.storage_offset() * caller.element_size() + delta) // size
    return torch.empty(0, dtype=captured.dtype, device=caller.device).set_(
        caller.untyped_storage(), offset, captured.shape, captured.stride())


def meta_of(t: torch.Tensor) -> torch.Tensor:
    """Shape, strides and dtype of ``t`` without holding its memory."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def ptr_of(a: object) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else 0


def version_of(a: object) -> int | None:
    if not isinstance(a, torch.Tensor):
        return 0
    try:
        return a._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def few(items: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in items[:4])
    return f"{shown} (+{len(items) - 4} more)" if len(items) > 4 else shown
