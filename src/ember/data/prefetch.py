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

    def __call__(self, batch: Any) -> tuple[Any, torch.cuda.Event | None]:
        if self.stream is None:
            return self._apply(batch), None
        with torch.cuda.device(self.device):
            if any(t.device.type == "cuda" for t in tensors_of(batch)):
                # Device tensors made by the loader (a GPU decode) on this thread's stream: the
                # transforms read them on the side stream, after they are written.
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                out = self._apply(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        return out, event

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
            staged = stage(batch)
        except BaseException as err:  # noqa: BLE001
            _put(out, stop, (_ERROR, err))
            return
        del batch
        stats.fetch.append(t1 - t0)
        stats.stage.append(time.perf_counter() - t1)
        if not _put(out, stop, (_BATCH, staged)):
            return
        del staged


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread,
              stream: torch.cuda.Stream | None) -> None:
    stop.set()
    _drain(q)  # wakes a producer blocked on a full queue
    if thread is not threading.current_thread():
        thread.join(_JOIN_TIMEOUT_S)
    _drain(q)
    if stream is not None:
        stream.synchronize()  # no copy of ours is left running into memory about to be reused


class PrefetchIterator(Iterator):
    """One pass over the loader, ``depth`` batches ahead (made by ``iter(DevicePrefetcher)``)."""

    def __init__(self, source: Iterable, stage: _Stage, depth: int) -> None:
        self.device = stage.device
        self.depth = depth
        self.stats = PrefetchStats()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        # iter() in the caller's thread: a DataLoader starts its workers (and installs its signal
        # handler, which only the main thread may) here, and an error in iter() raises here.
        source_iter = iter(source)
        self._thread = threading.Thread(target=_produce, name="ember-prefetch", daemon=True,
                                        args=(source_iter, stage, self._queue, self._stop, self.stats))
        del source_iter
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread, stage.stream)
        self._finalizer.atexit = False  # at interpreter exit the daemon thread just stops

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _BATCH:
            batch, event = value
            if event is not None:
                consumer = torch.cuda.current_stream(self.device)
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
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class DevicePrefetcher:
    """Wraps any iterable of batches (a ``torch.utils.data.DataLoader`` unchanged, a generator, a
    list); iterating it yields the same batches on ``device``, copied ahead. See ``prefetch``."""

    def __init__(self, loader: Iterable, device: str | int | torch.device | None = None, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None, channels_last: bool = False,
                 dtype: torch.dtype | None = None, normalize: Normalize | None = None,
                 pin_memory: bool | None = None) -> None:
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

    def __iter__(self) -> PrefetchIterator:
        stage = _Stage(self.device, self.transform, self.channels_last, self.dtype, self.normalize, self.pin_memory)
        it = PrefetchIterator(self.loader, stage, self.depth)
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
                f"channels_last={self.channels_last}, normalize={self.normalize is not None})")


def prefetch(loader: Iterable, device: str | int | torch.device | None = None, depth: int = 2,
             transform: Callable[[Any], Any] | None = None, channels_last: bool = False,
             dtype: torch.dtype | None = None, normalize: Normalize | None = None,
             pin_memory: bool | None = None) -> DevicePrefetcher:
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
    """
    return DevicePrefetcher(loader, device=device, depth=depth, transform=transform, channels_last=channels_last,
                            dtype=dtype, normalize=normalize, pin_memory=pin_memory)
