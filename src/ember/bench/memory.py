"""Peak memory PyTorch allocates during one call, on the CPU (and on CUDA through its counters).

On CPU PyTorch keeps no peak counter (``torch.cuda.max_memory_allocated`` has no CPU twin) and
the process's max RSS only grows, never resets, and includes everything Python and the
allocator hold, so "RSS growth" reads 0 B once an earlier step has touched that much memory.
Instead the profiler's memory events are used: with ``profile_memory=True`` every allocation
and free of a tensor's storage through the CPU allocator is reported with its byte size (frees
negative). Summing them in time order gives the bytes held at each moment; the peak is the
largest sum, relative to what was allocated when the call started (weights, inputs, anything
the caller holds are the same for every backend and do not count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ember.config import quiet_profiler_logs

quiet_profiler_logs()  # before this process first starts the profiler: no USDT/ERROR lines on stderr


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes PyTorch allocated on top of what was live when the call started."""

    peak: int  # the most held at any moment during the call
    end: int  # still held when the call returned (results, new .grad fields, ...)
    allocations: int  # number of allocations during the call

    def __str__(self) -> str:
        return f"peak {format_bytes(self.peak)}, end {format_bytes(self.end)}, {self.allocations} allocations"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _memory_events(prof: profile, device_type: str) -> list[tuple[int, int]]:
    """(time in ns, signed byte count) of every allocation/free on ``device_type``, in order."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.name() != "[memory]":
            continue
        if str(e.device_type()).rsplit(".", 1)[-1].lower() != device_type:
            continue
        out.append((e.start_ns(), e.nbytes()))
    out.sort(key=lambda t: t[0])  # stable: equal timestamps keep the recorded order
    return out


def measure_cpu_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, MemoryPeak]:
    """Call ``fn(*args, **kwargs)`` under the profiler; returns its result and the CPU peak.

    Counts tensor storage only (what PyTorch's CPU allocator hands out), like
    ``torch.cuda.max_memory_allocated`` does on a GPU. Run the call once before measuring when
    it compiles on first use: compile-time scratch is not what is being measured.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn(*args, **kwargs)
    held = peak = allocations = 0
    for _, nbytes in _memory_events(prof, "cpu"):
        held += nbytes
        allocations += nbytes > 0
        peak = max(peak, held)
    return result, MemoryPeak(peak=peak, end=held, allocations=allocations)


def cpu_peak_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Only the peak of ``measure_cpu_peak``."""
    return measure_cpu_peak(fn, *args, **kwargs)[1].peak


def cuda_peak_bytes(fn: Callable[..., Any], *args: Any, device: torch.device | None = None,
                    **kwargs: Any) -> int:
    """Peak CUDA bytes allocated during the call, above what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
