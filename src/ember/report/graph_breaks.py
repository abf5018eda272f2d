"""Graph breaks of one run, with where they are, from Dynamo's own records.

Dynamo keeps two records, and which breaks land in which differs between torch versions:
``counters["graph_break"]`` (reason -> count) misses a branch on a tensor's value
(``if h.sum() > 0:``, Dynamo's "generic_jump") in torch 2.14, while every graph Dynamo ends
early creates a ``GraphCompileReason`` (``torch._dynamo.utils.graph_break_reasons``, what
``torch._dynamo.explain`` reports) with the user's stack. Both are read; a counter entry that
no located record explains is kept without a location.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_JUMP = "generic_jump"


@dataclass
class GraphBreaks:
    """Reason -> count, and reason -> the places (``file:line: source``) it happened."""

    counts: Counter = field(default_factory=Counter)
    where: dict[str, list[str]] = field(default_factory=dict)


def readable_reason(reason: str) -> str:
    """Dynamo's reason, with its terse name for a data-dependent branch spelled out."""
    if reason.startswith(_JUMP):
        return (f"a Python branch on a tensor's value (data-dependent control flow; Dynamo: {reason.strip()}); "
                "torch.cond or torch.where keep it in one graph")
    return reason


def _place(frame: object) -> str:
    filename = getattr(frame, "filename", "?")
    try:
        rel = os.path.relpath(filename)
        filename = rel if not rel.startswith("..") else filename
    except ValueError:  # another drive (Windows)
        pass
    line = (getattr(frame, "line", "") or "").strip()
    return f"{filename}:{getattr(frame, 'lineno', '?')}" + (f": {line}" if line else "")


def _located() -> list | None:
    try:
        from torch._dynamo.utils import graph_break_reasons
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return graph_break_reasons


@contextmanager
def collect_graph_breaks() -> Iterator[GraphBreaks]:
    """Collect the graph breaks of the code run inside; filled in when the block ends."""
    from torch._dynamo.utils import counters

    located = _located()
    start = len(located) if located is not None else 0
    before = Counter(counters["graph_break"])
    out = GraphBreaks()
    try:
        yield out
    finally:
        counted = Counter(counters["graph_break"])
        counted.subtract(before)
        seen: set[tuple[str, str]] = set()
        # Dynamo may trace a frame twice (a restart after the break); one break site counts once.
        for record in (located[start:] if located is not None and len(located) >= start else []):
            if not getattr(record, "graph_break", True):
                continue
            reason = readable_reason(str(getattr(record, "reason", "")))
            stack = getattr(record, "user_stack", None) or []
            place = _place(stack[-1]) if stack else "(no location recorded)"
            if (reason, place) in seen:
                continue
            seen.add((reason, place))
            out.counts[reason] += 1
            out.where.setdefault(reason, []).append(place)
        for reason, n in (+counted).items():
            first = reason.strip().splitlines()[0] if reason.strip() else reason
            if not any(r.strip().splitlines()[0] == first for r in out.counts if r.strip()):
                out.counts[reason] += n
