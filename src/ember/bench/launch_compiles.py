"""Triton compiles that happen at a kernel's launch, counted while a block runs.

Ember's compile workers build every kernel before its first launch, so a launch should only load
the binary from Triton's cache. A miss there means the binary was built for another cache key
(another cache folder, ptxas version or specialisation) and Triton compiles it again in this
process, on the first call's critical path. ``ember bench`` records the count for each first
call (``launch_compiles`` in its JSON) so a slow compile says whether this happened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

MISSED_KEPT = 6


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """Yields a dict filled, when the block ends, with hits, misses and the first missed kernels
    (empty where this Triton has no compilation listener)."""
    counts: dict = {}
    try:
        from triton import knobs

        compilation = knobs.compilation
        previous = compilation.listener
    except (ImportError, AttributeError):
        yield counts
        return
    counts.update(hit=0, miss=0, missed=[])

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        counts["hit" if cache_hit else "miss"] += 1
        if not cache_hit and len(counts["missed"]) < MISSED_KEPT:
            counts["missed"].append(str(getattr(src, "name", "?")))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    compilation.listener = listener
    try:
        yield counts
    finally:
        compilation.listener = previous
        counts["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR", "")
        counts["triton_ptxas_path"] = os.environ.get("TRITON_PTXAS_PATH", "")
