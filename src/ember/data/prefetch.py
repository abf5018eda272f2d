"""Device prefetching: the next batches reach the device while the current step runs.

    for x, y in ember.data.prefetch(loader, device="cuda", dtype=torch.bfloat16,
                                    normalize=(mean, std), channels_last=True):
        step(x, y)

Each ``iter()`` starts one background thread (per epoch, like a DataLoader iterator) that takes
batches from the loader, pins their host tensors, enqueues their copies to the device on a side
CUDA stream, applies the on-device transforms there, records an event, and puts the batch in a
queue that holds at most ``depth`` ready batches. ``next()`` takes the oldest, makes the
consumer's current stream wait for its event (no use before the copy ends) and calls
``record_stream`` on its tensors for the consumer stream (the allocator keeps their memory until
the consumer's work on them is done, although they were allocated on the side stream). On a CPU
device the same thread stays ``depth`` batches ahead and applies the transforms, so the loop is
tested in CI exactly as it runs on a GPU, minus the streams.

Guarantees: batches come out in the loader's order, each once; an exception raised by the loader
(or by a transform) is raised by ``next()`` at the position of the batch that raised it, the same
exception object (type, message and the loader's traceback); the thread ends and the iterator
lets go of the loader's iterator on exhaustion, on an error, on ``close()``, on ``break`` (the
iterator is collected) and at garbage collection.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ember.data.graph_inputs import GraphInputSlots, SlotRouter, runners_of, warn_once, whole_step_note
from ember.data.tree import map_tensors, tensors_of

__all__ = ["DevicePrefetcher", "PrefetchIterator", "PrefetchStats", "prefetch", "resolve_device"]

_BATCH, _END, _ERROR = "batch", "end", "error"
_POLL_S = 0.05  # how often a producer blocked on a full queue looks for a stop request
_JOIN_TIMEOUT_S = 60.0  # close() waits this long for a loader call in progress to return

Normalize = tuple[Sequence[float] | torch.Tensor, Sequence[float] | torch.Tensor]


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """``None``/"auto": this process's current CUDA device if there is one, else the CPU. A bare
    "cuda" also means the current device, so a DDP process that called
    ``torch.cuda.set_device(local_rank)`` gets its own GPU."""
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _is_image(t: torch.Tensor) -> bool:
    return t.dim() == 4 and (t.is_floating_point() or t.dtype == torch.uint8)


class _Stage:
    """One host batch -> one device batch: pin, copy, dtype, normalisation, channels_last, then
    the user's transform. Runs in the producer thread; on CUDA inside the side stream."""

    def __init__(self, device: torch.device, transform: Callable[[Any], Any] | None, channels_last: bool,
                 dtype: torch.dtype | None, normalize: Normalize | None, pin_memory: bool | None) -> None:
        self.device = device
        self.transform = transform
        self.channels_last = channels_last
        self.dtype = dtype
        self.normalize = normalize
        self.pin = device.type == "cuda" if pin_memory is None else pin_memory
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._mean_std: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.slots: GraphInputSlots | None = None  # into=: the graph input slots this pass writes
        # Nothing but the copy to the device: a host batch can go straight into a slot.
        self.copy_only = transform is None and not channels_last and dtype is None and normalize is None

    def __call__(self, batch: Any, stop: threading.Event) -> tuple[Any, torch.cuda.Event | None, int | None] | None:
        """(device batch, its event, its slot or None); None: the pass stopped while waiting for a slot."""
        if self.stream is None:
            return self._staged(batch, stop)
        with torch.cuda.device(self.device):
            if any(t.device.type == "cuda" for t in tensors_of(batch)):
                # Device tensors made by the loader (a GPU decode) on this thread's stream: the
                # transforms read them on the side stream, after they are written.
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staged = self._staged(batch, stop)
        return staged

    def _staged(self, batch: Any, stop: threading.Event) -> tuple[Any, torch.cuda.Event | None, int | None] | None:
        slots = self.slots
        if slots is None or not slots.enabled:
            if slots is not None:
                slots.fresh += 1
            return self._event(self._apply(batch), None)
        if slots.sets is not None and self.copy_only and slots.fits(batch):
            sources = [self._pinned(t) for t in tensors_of(batch)]  # straight from the host into the slot
            out = batch
        else:
            out = self._apply(batch)
            if slots.sets is None and not slots.make(out):
                slots.enabled = False  # not a batch a graph can read in place: new tensors, as without into
            if not slots.enabled or not slots.fits(out):
                slots.fresh += 1
                return self._event(out, None)
            sources = list(tensors_of(out))
        k = slots.acquire(stop)
        if k is None:
            return None
        slots.wait_released(k, self.stream)  # the step that read slot k is done with it
        return self._event(slots.fill(k, out, sources), k)

    def _event(self, out: Any, slot: int | None) -> tuple[Any, torch.cuda.Event | None, int | None]:
        if self.stream is None:
            return out, None, slot
        event = torch.cuda.Event()
        event.record(self.stream)
        return out, event, slot

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and self.device.type == "cuda" and not t.is_pinned():
            return t.pin_memory()
        return t

    def _apply(self, batch: Any) -> Any:
        out = map_tensors(self._tensor, batch)
        return self.transform(out) if self.transform is not None else out

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            if self.pin and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            t = t.to(self.device, non_blocking=t.device.type == "cpu" and t.is_pinned())
        image = _is_image(t)
        target = self.dtype if self.dtype is not None and (t.is_floating_point() or image) else None
        if image and self.normalize is not None:
            # In float32 (or the tensor's own float type), then to the target dtype once.
            work = t.dtype if t.is_floating_point() and t.dtype != torch.float16 else torch.float32
            mean, inv_std = self._constants(work, t.shape[1])
            t = torch.sub(t.to(work), mean).mul_(inv_std)
        if target is not None and t.dtype != target:
            t = t.to(target)
        if image and self.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def _constants(self, dtype: torch.dtype, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._mean_std:
            assert self.normalize is not None
            mean, std = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in self.normalize)
            if mean.numel() not in (1, channels) or std.numel() not in (1, channels):
                raise ValueError(f"normalize: mean and std need 1 or {channels} values (one per channel), "
                                 f"got {mean.numel()} and {std.numel()}")
            shape = (1, -1, 1, 1)
            self._mean_std[dtype] = (mean.reshape(shape).to(self.device, dtype),
                                     (1.0 / std).reshape(shape).to(self.device, dtype))
        return self._mean_std[dtype]


class PrefetchStats:
    """What the producer thread measured per batch, in seconds: ``fetch`` the time in the loader's
    ``next()`` (the batch's cost to the loop when nothing overlaps it), ``stage`` the host time to
    pin, enqueue the copies and the transforms."""

    def __init__(self) -> None:
        self.fetch: list[float] = []
        self.stage: list[float] = []


def _put(out: queue.Queue, stop: threading.Event, item: tuple[str, Any]) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, stage: _Stage, out: queue.Queue, stop: threading.Event, stats: PrefetchStats) -> None:
    # Holds no reference to the PrefetchIterator: dropping that collects it and stops this thread.
    if stage.stream is not None:
        _produce_batches(source, stage, out, stop, stats)
        return
    # CPU device: the step's intra-op threads already use every core. A tensor op in this thread
    # (a DataLoader's collate, a resize in the dataset, the transforms) would start a second
    # OpenMP team beside theirs; on 2 cores that made a resnet18 step 60 -> 91 ms. One thread
    # here (OpenMP's setting is per thread: the step keeps its own), restored on exit.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _produce_batches(source, stage, out, stop, stats)
    finally:
        torch.set_num_threads(saved)


def _produce_batches(source: Iterator, stage: _Stage, out: queue.Queue, stop: threading.Event,
                     stats: PrefetchStats) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            batch = next(source)
        except StopIteration:
            _put(out, stop, (_END, None))
            return
        except BaseException as err:  # noqa: BLE001 - handed to the consumer as it is
            _put(out, stop, (_ERROR, err))
            return
        t1 = time.perf_counter()
        try:
            staged = stage(batch, stop)
        except BaseException as err:  # noqa: BLE001
            _put(out, stop, (_ERROR, err))
            return
        del batch
        if staged is None:  # stopped while waiting for a free slot
            return
        stats.fetch.append(t1 - t0)
        stats.stage.append(time.perf_counter() - t1)
        if not _put(out, stop, (_BATCH, staged)):
            if staged[2] is not None and stage.slots is not None:
                stage.slots.give_back(staged[2])
            return
        del staged


def _drain(q: queue.Queue) -> list[int]:
    """Empty the queue; the slots of the batches in it."""
    slots = []
    while True:
        try:
            kind, value = q.get_nowait()
        except queue.Empty:
            return slots
        if kind == _BATCH and value[2] is not None:
            slots.append(value[2])


class _Held:
    """The slot of the batch the loop holds, and the loop's stream (for the finalizer)."""

    def __init__(self) -> None:
        self.slot: int | None = None
        self.stream: torch.cuda.Stream | None = None


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread,
              stream: torch.cuda.Stream | None, slots: GraphInputSlots | None = None,
              held: _Held | None = None, owner: object = None) -> None:
    stop.set()
    unused = _drain(q)  # wakes a producer blocked on a full queue
    if thread is not threading.current_thread():
        thread.join(_JOIN_TIMEOUT_S)
    unused += _drain(q)
    if stream is not None:
        stream.synchronize()  # no copy of ours is left running into memory about to be reused
    if slots is not None and held is not None:
        for k in unused:
            slots.give_back(k)
        if held.slot is not None:
            slots.release(held.slot, held.stream)
            held.slot = None
        slots.disown(owner)


class PrefetchIterator(Iterator):
    """One pass over the loader, ``depth`` batches ahead (made by ``iter(DevicePrefetcher)``)."""

    def __init__(self, source: Iterable, stage: _Stage, depth: int, router: SlotRouter | None = None) -> None:
        self.device = stage.device
        self.depth = depth
        self.stats = PrefetchStats()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._held = _Held()
        self._router = router
        self._slots: GraphInputSlots | None = None
        owner = object()
        if router is not None and router.slots.claim(owner):
            self._slots = stage.slots = router.slots
            if router.slots.sets is None and router.children:
                router.forget()  # the slots were left to a holder: new ones, new graphs
            self._slots.enabled = router.refresh()
        elif router is not None:
            warn_once("another pass over this prefetcher is running: this one copies into new tensors")
        # iter() in the caller's thread: a DataLoader starts its workers (and installs its signal
        # handler, which only the main thread may) here, and an error in iter() raises here.
        source_iter = iter(source)
        self._thread = threading.Thread(target=_produce, name="ember-prefetch", daemon=True,
                                        args=(source_iter, stage, self._queue, self._stop, self.stats))
        del source_iter
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread, stage.stream,
                                           self._slots, self._held, owner)
        self._finalizer.atexit = False  # at interpreter exit the daemon thread just stops

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        slots = self._slots
        if slots is not None:
            self._release()  # the loop enqueued all its work on the batch it held
            if self._router is not None and not slots.unusable:
                slots.enabled = self._router.refresh()  # the model's graphs compile on its first calls
        kind, value = self._queue.get()
        if kind == _BATCH:
            batch, event, slot = value
            if slots is not None:
                self._held.slot = slots.in_flight = slot
            if event is not None:
                consumer = self._held.stream = torch.cuda.current_stream(self.device)
                consumer.wait_event(event)
                for t in tensors_of(batch):
                    if t.device == self.device:
                        t.record_stream(consumer)
            return batch
        self._done = True
        self.close()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop the thread and drop the batches it made ahead (also done on exhaustion, on an
        error and when the iterator is collected)."""
        self._done = True
        if self._slots is not None:
            self._release()
        self._finalizer()

    def _release(self) -> None:
        held = self._held
        if held.slot is not None and self._slots is not None:
            held.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            self._slots.release(held.slot, held.stream)
            held.slot = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class DevicePrefetcher:
    """Wraps any iterable of batches (a ``torch.utils.data.DataLoader`` unchanged, a generator, a
    list); iterating it yields the same batches on ``device``, copied ahead. See ``prefetch``."""

    def __init__(self, loader: Iterable, device: str | int | torch.device | None = None, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None, channels_last: bool = False,
                 dtype: torch.dtype | None = None, normalize: Normalize | None = None,
                 pin_memory: bool | None = None, into: Any = None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"prefetch dtype must be a floating-point dtype, got {dtype}")
        self.loader = loader
        self.device = resolve_device(device)
        self.depth = depth
        self.transform = transform
        self.channels_last = channels_last
        self.dtype = dtype
        self.normalize = normalize
        self.pin_memory = pin_memory
        self._last: weakref.ref[PrefetchIterator] | None = None
        # into=: batches go into two slots that the model's CUDA graphs read in place (graph_inputs.py).
        self.router: SlotRouter | None = None
        self.into_note: str | None = None
        if into is not None:
            self.into_note = whole_step_note(into)
            if self.into_note is not None:
                warn_once(self.into_note)
            elif runners_of(into) is None:
                raise TypeError("prefetch(into=...) takes a model made by ember.compile (or its CUDA-graph "
                                f"runners), got {type(into).__name__}")
            else:
                self.router = SlotRouter(GraphInputSlots(self.device), into)

    @property
    def slots(self) -> GraphInputSlots | None:
        """The graph input slots of ``into=`` (None without it)."""
        return self.router.slots if self.router is not None else None

    def __iter__(self) -> PrefetchIterator:
        stage = _Stage(self.device, self.transform, self.channels_last, self.dtype, self.normalize, self.pin_memory)
        it = PrefetchIterator(self.loader, stage, self.depth, self.router)
        self._last = weakref.ref(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def last_iterator(self) -> PrefetchIterator | None:
        """The iterator of the latest pass, while it is alive (its ``stats``)."""
        return self._last() if self._last is not None else None

    def __repr__(self) -> str:
        return (f"DevicePrefetcher(device={self.device}, depth={self.depth}, dtype={self.dtype}, "
                f"channels_last={self.channels_last}, normalize={self.normalize is not None}, "
                f"into={self.router is not None})")


def prefetch(loader: Iterable, device: str | int | torch.device | None = None, depth: int = 2,
             transform: Callable[[Any], Any] | None = None, channels_last: bool = False,
             dtype: torch.dtype | None = None, normalize: Normalize | None = None,
             pin_memory: bool | None = None, into: Any = None) -> DevicePrefetcher:
    """Iterate ``loader``'s batches on ``device``, ``depth`` batches ahead.

    ``loader``: any iterable of batches: tensors, or tuples, lists, dicts, named tuples and
    dataclasses of them, nested; other leaves pass through. ``device``: "cuda", "cuda:1", an
    index, "cpu", or None/"auto" (the current CUDA device, else the CPU; under DDP call
    ``torch.cuda.set_device(local_rank)`` first, one loader and one prefetcher per process).
    Host tensors are pinned (``pin_memory=False`` turns that off) and copied on a side stream.

    On-device transforms, in this order, on the side stream: ``dtype`` converts floating-point
    tensors and uint8 images (4-D) to that floating dtype (integer tensors such as labels are
    kept); ``normalize=(mean, std)`` computes ``(x - mean) / std`` per channel (dim 1) of every
    4-D image, in the units of the loader's values (uint8 images: 0-255 scale), in float32,
    before the dtype conversion; ``channels_last`` makes images channels_last; ``transform``
    (a callable) gets the whole batch last.

    ``into=model`` (a model made by ``ember.compile``): the batches are copied into two sets of
    device buffers that the model's CUDA graphs read in place, so a replay copies no input
    (graph_inputs.py). A batch is then valid until the loop takes the next one.
    """
    return DevicePrefetcher(loader, device=device, depth=depth, transform=transform, channels_last=channels_last,
                            dtype=dtype, normalize=normalize, pin_memory=pin_memory, into=into)
