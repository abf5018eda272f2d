"""Garbage collections that run while a block runs, counted and timed (``gc.callbacks``).

A first call allocates millions of Python objects (Dynamo's and AOTAutograd's graphs, Ember's
plans), and the collector's passes over them are part of what a user waits for; ``ember bench``
records them with each first call (``first_call_collections`` in its JSON) so that a slow first call says
how much of it was the collector.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator


@contextlib.contextmanager
def timed_collections() -> Iterator[dict]:
    """Yields a dict filled, when the block ends, with ``count`` and ``seconds`` per generation
    (lists of three) and ``total_s``."""
    counts, seconds = [0, 0, 0], [0.0, 0.0, 0.0]
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            generation = info["generation"]
            counts[generation] += 1
            seconds[generation] += time.perf_counter() - started.pop()

    result: dict = {}
    gc.callbacks.append(callback)
    try:
        yield result
    finally:
        gc.callbacks.remove(callback)
        result.update(count=counts, seconds=[round(s, 6) for s in seconds], total_s=round(sum(seconds), 6))


def describe(result: dict) -> str:
    """One line: the total and each generation's count and seconds."""
    per = ", ".join(f"gen{g} {n} ({s:.3f} s)" for g, (n, s) in enumerate(zip(result["count"], result["seconds"])))
    return f"collections: {result['total_s']:.3f} s; {per}"
