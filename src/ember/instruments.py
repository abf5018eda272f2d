"""Hooks into the compile pipeline's stages, for tests, benchmarks and profilers.

Each stage of ``ember.pipeline`` runs through ``run_stage(name, record, fn, *args)``: it is timed
into the graph's record (``GraphRecord.stage_seconds``), and the active instruments see it:

    before(name, record, args)        before the stage runs (may raise: the graph then falls back)
    around(name, call) -> result      wraps the call (a profiler); must return call()'s result
    after(name, record, artifact)     the stage's printable artifact (graph, KernelPlan, ...)

plus two replaceable parts of the CUDA-graph stage (a CPU fake of the device and the capture
rule, so CI can run the replay logic without a GPU). Install them for a block of code:

    with ember.instruments.instrument(after=lambda name, record, artifact: print(name)):
        model(x)

Stages, in order: passes, schedule, codegen, kernel_compile, program (and cache_load on a
compiled-program cache hit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

STAGES = ("passes", "schedule", "codegen", "kernel_compile", "program", "cache_load")


@dataclasses.dataclass
class Instruments:
    before: list[Callable[[str, Any, tuple], None]] = dataclasses.field(default_factory=list)
    around: list[Callable[[str, Callable[[], Any]], Any]] = dataclasses.field(default_factory=list)
    after: list[Callable[[str, Any, Any], None]] = dataclasses.field(default_factory=list)
    # The device the CUDA-graph runner captures and replays on (None: the real CUDA one).
    cudagraph_device: object | None = None
    # Replaces runtime.cudagraphs.rules.cudagraph_blocker: (gm, inputs, kind, target, enabled) -> reason|None.
    capture_rule: Callable[..., str | None] | None = None


_ACTIVE = Instruments()


def active() -> Instruments:
    return _ACTIVE


@contextlib.contextmanager
def instrument(before: Callable[[str, Any, tuple], None] | None = None,
               around: Callable[[str, Callable[[], Any]], Any] | None = None,
               after: Callable[[str, Any, Any], None] | None = None,
               cudagraph_device: object | None = None,
               capture_rule: Callable[..., str | None] | None = None) -> Iterator[Instruments]:
    """Add hooks (and replace the CUDA-graph parts) for the duration of the block."""
    global _ACTIVE
    saved = _ACTIVE
    _ACTIVE = Instruments(
        before=saved.before + ([before] if before else []),
        around=saved.around + ([around] if around else []),
        after=saved.after + ([after] if after else []),
        cudagraph_device=cudagraph_device if cudagraph_device is not None else saved.cudagraph_device,
        capture_rule=capture_rule if capture_rule is not None else saved.capture_rule)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = saved


def run_stage(name: str, record: Any, fn: Callable[..., T], *args: Any) -> T:
    """Run one stage: hooks before, around and after it; its seconds added to the record."""
    hooks = _ACTIVE
    for hook in hooks.before:
        hook(name, record, args)
    call: Callable[[], Any] = functools.partial(fn, *args)
    for wrap in hooks.around:
        call = functools.partial(wrap, name, call)
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    if record is not None:
        record.stage_seconds[name] = record.stage_seconds.get(name, 0.0) + seconds
    for hook in hooks.after:
        hook(name, record, result)
    return result
