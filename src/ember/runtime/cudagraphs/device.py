"""What the CUDA-graph runner (runtime/cudagraphs/runner.py) asks of the device: pools, capture, replay,
views of pool memory, the allocator's counters. The tests replace it with a CPU stand-in."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from ember import compat
from ember.config import settings
from ember.runtime import library_warmup

log = logging.getLogger(__name__)


def first_call_pool_enabled() -> bool:
    return settings().first_call_pool


def clear_library_workspaces() -> None:
    """Hand back cuBLAS's workspaces (one per handle and stream, 32 MiB each on the H100, kept for
    good). Made by a first call's matmul, one pinned that call's private pool (40 MiB of
    mobilenet_v3's inference peak). Made during a capture, it lies in the graph's pool: handed
    back, it is memory the replay writes and the capture allocated, a temporary like any other,
    so no later capture can take it for memory it believes that graph never touches (Inductor's
    CUDA-graph trees clear them around captures too). The next matmul outside makes its own."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and settings().clear_workspaces:
        clear()


_T = TypeVar("_T")


def run_noting_syncs(run: Callable[[], _T]) -> tuple[_T, list[str]]:
    """``run()`` under ``torch.cuda.set_sync_debug_mode("warn")``: its result and the first line of
    each wait for the device it made (a call that waits cannot be captured: .item(), .cpu(), a
    data-dependent shape, a host-side check). Its other warnings are handed on."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # torch's note that the debug mode is a prototype (once per process) is no sync of the call.
    syncs = [str(w.message).splitlines()[0] for w in seen
             if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
    for w in seen:
        if "synchroniz" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result, syncs


class _PoolMemory:
    """``__cuda_array_interface__`` of pool memory. A tensor made from it holds this object (its
    deleter drops the reference), and this object holds ``keeper``: what keeps the pool valid (its
    graphs; ``memory.PoolState.anchors``)."""

    def __init__(self, ptr: int, nbytes: int, keeper: object) -> None:
        self.keeper = keeper
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


# One capture stream per device for every capture of the process. The caching allocator hands a
# freed block only to allocations on the stream it was freed on: with a new stream per capture
# (what this module did first) the backward's capture could reuse none of the forward's memory in
# the pool they share, and ResNet-50's pool held both graphs' peaks side by side (7,132 MiB
# reserved on the H100 for about 5,400 MiB ever live at once).
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        with torch.cuda.device(index):
            _CAPTURE_STREAMS[index] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[index]


@contextlib.contextmanager
def _recording(graph: torch.cuda.CUDAGraph, pool: object, device: torch.device) -> Iterator[None]:
    """Record into ``graph`` on the device's capture stream, ordered after the current stream's work
    and after any library set-up still running in Ember's helper thread."""
    library_warmup.join_all()
    with torch.cuda.device(device):
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        # thread_local: another thread's CUDA calls (a data loader pinning memory) must not
        # break the capture, nor the capture break them.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
        torch.cuda.current_stream().wait_stream(stream)


class CudaBackend:
    """What the runner asks of the device (a CPU stand-in replaces it in the tests)."""

    def new_pool(self, device: torch.device, shared: bool) -> object:
        """A pool handle for ``capture``; None: a private pool of the graph's own."""
        return torch.cuda.graph_pool_handle() if shared else None

    @contextlib.contextmanager
    def first_call_pool(self, device: torch.device) -> Iterator[None]:
        """Route this thread's allocations to a private pool of their own while a graph's first,
        uncaptured call runs (runtime/cudagraphs/pool.py says why). The pool is handed back when the
        block ends: its segments return to the device as soon as no tensor uses them and the
        cache is released (``release_cached``); until then nothing else allocates from them."""
        if device.type != "cuda" or not compat.can_route_allocations_to_pool() or not first_call_pool_enabled():
            yield
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = torch.cuda.graph_pool_handle()  # a new id: the pool is created by the first allocation
        compat.begin_allocate_to_pool(index, handle)
        try:
            yield
        finally:
            clear_library_workspaces()  # would pin the private pool otherwise
            compat.end_allocate_to_pool(index, handle)

    def capture(self, run: Callable[[list], object], inputs: list, device: torch.device,
                pool: object = None, prepare: Callable[[list], None] | None = None) -> tuple[object, object]:
        """Record ``run(inputs)`` into a new graph without executing it: (graph, outputs).

        ``inputs`` is handed to the program, which clears it: an input nobody else holds is freed
        when the program is done with it, and its memory can be reused within the capture.
        ``prepare(inputs)`` runs first, inside the capture: what it allocates comes from the pool."""
        graph = torch.cuda.CUDAGraph()
        with _recording(graph, pool, device):
            if prepare is not None:
                prepare(inputs)
            outputs = run(inputs)
        clear_library_workspaces()
        return graph, outputs

    def replay(self, graph: object, args: list) -> None:
        """Replay ``graph``; ``args`` are this call's inputs (the graph reads their addresses)."""
        graph.replay()  # type: ignore[attr-defined]

    def refs_to(self, storage_cdata: int) -> int:
        """References this backend itself keeps to a storage (a CUDA graph keeps none: it holds
        addresses, not tensors)."""
        return 0

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether the graph reads and writes ``t``'s memory (host tensors are read at capture)."""
        return t.device.type == "cuda"

    def view(self, ptr: int, nbytes: int, device: torch.device, keeper: object) -> torch.UntypedStorage:
        """A storage on pool memory that does not own it (the pool does) and holds ``keeper``."""
        return torch.as_tensor(_PoolMemory(ptr, nbytes, keeper), device=device).untyped_storage()

    def memory_counters(self, device: torch.device) -> tuple[int, int] | None:
        """(allocated bytes, the allocator's allocated-bytes peak) on ``device``; None off the GPU."""
        if device.type != "cuda":
            return None
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    def release_cached(self, device: torch.device) -> int:
        """Release the cached, unused blocks of ``device``'s pools (runtime/cudagraphs/pool.py); returns
        the bytes released. Blocks in use and live CUDA-graph pools are untouched."""
        if device.type != "cuda":
            return 0
        before = torch.cuda.memory_reserved(device)
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved(device))

    def reserve(self, pool: object, nbytes: int, device: torch.device) -> object:
        """Allocate ``nbytes`` into ``pool`` as one segment and free it (runtime/cudagraphs/pool.py); the
        returned graph keeps the pool alive."""
        graph = torch.cuda.CUDAGraph()
        with _recording(graph, pool, device):  # on the captures' stream: only they can take the block
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            block[:1].zero_()  # a graph must record some work
            del block
        return graph

    def recover(self, device: torch.device) -> None:
        """After a failed capture. A capture that fails after it began leaves the default CUDA
        generator in capture mode, and every later random op outside a capture raises ("Offset
        increment outside graph capture"); a small capture that completes resets it."""
        torch.cuda.synchronize(device)
        try:
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    torch.empty(1, device=device).zero_()
                del graph
        except Exception:  # noqa: BLE001 - best effort; the program still runs uncaptured
            log.debug("resetting the generator's capture state failed", exc_info=True)
