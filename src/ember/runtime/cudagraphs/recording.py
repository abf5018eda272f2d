"""How the CUDA-graph runner (runner.py) records a program: the capture itself, the buffers of
its inputs (copied in, read in place, or pooled), and how its outputs are handed out (from the
graph's memory, or copied) and kept valid for the caller. ``CudaGraphRunner`` inherits these;
the decisions it makes per call (check, replay, capture again) stay in runner.py."""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import compat
from ember.runtime.cudagraphs.memory import (
    CapturedGraph,
    OutputGroup,
    PoolState,
    Slot,
    broadcast_dims,
    copy_group,
    copy_in,
    copyable,
    few,
    meta_of,
    rebase,
    storage_refs,
    unclean,
    version_of,
)
from ember.runtime.cudagraphs.rules import (  # noqa: F401 - the decision, re-exported beside the runner
    CAPTURED_KINDS,
    GRAPH_SAFE_RANDOM,
    cudagraph_blocker,
    cudagraphs_enabled,
    training_capture_enabled,
)

MAX_CAPTURES = 5  # the last one copies every input and output, so it is final


class GraphRecorder:
    """The recording half of ``CudaGraphRunner`` (its state lives in the runner's ``__init__``)."""

    def _capture(self, args: list, why: str) -> object:
        old, self.g = self.g, None
        if old is not None:
            old.state.retire(old)  # the caller may still hold its outputs: they stay valid
        refs = list(args)
        args.clear()
        final = self.captures >= MAX_CAPTURES - 1
        tensors = [i for i, a in enumerate(refs) if isinstance(a, torch.Tensor)]
        device = next((refs[i].device for i in tensors if self.backend.on_device(refs[i])),
                      refs[tensors[0]].device if tensors else torch.device("cuda"))
        state = lookup = self._state(device)
        if state.shared and unclean(state, {}):
            # Tensors handed out after replays lie on memory the allocator thinks free: a capture
            # into this pool could place its buffers there.
            assert self.pool is not None
            if not unclean(state, storage_refs(refs)) or self.renewed:
                # Only this call's inputs (a forward's outputs, replayed in a call before this
                # graph's first capture), or a pool this graph renewed before and found held
                # again (a forward whose backward never runs caught the renewal, and the next
                # step's forward replayed): a private pool of its own, which cannot overlap them.
                state = PoolState(self.backend.new_pool(device, False), shared=False)
            else:  # a new pool; the other graphs follow on their next calls
                self.pool.renew()
                self.renewed = True
                return self._defer(refs, "outputs of replays were still held: the pool was renewed")
        if final:
            static: list[int] = []
        else:
            if why:  # decided by _check
                base = self.next_static
                self.last_reason = why
            else:  # first capture: what kept its address since the call before
                prev = self.prev_ptrs or []
                base = [i for i in tensors if i < len(prev) and refs[i].data_ptr() == prev[i]]
            # Outputs of graphs in this pool stay where their graph writes them: read in place.
            static = sorted({i for i in base if i not in self.demoted} |
                            {i for i in tensors if i not in self.demoted and lookup.holds(refs[i])})
        host = [i for i in tensors if not self.backend.on_device(refs[i]) and refs[i].numel() > 0
                and not (i in static and id(refs[i]) in lookup.consts)]
        if host:  # a capture reads host tensors once (an attention seed from an uncaptured call)
            return self._defer(refs, f"input {few(host)} is a host tensor")
        try:
            self.g, outputs = self._record(refs, tensors, static, final, state, device, lookup)
        except Exception as err:  # noqa: BLE001 - an uncapturable program still runs
            self.g = None
            self.disabled = f"{type(err).__name__}: {str(err)[:200]}"
            self._set_status(f"not captured: capture failed, running uncaptured: {self.disabled}")
            self.backend.recover(self.device)
            if any(r is None for r in refs):  # an input this call consumed is gone
                raise RuntimeError(f"{self.title}: CUDA-graph capture failed after the program freed "
                                   f"its inputs: {self.disabled}") from err
            return self.run(refs)
        if state.shared and self.pool is not None:  # the first calls' cached memory (runtime/cudagraphs/pool.py)
            self.pool.sizing.released += self.backend.release_cached(device)
        self._describe()
        return self._first_outputs(self.g, outputs, refs)

    def _record(self, refs: list, tensors: list[int], static: list[int], final: bool, state: PoolState,
                device: torch.device, lookup: PoolState) -> tuple[CapturedGraph, object]:
        """Capture into ``state``; ``lookup``: the pool whose graphs' outputs are read in place."""
        statics = set(static)
        dynamic = [i for i in tensors if i not in statics]
        for i in dynamic:
            if not copyable(refs[i]):
                raise ValueError(f"input {i} moves between calls and has overlapping memory, so it cannot be "
                                 "copied into a static buffer")
        # A read-only input's buffer is allocated by the capture, in the graph's pool, and freed
        # by the program after its last read: its memory serves the graph's later tensors, as
        # an eager input's would once consumed (mobilenet_v3's 74 MiB input batch sat beside its
        # whole inference peak). The replay's copy-in writes it before the graph reads it. Any
        # other buffer is allocated here and held, for the copy back after each replay.
        # Not in a final capture: it copies everything, and may never capture again to undo a clash.
        pooled = [] if final else [i for i in dynamic if i in self.read_only and i not in self.unpooled
                                   and refs[i].numel() > 0]
        held = [i for i in dynamic if i not in pooled]
        # Buffers are ordinary tensors even under inference_mode: their version counters tell
        # which dynamic inputs the program writes.
        with torch.inference_mode(False):
            buffers = {i: torch.empty_strided(refs[i].shape, refs[i].stride(), dtype=refs[i].dtype,
                                              device=refs[i].device) for i in held}
        if buffers:
            copy_in(list(buffers.values()), [refs[i] for i in held])
        inputs = list(refs)
        for i, buf in buffers.items():
            inputs[i] = buf
        before = [version_of(x) for x in inputs]
        weak = [weakref.ref(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        stores = {i: StorageWeakRef(x.untyped_storage()) for i, x in enumerate(inputs)
                  if isinstance(x, torch.Tensor) and x.numel() > 0 and i not in pooled}
        places: dict[int, tuple[int, int]] = {}  # pooled input -> (storage address, bytes)

        def allocate_pooled(inputs: list) -> None:
            """Inside the capture: the read-only inputs' buffers, from the graph's pool."""
            with torch.inference_mode(False):
                for i in pooled:
                    buf = torch.empty_strided(refs[i].shape, refs[i].stride(), dtype=refs[i].dtype,
                                              device=refs[i].device)
                    storage = buf.untyped_storage()
                    places[i] = (storage.data_ptr(), storage.nbytes())
                    weak[i] = weakref.ref(buf)
                    before[i] = version_of(buf)
                    if buf.numel() > 0:
                        stores[i] = StorageWeakRef(storage)
                    inputs[i] = buf
                    del buf, storage
        static_ptrs = [refs[i].data_ptr() for i in static]
        sources = {i: src for i in static if (src := lookup.source(refs[i])) is not None}
        dyn_ptrs = [refs[i].data_ptr() for i in dynamic]
        # The program frees the inputs it is done with; holding none of this pool's, the runner
        # lets the capture reuse their memory (the saved activations, in the backward).
        for i in sources:
            refs[i] = None
        held_before = [grp for y in state.graphs for grp in y.groups if not grp.own.expired()]
        self.device = device
        self.captures += 1
        try:
            graph, outputs = self.backend.capture(self.run, inputs, device, state.handle,
                                                  allocate_pooled if pooled else None)
        finally:
            del inputs
            for i in sources:  # still alive if somebody else holds it (or the program returned it)
                refs[i] = weak[i]() if weak[i] is not None else None
        after = [version_of(w()) if w is not None and w() is not None else b for w, b in zip(weak, before)]
        mutated = {i for i in tensors if before[i] is None or before[i] != after[i]}
        if any(broadcast_dims(refs[i]) for i in dynamic if i in mutated and refs[i] is not None):
            raise ValueError("the program writes an expanded input that moves between calls")
        slots, groups, container = self._outputs(outputs, weak, stores, final)
        for i in pooled:  # copy targets on the pool's memory, which the allocator may hand out again
            ptr, nbytes = places[i]
            buffers[i] = torch.empty(0, dtype=refs[i].dtype, device=device).set_(
                self.backend.view(ptr, nbytes, device, state.anchors), 0, refs[i].shape, refs[i].stride())
        if pooled:  # the first replay follows at once (_first_outputs)
            copy_in([buffers[i] for i in pooled], [refs[i] for i in pooled])
        g = CapturedGraph(graph, state, static, static_ptrs, dynamic, [buffers[i] for i in dynamic],
                   [k for k, i in enumerate(dynamic) if i in mutated],
                   [i for i in static if i in mutated and before[i] is not None],
                   slots, groups, container, final, device, sources=sources,
                   protected=[(grp.ptr, grp.ptr + grp.nbytes) for grp in held_before if not grp.own.expired()],
                   dyn_ptrs=dyn_ptrs, same_calls=[0] * len(dynamic), pooled={i: places[i] for i in pooled})
        state.add(g)
        return g, outputs

    def _outputs(self, outputs: object, weak: list, stores: dict[int, StorageWeakRef],
                 final: bool) -> tuple[list[Slot], list[OutputGroup], type | None]:
        if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "_fields"):
            container: type | None = type(outputs)
            leaves = list(outputs)
        else:
            container, leaves = None, [outputs]
        if any(isinstance(x, (tuple, list, dict)) for x in leaves):
            raise TypeError("nested program outputs")
        # Storages of tensors the program itself holds (its constants): the caller gets those as
        # they are, as from an uncaptured run; as graph memory they would look held by somebody
        # (the program) at every call and force a capture per call (T5's folded masks and position
        # buckets, saved for the backward).
        held_by_program = {t.untyped_storage().data_ptr() for t in getattr(self.run, "constants", ())
                           if isinstance(t, torch.Tensor) and t.numel() > 0}
        by_storage: dict[int, int] = {}
        for i in sorted(stores):
            if not stores[i].expired():  # a weak reference keeps the address from being reused
                by_storage.setdefault(stores[i].cdata, i)
        slots: list[Slot] = []
        groups: list[OutputGroup] = []
        group_of: dict[int, int] = {}
        seen: dict[int, int] = {}
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                slots.append(Slot("value", leaf))
                continue
            if id(leaf) in seen:
                slots.append(Slot("same", index=seen[id(leaf)]))
                continue
            seen[id(leaf)] = j
            same_input = next((i for i, w in enumerate(weak) if w is not None and w() is leaf), None)
            if same_input is not None:
                slots.append(Slot("input", index=same_input))
                continue
            if leaf.numel() == 0:
                slots.append(Slot("empty", meta_of(leaf)))  # no memory to hold
                continue
            if not self.backend.on_device(leaf) or leaf.untyped_storage().data_ptr() in held_by_program:
                # A host tensor made at capture (attention's unused seed without dropout): the
                # graph never writes it, so every replay hands out the same one.
                slots.append(Slot("const", leaf))
                continue
            cdata = leaf.untyped_storage()._cdata
            owner = by_storage.get(cdata)
            if owner is not None:
                x = weak[owner]()
                base_ptr = x.data_ptr() if x is not None else leaf.untyped_storage().data_ptr()
                slots.append(Slot("alias", meta_of(leaf), owner, leaf.data_ptr() - base_ptr))
                continue
            k = group_of.get(cdata)
            if k is None:
                storage = leaf.untyped_storage()
                k = group_of[cdata] = len(groups)
                groups.append(OutputGroup(storage.data_ptr(), storage.nbytes(), [], StorageWeakRef(storage),
                                     lo=storage.nbytes(), copy_leaves=self.copy_leaves))
                del storage
            grp = groups[k]
            grp.members.append(j)
            start = leaf.storage_offset() * leaf.element_size()
            span = (1 + sum((s - 1) * st for s, st in zip(leaf.shape, leaf.stride()))) * leaf.element_size()
            grp.lo, grp.hi = min(grp.lo, start - start % 16), max(grp.hi, start + span)
            slots.append(Slot("pool", meta_of(leaf), k, leaf.storage_offset()))
        for grp in groups:
            grp.copy = final or any(m in self.copy_leaves for m in grp.members)
            grp.own_base = self._baseline(grp, [leaves[j] for j in grp.members])
        return slots, groups, container

    def _baseline(self, grp: OutputGroup, members: list[torch.Tensor]) -> int:
        """References to a group's storage that are not the caller's: the storage's Python object
        and whatever the backend itself keeps, never more. What else refers to the storage right
        after the capture (the leaves about to be handed out and the bases of views among them,
        but also the program's intermediate views, alive until Python's cycle collector or a
        frame lets them go) is not counted in: a baseline that took a transient reference in
        let a replay overwrite an output autograd had saved once that reference was gone (a
        layer's graph called once per layer, its earlier calls' activations held)."""
        expected = compat.storage_object_refs() + self.backend.refs_to(grp.own.cdata)
        holders = {id(t) for t in members} | {id(t._base) for t in members if t._is_view()}
        measured = compat.storage_use_count(grp.own.cdata) - len(holders)
        return min(expected, measured)  # fewer than expected: count the caller's refs, never miss one

    def _first_outputs(self, g: CapturedGraph, outputs: object, refs: list) -> object:
        """Run the graph just captured and hand out the capture's own output tensors."""
        self.backend.replay(g.graph, refs)  # the buffers were filled before the capture
        self.replays += 1
        if g.writeback:
            torch._foreach_copy_([refs[g.dynamic_idx[k]] for k in g.writeback], [g.buffers[k] for k in g.writeback])
        leaves = list(outputs) if g.container is not None else [outputs]
        del outputs
        out: list[object] = []
        copies: dict[int, dict[int, torch.Tensor]] = {}
        for j, s in enumerate(g.slots):
            leaf = leaves[j]
            if s.kind == "pool" and g.groups[s.index].copy:
                if s.index not in copies:
                    assert isinstance(leaf, torch.Tensor)
                    copies[s.index] = copy_group(g.groups[s.index], g.slots, leaf.untyped_storage())
                out.append(copies[s.index][j])
            elif s.kind == "input" and refs[s.index] is not None:
                out.append(refs[s.index])
            elif s.kind == "alias" and s.index in g.dynamic_idx:
                out.append(rebase(s.value, refs[s.index], s.delta))  # type: ignore[arg-type]
            elif s.kind == "same":
                out.append(out[s.index])
            else:
                out.append(leaf)
        leaves.clear()
        g.state.hand_out(g.groups)
        if g.container is None:
            return out[0]
        return g.container(out)

    # -- replay ----------------------------------------------------------------------------------

    def _views(self, g: CapturedGraph) -> None:
        """Storages on the pool memory of ``g``'s outputs, and one tensor per output on them."""
        for grp in g.groups:
            grp.view = self.backend.view(grp.ptr, grp.nbytes, g.device, g.state.anchors)
            for j in grp.members:
                meta = g.slots[j].value
                assert isinstance(meta, torch.Tensor)
                grp.bases[j] = torch.empty(0, dtype=meta.dtype, device=g.device).set_(
                    grp.view, g.slots[j].delta, meta.shape, meta.stride())
            grp.view_base = compat.storage_use_count(grp.view._cdata)
