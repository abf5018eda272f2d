"""CUDA graphs for compiled programs: one replay instead of hundreds of kernel launches.

Inference, training-forward and training-backward programs are captured (training: unless
EMBER_CUDAGRAPHS_TRAINING=0; everything: unless cudagraphs=False or EMBER_CUDAGRAPHS=0) when
``cudagraph_blocker`` (runtime/cudagraphs/rules.py, a pure function of the captured graph, its
example inputs, kind, target and the on/off switch) finds nothing that a replay could get wrong;
``ember.explain`` prints its reason otherwise, and ``CudaGraphRunner`` keeps a status line of
what it does at run time.

The rules a replay must keep, and how:

- Capture executes nothing: kernels are recorded, not run. The first call runs uncaptured
  (lazy initialisation, and the addresses of the inputs); the second is captured, then
  replayed. Mutations and random draws therefore happen exactly once per call.
- Inputs. An input found at the same address on two consecutive calls (parameters, buffers,
  optimizer-updated tensors) is *static*: the graph reads and writes it in place. Every other
  input is *dynamic*: copied into a buffer of the same strides before each replay (one
  ``_foreach_copy_``; the buffer of an input the program only reads lies in the graph's pool,
  allocated by the capture and freed after its last read, so the graph's later tensors reuse its
  memory). A static input that moves is made dynamic for good and the graph is
  captured again; a dynamic input that keeps its address for ``PROMOTE_AFTER`` calls (saved
  activations once the forward replays) is made static by a new capture.
- Mutated inputs. Which inputs the program writes is read from their version counters across
  the capture (every write of an Ember program is an ATen op, which bumps the counter of the
  tensor and its views; generated kernels only write buffers the program allocated). A
  mutated static input is written in place by the replay and its version is bumped as eager
  would; a mutated dynamic input is copied back into the caller's tensor after each replay.
  Changing an input's shape or strides in place is refused by ``cudagraph_blocker``.
- Outputs live in the graph's memory pool at fixed addresses, and the next replay overwrites
  them. An output that is (a view of) an input is rebuilt on the caller's tensor. The runner
  keeps no reference to any other output: the capturing call hands out the allocator's own
  tensors, later replays tensors on a view of the same memory that the allocator does not know
  of, and a reference count above the runner's own says that somebody holds one. Before each
  replay the runner checks that nobody still holds one. If somebody does (a kept loss, the
  saved activations of a forward whose backward has not run yet, a gradient being accumulated),
  that call runs uncaptured and those outputs are handed out as copies from then on; if the old
  ones are still held on the next call, the graph is captured again around them. A replay can
  therefore never overwrite a tensor the caller can still read.
- One pool for a model's training graphs (``GraphPool``). Alone, every capture gets a private
  pool. The forward and backward graphs of a compiled model share one, captured in execution
  order, so the backward reuses the forward's temporaries and, as eager does, the memory of the
  saved activations it has consumed (the runner holds none of its inputs from the pool during a
  capture, and AOTAutograd has released them). Outputs of a pool graph read by another graph
  are read in place. Sharing adds two rules. A replay writes only memory its capture allocated,
  and the allocator allocates no block in use, so memory held throughout the capture
  (``protected``) is safe; any other output of the pool's graphs that somebody other than this
  call's arguments (which the program consumes) holds makes the call run uncaptured and that
  output a copy from then on. And a capture must not allocate over a tensor handed out after a
  replay (the allocator thinks its memory free): when one is still held, the pool is renewed
  and every graph is captured again into the new one, on its next call.
- Random ops draw from the default CUDA generator's philox stream: a captured graph reads
  seed and offset from device memory that ``CUDAGraph.replay()`` advances, so each replay
  draws new numbers, the same ones uncaptured calls would. The backward reuses the forward's
  mask (a saved output), it draws nothing. Attention with dropout too: flash and cuDNN keep
  their seeds on the device; memory-efficient attention's are host tensors when uncaptured and
  device tensors when captured, so a capture is deferred while an input is a host tensor, and
  its backward takes them through ``ember::attention_seeds`` (passes/attention_seeds.py), which
  gives it the form its own capture status reads. Random ops outside that set, or with an
  explicit generator, are refused.
- At most ``MAX_CAPTURES`` captures; the last one copies every input in and every output out,
  so it never needs another. A capture that fails runs the program uncaptured from then on
  and says why.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import compat
from ember.config import settings
from ember.runtime.cudagraphs.device import CudaBackend
from ember.runtime.cudagraphs.memory import (
    CapturedGraph,
    OutputGroup,
    PoolState,
    Slot,
    copy_group,
    few,
    is_held,
    meta_of,
    overwrite_hazards,
    pooled_clash,
    ptr_of,
    rebase,
    storage_refs,
    unclean,
    version_of,
)
from ember.runtime.cudagraphs.pool import GraphPool, presize, share_pool  # noqa: F401 - re-exported
from ember.runtime.cudagraphs.rules import (  # noqa: F401 - the decision, re-exported beside the runner
    CAPTURED_KINDS,
    GRAPH_SAFE_RANDOM,
    cudagraph_blocker,
    cudagraphs_enabled,
    training_capture_enabled,
)

aten = torch.ops.aten

def pooled_inputs_enabled() -> bool:
    return settings().pooled_inputs


MAX_CAPTURES = 5  # the last one copies every input and output, so it is final
PROMOTE_AFTER = 3  # calls a copied input must keep its address before it is read in place


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


class CudaGraphRunner:
    """Runs a boxed program uncaptured on its first call, captures it on the second, replays after."""

    def __init__(self, run: Callable[[list], object], title: str,
                 on_status: Callable[[str], None] | None = None, backend: CudaBackend | None = None,
                 read_only: frozenset[int] = frozenset()) -> None:
        self.run = run
        self.title = title
        # Inputs the program never writes (rules.read_only_inputs): their copy buffers
        # may live in the graph's pool and die after their last read.
        self.read_only = read_only if pooled_inputs_enabled() else frozenset()
        self.on_status = on_status
        self.backend = backend or CudaBackend()
        self.pool: GraphPool | None = None  # shared with the model's other training graphs
        self.calls = 0
        self.captures = 0
        self.replays = 0
        self.uncaptured = 0  # calls after the first that ran uncaptured (outputs held, a pool renewed ...)
        self.g: CapturedGraph | None = None
        self.prev_ptrs: list[int] | None = None
        self.demoted: set[int] = set()  # moved while read in place: copied in from now on
        self.unpooled: set[int] = set()  # read-only inputs whose buffers are held outside the pool from now on
        self.copy_leaves: set[int] = set()  # output leaves handed out as copies from now on
        self.alive_last: set[int] = set()
        self.next_static: list[int] = []
        self.transient = 0  # calls in a row whose pool inputs came from an uncaptured call
        self.last_reason = ""
        self.disabled: str | None = None
        self.device = torch.device("cuda")
        self._set_status("waiting for the second call, which is captured and replayed after")

    def _set_status(self, text: str) -> None:
        self.status = text
        if self.on_status is not None:
            self.on_status(text)

    def __call__(self, args: list) -> object:
        self.calls += 1
        if self.disabled is not None:
            return self.run(args)
        if self.g is None:
            if self.prev_ptrs is None:
                self.prev_ptrs = [ptr_of(a) for a in args]
                device = next((a.device for a in args if isinstance(a, torch.Tensor) and self.backend.on_device(a)),
                              None)
                if self.pool is None or device is None:
                    return self.run(args)
                # The first calls of the model's graphs measure what its pool will need.
                self.pool.sizing.begin(self.backend.memory_counters(device))
                with self.backend.first_call_pool(device):
                    out = self.run(args)
                self.pool.sizing.end(self.backend.memory_counters(device))
                self.pool.sizing.released += self.backend.release_cached(device)  # (runtime/cudagraphs/pool.py)
                return out
            return self._capture(args, "")
        why = self._check(args)
        if why is None:
            return self._replay(args)
        if not why:
            self.uncaptured += 1
            self._describe()
            return self.run(args)
        return self._capture(args, why)

    # -- deciding whether this call may replay ----------------------------------------------

    def _check(self, args: list) -> str | None:
        """None: replay. "": run uncaptured (outputs held). Otherwise: why to capture again (the
        inputs to read in place are left in ``self.next_static``)."""
        g = self.g
        assert g is not None
        if self.pool is not None and g.state.shared and g.state is not self.pool.state:
            self.next_static = [i for i in g.static_idx if i not in g.sources]
            return "the memory pool was renewed"
        if g.static_idx and [args[i].data_ptr() for i in g.static_idx] != g.static_ptrs:
            return self._moved(g, args)
        self.transient = 0
        # Every group, copied ones too: an output handed out before its group became a copy
        # may still be held, and the replay would overwrite it.
        held = [k for k, grp in enumerate(g.groups) if is_held(grp)]
        if held:
            for k in held:
                g.groups[k].copy = True
                self.copy_leaves.update(g.groups[k].members)
            again = set(held) & self.alive_last
            self.alive_last = set(held)
            if again:
                self.next_static = [i for i in g.static_idx if i not in g.sources]
                return f"output {few(sorted(m for k in again for m in g.groups[k].members))} of a replay still held"
            return ""
        self.alive_last = set()
        clash = pooled_clash(g, args)
        if clash:
            self.unpooled.update(clash)
            self.next_static = [i for i in g.static_idx if i not in g.sources]
            return f"input buffer(s) {few(clash)} in the pool lie where this call's inputs are (now copied outside it)"
        hazards = overwrite_hazards(g, args)
        if hazards:
            # Outputs of another graph in this pool, held by somebody other than this call, where
            # this graph's replay writes: this call runs uncaptured, and their graph hands them
            # out as copies from now on.
            for grp in hazards:
                grp.copy = True
                if grp.copy_leaves is not None:
                    grp.copy_leaves.update(grp.members)
            self.last_reason = f"{len(hazards)} held output(s) of another graph in the pool lie where this one writes"
            return ""
        if g.final or not g.dynamic_idx or self.captures >= MAX_CAPTURES - 1 or self.pool is not None:
            return None  # a shared pool: recapturing for speed would cost every graph a capture
        ptrs = [args[i].data_ptr() for i in g.dynamic_idx]
        g.same_calls = [n + 1 if p == q else 0 for n, p, q in zip(g.same_calls, ptrs, g.dyn_ptrs)]
        g.dyn_ptrs = ptrs
        ready = [i for i, n in zip(g.dynamic_idx, g.same_calls) if n >= PROMOTE_AFTER and i not in self.demoted]
        if ready:
            self.next_static = sorted(g.static_idx + ready)
            return f"input {few(ready)} kept its address for {PROMOTE_AFTER} calls (now read in place)"
        return None

    def _moved(self, g: CapturedGraph, args: list) -> str:
        """Some static input is not where the graph reads it: why to capture again, or "" to run
        uncaptured (its producer, a graph of this pool, ran uncaptured this time)."""
        moved = [i for i, p in zip(g.static_idx, g.static_ptrs) if args[i].data_ptr() != p]
        state = self.pool.state if self.pool is not None else None
        demote, transient = [], []
        for i in moved:
            src = g.sources.get(i)
            if src is None or src.copy:
                demote.append(i)  # a parameter replaced, or its producer hands out copies now
            elif state is not None and state.holds(args[i]):
                pass  # its producer was captured again: read its new address in place
            else:
                transient.append(i)  # its producer ran uncaptured this time
        if transient and not demote and len(transient) == len(moved):
            self.transient += 1
            if self.transient < PROMOTE_AFTER:
                return ""
            demote = transient
        self.transient = 0
        self.demoted.update(demote)
        self.next_static = [i for i in g.static_idx if i not in self.demoted and i not in g.sources]
        return f"input {few(moved)} moved"

    # -- capture -------------------------------------------------------------------------------

    def _state(self, device: torch.device) -> PoolState:
        if self.pool is None:
            return PoolState(self.backend.new_pool(device, False), shared=False)
        if self.pool.state is None:
            state = PoolState(self.backend.new_pool(device, True), shared=True)
            # The first calls' pools hold no tensors once the step's gradients are cleared: give
            # their memory back before the reservation takes the step's worth again.
            self.pool.sizing.released += self.backend.release_cached(device)
            state.keeper = presize(self.pool, lambda nbytes: self.backend.reserve(state.handle, nbytes, device))
            self.pool.state = state
        return self.pool.state

    def _defer(self, refs: list, why: str) -> object:
        """Run this call uncaptured; capture on a later one."""
        self.prev_ptrs = [ptr_of(a) for a in refs]
        self.uncaptured += 1
        self.last_reason = why
        self._set_status(f"capture deferred: {why}")
        return self.run(refs)

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
            if not unclean(state, storage_refs(refs)):
                # Only this call's inputs (a forward's outputs, replayed in a call before this
                # graph's first capture): a private pool of its own, which cannot overlap them.
                state = PoolState(self.backend.new_pool(device, False), shared=False)
            else:  # a new pool; the other graphs follow on their next calls
                self.pool.renew()
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
            if torch._debug_has_internal_overlap(refs[i]) != 0:
                raise ValueError(f"input {i} moves between calls and has overlapping memory (an expanded "
                                 "tensor), so it cannot be copied into a static buffer")
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
            torch._foreach_copy_(list(buffers.values()), [refs[i] for i in held])
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
        slots, groups, container = self._outputs(outputs, weak, stores, final)
        for i in pooled:  # copy targets on the pool's memory, which the allocator may hand out again
            ptr, nbytes = places[i]
            buffers[i] = torch.empty(0, dtype=refs[i].dtype, device=device).set_(
                self.backend.view(ptr, nbytes, device, state), 0, refs[i].shape, refs[i].stride())
        if pooled:  # the first replay follows at once (_first_outputs)
            torch._foreach_copy_([buffers[i] for i in pooled], [refs[i] for i in pooled])
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
            if not self.backend.on_device(leaf):
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
            # The leaves about to be handed out refer to the storage, each once, and so do the
            # bases of those that are views; anything else (the backend, a Python storage object
            # PyTorch keeps) is the baseline.
            holders = {id(leaves[j]) for j in grp.members}
            holders |= {id(leaves[j]._base) for j in grp.members if leaves[j]._is_view()}
            grp.own_base = compat.storage_use_count(grp.own.cdata) - len(holders)
        return slots, groups, container

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
        if g.container is None:
            return out[0]
        return g.container(out)

    # -- replay ----------------------------------------------------------------------------------

    def _views(self, g: CapturedGraph) -> None:
        """Storages on the pool memory of ``g``'s outputs, and one tensor per output on them."""
        for grp in g.groups:
            grp.view = self.backend.view(grp.ptr, grp.nbytes, g.device, g.state)
            for j in grp.members:
                meta = g.slots[j].value
                assert isinstance(meta, torch.Tensor)
                grp.bases[j] = torch.empty(0, dtype=meta.dtype, device=g.device).set_(
                    grp.view, g.slots[j].delta, meta.shape, meta.stride())
            grp.view_base = compat.storage_use_count(grp.view._cdata)

    def _replay(self, args: list) -> object:
        g = self.g
        assert g is not None
        refs = list(args)
        args.clear()
        if g.dynamic_idx:
            torch._foreach_copy_(g.buffers, [refs[i] for i in g.dynamic_idx])
        self.backend.replay(g.graph, refs)
        self.replays += 1
        if g.writeback:
            torch._foreach_copy_([refs[g.dynamic_idx[k]] for k in g.writeback], [g.buffers[k] for k in g.writeback])
        if g.bump:
            compat.set_version_counters([refs[i] for i in g.bump], [refs[i]._version + 1 for i in g.bump])
        if g.groups and g.groups[0].view is None:
            self._views(g)
        leaves: list[object] = []
        copies: dict[int, dict[int, torch.Tensor]] = {}
        for j, s in enumerate(g.slots):
            kind = s.kind
            if kind == "pool":
                grp = g.groups[s.index]
                if grp.copy:
                    if s.index not in copies:
                        assert grp.view is not None
                        copies[s.index] = copy_group(grp, g.slots, grp.view)
                    leaves.append(copies[s.index][j])
                else:
                    leaves.append(grp.bases[j].detach())
            elif kind in ("value", "const"):
                leaves.append(s.value)
            elif kind == "input":
                leaves.append(refs[s.index])
            elif kind == "alias":
                leaves.append(rebase(s.value, refs[s.index], s.delta))  # type: ignore[arg-type]
            elif kind == "same":
                leaves.append(leaves[s.index])
            else:  # empty
                t = s.value
                leaves.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=g.device))  # type: ignore[union-attr]
        if g.container is None:
            return leaves[0]
        return g.container(leaves)

    def _describe(self) -> None:
        g = self.g
        if g is None:
            return
        shared = sum(len(grp.members) for grp in g.groups if not grp.copy)
        copied = sum(len(grp.members) for grp in g.groups if grp.copy)
        parts = [f"captured ({self.captures} capture{'s' if self.captures > 1 else ''}, "
                 f"{'final: everything copied' if g.final else 'replayed from the next call'})",
                 f"{len(g.static_idx)} inputs read in place, {len(g.dynamic_idx)} copied in"]
        if g.writeback:
            parts.append(f"{len(g.writeback)} mutated copied input(s) written back after each replay")
        if g.bump:
            parts.append(f"{len(g.bump)} input(s) mutated in place")
        parts.append(f"outputs: {shared} handed out from the graph's memory, {copied} copied")
        if g.state.shared:
            others = len({id(y.graph) for y in g.state.graphs if y is not g})
            parts.append(f"memory pool shared with the model's training graphs ({others} other graph(s) in it)"
                         if self.pool is None or self.pool.training else "a memory pool of its own")
            sizing = self.pool.describe() if self.pool is not None else ""
            if sizing:
                parts.append(sizing)
        elif self.pool is not None:
            parts.append("a memory pool of its own (its inputs were outputs of replays when it was captured)")
        if self.uncaptured:
            parts.append(f"{self.uncaptured} call(s) ran uncaptured while earlier outputs were held")
        if self.last_reason:
            parts.append(f"last recapture: {self.last_reason}")
        self._set_status("; ".join(parts))
