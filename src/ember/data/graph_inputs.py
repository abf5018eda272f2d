"""Batches copied straight into what a replayed CUDA graph reads: ``prefetch(loader, into=model)``.

Without ``into``, a prefetched batch is a new device tensor each step; Ember's CUDA-graph
runner (runtime/cudagraphs/runner.py) sees its address move and copies it into the graph's
input buffer before each replay, on the step's stream. With ``into=compiled_model`` the
prefetcher owns two sets of device buffers (*slots*) shaped like the batch and copies batch
N into slot N % 2 on its side stream; every CUDA-graph runner of the model gets a ``route``
that sends each call to a child runner per slot. A child sees its slot at the same address
on every call, so by the runner's own rule it captures a graph that reads the slot in place:
two captures per graph (slot 0, slot 1), replayed alternately, and no copy-in.

Why two slots and two captures: a graph reads its inputs at a time the host does not know,
and in training the backward reads the batch again (a saved input). With one buffer, the copy
of batch N+1 could only start once step N is done, so the host-to-device copy would run
between the steps instead of beside them. With two, the copy of N+1 into the other slot
overlaps step N.

The rules that keep it correct:

- A slot is written only after the step that read it is done: when the loop takes batch N+1
  (``next()``), slot N % 2 is released with an event recorded on the loop's current stream
  (everything the loop enqueued for batch N is before it); the side stream waits for that
  event before copying batch N+2 into that slot. On the CPU the loop's work is synchronous.
- Nothing reads a half-written slot: ``next()`` makes the loop's stream wait for the copy's
  event, as for any prefetched batch.
- A batch whose structure, shapes, strides or dtypes differ from the first one's (a last
  partial batch) is delivered as a new tensor and runs through the model's runners as before.
- Correctness never depends on the routing: each child is a complete runner that checks every
  address on every call and copies or captures again when a tensor is not where its graph
  reads. Routing decides only which graph can read in place.
- The contract that changes: a batch delivered in a slot is valid until the loop takes the
  next batch (the next-but-one overwrites it), like a CUDA graph's outputs. Keep a
  ``.clone()`` of what must live longer. A slot still held when a new pass starts is left to
  its holder and a new one is made.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ember.data.tree import map_tensors, tensors_of

SLOTS = 2  # one the step reads, one the next batch is copied into

_MISSING = object()


def _signature(batch: Any) -> tuple:
    """What must match for a batch to go into the slots: every tensor's shape, strides, dtype."""
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors_of(batch))


class GraphInputSlots:
    """Two sets of device tensors shaped like one batch, written alternately by the prefetcher.

    The producer thread ``acquire``s a free slot, copies a batch into it and hands it out; the
    loop ``release``s it when it takes the next batch. At most one iterator writes at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sets: list[list[torch.Tensor]] | None = None
        self.signature: tuple | None = None  # of the device batch the slots hold
        self.ptrs: list[frozenset[int]] = []  # per slot: addresses of its tensors
        self.all_ptrs: frozenset[int] = frozenset()
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS  # released after this event
        self.enabled = False  # set once the target has a CUDA-graph runner to route
        self.unusable = False  # the batch cannot be read in place (a tensor elsewhere, or expanded)
        self.in_flight: int | None = None  # the slot of the batch the loop holds now
        self.written = 0  # batches copied into slots
        self.fresh = 0  # batches delivered as new tensors (no runner yet, or a different shape)
        self.renewed = 0  # slots left to a holder at the start of a pass
        self._free: list[int] = list(range(SLOTS))
        self._cond = threading.Condition()
        self._owner: object | None = None
        self._handed: list[list[weakref.ref]] = [[] for _ in range(SLOTS)]

    # -- ownership: one pass at a time -------------------------------------------------------

    def claim(self, owner: object) -> bool:
        """Whether ``owner`` (an iterator) may write the slots; False while another pass runs."""
        with self._cond:
            if self._owner is not None:
                return False
            self._owner = owner
            self._free = list(range(SLOTS))
            self.in_flight = None
        held = self.sets is not None and any(self._held(k) for k in range(SLOTS))
        if held:
            # A batch reachable only from a reference cycle the collector has not reached yet is
            # not held: collect once before giving the slots (and the graphs reading them) up.
            gc.collect()
            held = any(self._held(k) for k in range(SLOTS))
        if held:
            self.sets = None  # the next batch allocates new ones; the held ones stay the holder's
            self.signature = None
            self.renewed += 1
        return True

    def disown(self, owner: object) -> None:
        with self._cond:
            if self._owner is owner:
                self._owner = None
                self.in_flight = None
                self._cond.notify_all()

    def _held(self, k: int) -> bool:
        """Whether a tensor handed out in slot ``k`` (each batch gets new tensor objects on the
        slot's memory) is still alive: its holder keeps it, it is not ours to overwrite."""
        return any(ref() is not None for ref in self._handed[k])

    # -- producer side ------------------------------------------------------------------------

    def acquire(self, stop: threading.Event, poll_s: float = 0.05) -> int | None:
        """A free slot (the oldest released), or None when the pass stops meanwhile."""
        with self._cond:
            while not self._free:
                if stop.is_set():
                    return None
                self._cond.wait(poll_s)
            return self._free.pop(0)

    def give_back(self, k: int) -> None:
        """A slot acquired but not handed to the loop (a pass stopped): free again at once."""
        with self._cond:
            if k not in self._free:
                self._free.append(k)
                self._cond.notify_all()

    def fits(self, batch: Any) -> bool:
        return self.signature is None or _signature(batch) == self.signature

    def make(self, batch: Any) -> bool:
        """Allocate both slot sets like ``batch`` (a device batch); False when a tensor of it
        cannot be a graph's static input (not on the device, or expanded: overlapping memory)."""
        tensors = list(tensors_of(batch))
        if not tensors or any(t.device != self.device or torch._debug_has_internal_overlap(t) != 0 for t in tensors):
            self.unusable = True
            return False
        self.sets = [[torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors]
                     for _ in range(SLOTS)]
        self.signature = _signature(batch)
        self.ptrs = [frozenset(t.data_ptr() for t in s if t.numel()) for s in self.sets]
        self.all_ptrs = frozenset().union(*self.ptrs)
        return True

    def fill(self, k: int, batch: Any, sources: list[torch.Tensor]) -> Any:
        """Copy ``sources`` (one per tensor of ``batch``, in order) into slot ``k``; returns
        ``batch`` with each tensor replaced by a new tensor on the slot's memory."""
        assert self.sets is not None
        targets = self.sets[k]
        for dst, src in zip(targets, sources):
            if src is not dst:
                dst.copy_(src, non_blocking=src.device.type == "cpu" and src.is_pinned())
        handed = [t.detach() for t in targets]  # new tensors on the slot's memory
        self._handed[k] = [weakref.ref(t) for t in handed]
        self.written += 1
        return map_tensors(lambda _, it=iter(handed): next(it), batch)

    def wait_released(self, k: int, stream: torch.cuda.Stream | None) -> None:
        """Order the writes into slot ``k`` on ``stream`` after the step that last read it."""
        event = self.events[k]
        if stream is not None and event is not None:
            stream.wait_event(event)

    # -- loop side ----------------------------------------------------------------------------

    def release(self, k: int, stream: torch.cuda.Stream | None) -> None:
        """The loop is done enqueuing work on slot ``k`` (it took the next batch)."""
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.events[k] = event
        with self._cond:
            if self.in_flight == k:
                self.in_flight = None
            if k not in self._free:
                self._free.append(k)
            self._cond.notify_all()

    def describe(self) -> str:
        if self.sets is None:
            return "direct copy into the graph's inputs: no slots yet"
        nbytes = sum(t.untyped_storage().nbytes() for s in self.sets for t in s)
        return (f"direct copy into the graph's inputs: {SLOTS} slots ({nbytes / 2**20:,.1f} MiB), "
                f"{self.written} batches written into them, {self.fresh} delivered as new tensors")


def runners_of(target: Any) -> list[Any] | None:
    """The CUDA-graph runners of ``target`` as they are now: an ``ember.compile`` result (its
    backend's programs), an ``EmberBackend``, one ``CudaGraphRunner`` or a list of them. None:
    ``target`` is none of these."""
    from ember.runtime.cudagraphs.runner import CudaGraphRunner

    if isinstance(target, CudaGraphRunner):
        return [target]
    if isinstance(target, (list, tuple)) and all(isinstance(r, CudaGraphRunner) for r in target):
        return list(target)
    backend = getattr(target, "_ember_backend", target)
    programs = getattr(backend, "programs", None)
    if programs is None:
        return None
    return [graph.run for _, graph in programs if isinstance(getattr(graph, "run", None), CudaGraphRunner)]


class SlotRouter:
    """Sends each call of a target's CUDA-graph runners to the child runner of the slot the
    loop's batch is in (made on first use; it shares the parent's program, device and pool)."""

    def __init__(self, slots: GraphInputSlots, target: Any) -> None:
        self.slots = slots
        self.target = target
        self.runners: dict[int, Any] = {}  # id -> attached runner (kept alive here)
        self.children: dict[tuple[int, int], Any] = {}  # (runner id, slot) -> child runner
        self.batch_args: dict[int, list[int]] = {}  # runner id -> argument positions that held a slot
        self.skipped: list[str] = []
        self._seen = -1

    def refresh(self) -> bool:
        """Attach to runners made since the last look (graphs compile on the model's first calls);
        whether any runner is attached."""
        programs = getattr(getattr(self.target, "_ember_backend", self.target), "programs", None)
        if programs is not None:
            if len(programs) == self._seen:
                return bool(self.runners)
            self._seen = len(programs)
        for runner in runners_of(self.target) or []:
            if id(runner) in self.runners:
                continue
            route = getattr(runner, "route", _MISSING)
            if route is _MISSING:
                continue
            if route is not None and getattr(route, "__self__", None) is not self:
                self.skipped.append(f"{runner.title}: another prefetcher already routes it")
                continue
            runner.route = self.route
            self.runners[id(runner)] = runner
        return bool(self.runners)

    def route(self, runner: Any, args: list) -> Any:
        k = self.slots.in_flight
        if k is None or runner.disabled is not None:
            return None
        key = id(runner)
        where = self.batch_args.get(key)
        if where is None:  # learned once per runner: a backward that does not read the batch has none
            where = self.batch_args[key] = [i for i, a in enumerate(args)
                                            if isinstance(a, torch.Tensor) and a.data_ptr() in self.slots.all_ptrs]
        ptrs = self.slots.ptrs[k]
        for i in where:
            a = args[i] if i < len(args) else None
            if not isinstance(a, torch.Tensor) or a.data_ptr() not in ptrs:
                return None  # not this slot's batch (a call with other data): the runner as before
        child = self.children.get((key, k))
        if child is None:
            child = self.children[(key, k)] = _child(runner, k)
        return child

    def forget(self) -> None:
        """New slots (the old ones were left to a holder): new children capture graphs that read
        them; the old children's graphs are replayed no more."""
        for child in self.children.values():
            if child.g is not None:
                child.g.state.retire(child.g)
        self.children.clear()

    def detach(self) -> None:
        for runner in self.runners.values():
            if getattr(runner.route, "__self__", None) is self:
                runner.route = None
        self.runners.clear()


def _child(parent: Any, k: int) -> Any:
    from ember.runtime.cudagraphs.runner import CudaGraphRunner

    on_status: Callable[[str], None] | None = None
    if parent.on_status is not None:
        tell = parent.on_status

        def on_status(text: str) -> None:
            tell(f"prefetch slot {k}: {text}")
    child = CudaGraphRunner(parent.run, f"{parent.title} [prefetch slot {k}]", on_status=on_status,
                            backend=parent.backend, read_only=parent.read_only)
    child.pool = parent.pool  # a training graph's children share the model's pool, like its graphs
    child.clock = parent.clock  # and run one graph per call of a step, like it (call_sites.py)
    return child


def whole_step_note(target: Any) -> str | None:
    """Why ``into=`` cannot write into ``target``'s inputs, for a whole-step training program."""
    if getattr(target, "_ember_whole_step", False):
        return ("prefetch(into=...) of a whole-step program (ember.compile_step) is not built: each capture of "
                "the step allocates its gradients in the graph's pool, so a second capture for the second "
                "slot would hold a second set of gradients (or zero them every step); batches are copied "
                "into the step's static inputs as before")
    return None


def warn_once(note: str, seen: set[str] = set()) -> None:  # noqa: B006 - a process-wide once
    if note not in seen:
        seen.add(note)
        warnings.warn(f"ember.data.prefetch: {note}", RuntimeWarning, stacklevel=4)
