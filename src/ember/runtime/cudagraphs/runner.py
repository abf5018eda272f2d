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
  them. An output that is (a view of) an input is rebuilt on the caller's tensor; one that is a
  tensor the program itself holds (a constant, a value folded from shapes) is handed out as it is,
  as an uncaptured run does (its references, the program's, are not a caller's). The runner
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
- A graph run several times in one call of the model (one compiled frame per layer, when a
  layer ends in a graph break) gets one runner per call of it: its k-th call of a model call
  runs on ``self.sites[k - 1]``, which captures that call's parameters and activations in place
  (call_sites.py).
- At most ``MAX_CAPTURES`` captures; the last one copies every input in and every output out,
  so it never needs another. A capture that fails runs the program uncaptured from then on
  and says why.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator

import torch

from ember import compat
from ember.config import settings
from ember.runtime.cudagraphs.call_sites import MAX_SITES, CallClock, site_runner
from ember.runtime.cudagraphs.device import CudaBackend
from ember.runtime.cudagraphs.memory import (
    CapturedGraph,
    PoolState,
    broadcast_dims,
    copy_group,
    copy_in,
    few,
    hand_out_fresh,
    held_groups,
    other_leaf,
    overwrite_hazards,
    pooled_clash,
    ptr_of,
)
from ember.runtime.cudagraphs.pool import GraphPool, presize, share_pool  # noqa: F401 - re-exported
from ember.runtime.cudagraphs.recording import MAX_CAPTURES, GraphRecorder  # noqa: F401 - re-exported
from ember.runtime.cudagraphs.rules import (  # noqa: F401 - the decision, re-exported beside the runner
    CAPTURED_KINDS,
    GRAPH_SAFE_RANDOM,
    cudagraph_blocker,
    cudagraphs_enabled,
    training_capture_enabled,
)

aten = torch.ops.aten
_DATA_PTR = torch.Tensor.data_ptr
_COPIED = operator.attrgetter("copy")

def pooled_inputs_enabled() -> bool:
    return settings().pooled_inputs


PROMOTE_AFTER = 3  # calls a copied input must keep its address before it is read in place

# Depth of whole-call captures and warm-ups running (runtime/cudagraphs/whole_call.py): inside one,
# programs run as they are, so the outer capture records their kernels (a graph of their own would
# be replayed inside a capture).
WHOLE_CALL_DEPTH = [0]


@contextlib.contextmanager
def inside_whole_call() -> Iterator[None]:
    WHOLE_CALL_DEPTH[0] += 1
    try:
        yield
    finally:
        WHOLE_CALL_DEPTH[0] -= 1


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


class CudaGraphRunner(GraphRecorder):
    """Runs a boxed program uncaptured on its first call, captures it on the second, replays after."""

    def __init__(self, run: Callable[[list], object], title: str,
                 on_status: Callable[[str], None] | None = None, backend: CudaBackend | None = None,
                 read_only: frozenset[int] = frozenset()) -> None:
        self.run = run
        # The program's parameter-only values (passes/freeze.py), recomputed on the host when a
        # parameter changed: a replay runs none of the program's host code.
        self.refresh_frozen: Callable[..., bool] | None = getattr(run, "refresh_frozen", None)
        self._frozen_for: CapturedGraph | None = None  # the graph _frozen_in_place was worked out for
        self._frozen_in_place = False
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
        self.renewed = False  # this runner renewed the pool once: a second time it captures alone
        self.last_reason = ""
        self.disabled: str | None = None
        self.device = torch.device("cuda")
        # Set by ember.data.prefetch(..., into=model) (data/graph_inputs.py): picks the runner of
        # this program that reads the batch's buffers in place; None: this one runs the call.
        self.route: Callable[[CudaGraphRunner, list], CudaGraphRunner | None] | None = None
        # Calls of the compiled model (runtime/cudagraphs/call_sites.py): the k-th call of this
        # program within one runs on self.sites[k - 1], a graph of its own.
        self.clock: CallClock | None = None
        self.epoch = 0
        self.site = 0
        self.sites: list[CudaGraphRunner] = []
        self._set_status("waiting for the second call, which is captured and replayed after")

    def _set_status(self, text: str) -> None:
        self.status = text
        if self.on_status is not None:
            self.on_status(text)

    def __call__(self, args: list) -> object:
        if WHOLE_CALL_DEPTH[0]:
            return self.run(args)
        if self.route is not None and (other := self.route(self, args)) is not None:
            return other(args)
        clock = self.clock
        if clock is not None and clock.calls and self.disabled is None:
            if clock.calls != self.epoch:
                self.epoch, self.site = clock.calls, 0
            else:
                self.site = k = self.site + 1
                if k < MAX_SITES:
                    if k > len(self.sites):
                        self.sites.append(site_runner(self, k))
                    return self.sites[k - 1](args)
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
                if self.refresh_frozen is not None:
                    # Parameter-only values live as long as the model, like its parameters: made in
                    # the first call they stayed in its private pool for good (with the pool's
                    # slack) and counted in the graph pool's measured need (bert batch 1 on the
                    # H100: 167 MiB of bf16 weights in a 222 MiB first-call pool, and a 213 MiB
                    # graph pool for a call whose activations are below 1 MiB).
                    self.refresh_frozen(args)
                # The first calls of the model's graphs measure what its pool will need.
                self.pool.sizing.begin(self.backend.memory_counters(device))
                with self.backend.first_call_pool(device):
                    out = self.run(args)
                self.pool.sizing.end(self.backend.memory_counters(device))
                self.pool.sizing.released += self.backend.release_cached(device)  # (runtime/cudagraphs/pool.py)
                return out
            if self.refresh_frozen is not None:
                self.refresh_frozen(args)  # not inside the capture: replays would recompute them
            return self._capture(args, "")
        why = self._check(args)
        # After the check: a replay's parameters are where they were, so only versions are read.
        if self.refresh_frozen is not None and self.refresh_frozen(args, why is None and self._frozen_static()):
            if not why:  # a replay or an uncaptured call would read the old values' addresses
                self.next_static = [i for i in self.g.static_idx if i not in self.g.sources]
                why = "values computed from parameters moved (a parameter was replaced)"
        if why is None:
            return self._replay(args)
        if not why:
            self.uncaptured += 1
            self._describe()
            return self.run(args)
        return self._capture(args, why)

    # -- deciding whether this call may replay ----------------------------------------------

    def _frozen_static(self) -> bool:
        """Whether every input of the program's parameter-only values is one the graph reads in
        place (its address checked before each replay)."""
        g = self.g
        if self._frozen_for is not g:
            inputs = getattr(self.refresh_frozen, "inputs", None)
            self._frozen_for = g
            self._frozen_in_place = inputs is not None and g is not None and set(inputs) <= set(g.static_idx)
        return self._frozen_in_place

    def _check(self, args: list) -> str | None:
        """None: replay. "": run uncaptured (outputs held). Otherwise: why to capture again (the
        inputs to read in place are left in ``self.next_static``)."""
        g = self.g
        assert g is not None
        if self.pool is not None and g.state.shared and g.state is not self.pool.state:
            self.next_static = [i for i in g.static_idx if i not in g.sources]
            return "the memory pool was renewed"
        if g.static_idx and list(map(_DATA_PTR, g.pick_static(args))) != g.static_ptrs:
            return self._moved(g, args)
        self.transient = 0
        if g.expanded:
            spread = [i for i, b in zip(g.dynamic_idx, g.buffers)
                      if set(broadcast_dims(b)) - set(broadcast_dims(args[i]))]
            if spread:  # the buffer holds one element where this input has many
                self.next_static = [i for i in g.static_idx if i not in g.sources]
                return f"input {few(spread)} is no longer expanded as when captured"
        # Every group, copied ones too: an output handed out before its group became a copy
        # may still be held, and the replay would overwrite it.
        held = held_groups(g)
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

    def _replay(self, args: list) -> object:
        g = self.g
        assert g is not None
        refs = list(args)
        args.clear()
        if g.dynamic_idx:
            if g.expanded:
                copy_in(g.buffers, [refs[i] for i in g.dynamic_idx])
            else:
                torch._foreach_copy_(g.buffers, [refs[i] for i in g.dynamic_idx])
        self.backend.replay(g.graph, refs)
        self.replays += 1
        if g.writeback:
            torch._foreach_copy_([refs[g.dynamic_idx[k]] for k in g.writeback], [g.buffers[k] for k in g.writeback])
        if g.bump:
            compat.set_version_counters([refs[i] for i in g.bump], [refs[i]._version + 1 for i in g.bump])
        if g.groups and g.groups[0].view is None:
            self._views(g)
        none_copied = not any(map(_COPIED, g.groups))
        g.state.hand_out(g.groups, none_copied)
        if none_copied:
            leaves = hand_out_fresh(g, refs)
            if g.container is None:
                return leaves[0]
            return g.container(leaves)
        leaves: list[object] = []
        copies: dict[int, dict[int, torch.Tensor]] = {}
        for j, s in enumerate(g.slots):
            if s.kind != "pool":
                leaves.append(other_leaf(g, s, refs, leaves))
                continue
            grp = g.groups[s.index]
            if grp.copy:
                if s.index not in copies:
                    assert grp.view is not None
                    copies[s.index] = copy_group(grp, g.slots, grp.view)
                leaves.append(copies[s.index][j])
            else:
                leaves.append(grp.bases[j].detach())
        if g.container is None:
            return leaves[0]
        return g.container(leaves)

    def describe_sites(self) -> None:
        """A site runner's status changed: this runner's status counts its sites' captures."""
        if self.g is not None:
            self._describe()

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
        if self.sites:
            captured = sum(1 for s in self.sites if s.g is not None)
            parts.append(f"runs {len(self.sites) + 1} times per call of the model: one graph per call "
                         f"({captured} of the other {len(self.sites)} captured)")
        if self.last_reason:
            parts.append(f"last recapture: {self.last_reason}")
        self._set_status("; ".join(parts))
