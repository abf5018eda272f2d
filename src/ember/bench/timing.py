"""How ``ember bench`` times steps.

``sync_each_step`` (the headline, PyTorch's benchmark protocol): synchronise the device after
every step and take the host's wall-clock time of the step, so work the host does per step
(Python, guards, launches) counts even where the GPU would hide it. Each step's host time,
from calling the step until the Python call returns (before the synchronisation), is kept too:
a step whose host time is close to its wall time is bound by the host.

``pipelined`` (a second column, CUDA only): CUDA events around each step while the host runs
ahead, as a training loop that never reads a result back would; it hides host work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["PIPELINED", "SYNC_EACH_STEP", "time_pipelined", "time_sync_each_step"]

SYNC_EACH_STEP = "sync_each_step"
PIPELINED = "cuda_events_pipelined"

Step = Callable[..., Any]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sync_each_step(step: Step, batches: Sequence[tuple[Any, ...]], iters: int, device: torch.device,
                        tick: Callable[[], None] = lambda: None) -> tuple[list[float], list[float]]:
    """(wall ms per step, host ms per step inside the call), synchronising after every step."""
    wall_ms: list[float] = []
    host_ms: list[float] = []
    _sync(device)
    for i in range(iters):
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        wall_ms.append((t2 - t0) * 1e3)
        host_ms.append((t1 - t0) * 1e3)
        tick()
    return wall_ms, host_ms


def time_pipelined(step: Step, batches: Sequence[tuple[Any, ...]], iters: int, device: torch.device,
                   tick: Callable[[], None] = lambda: None) -> list[float] | None:
    """ms per step between CUDA events recorded around each step, synchronising once at the end;
    None off CUDA (a CPU step is synchronous: the first timer already measures it)."""
    if device.type != "cuda":
        return None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    _sync(device)
    for i, (start, end) in enumerate(events):
        start.record()
        step(*batches[i % len(batches)])
        end.record()
        tick()
    _sync(device)
    return [start.elapsed_time(end) for start, end in events]
