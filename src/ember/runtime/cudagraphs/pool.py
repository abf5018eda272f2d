"""The memory pool a compiled model's training graphs share (an inference graph's own pool), and its size.

The forward and backward graphs of one model are captured, in execution order, into one CUDA
memory pool (``GraphPool``): the backward's capture reuses the forward's temporaries and the
saved activations it frees as it goes, as eager does (runtime/cudagraphs/runner.py).

Sizing. A pool grows the way the caching allocator grows any pool: a block that fits no free
block becomes a new segment of its own size. The capture frees saved activations in the
backward's order and allocates gradients of other sizes, so free blocks end up scattered over
many segments: on the H100 ResNet-50's pool reserved 7,132 MiB for about 5,400 MiB ever live at
once, which put Ember's reserved peak above eager's. A pool that starts as ONE segment of the
size the step needs is carved by best fit inside it, and a freed block merges with its free
neighbours, as in one contiguous address space (what PyTorch's expandable segments give the
default pool, and what kept eager's own reserved peak within 1% of its live peak in the same
run). ``PoolSizing`` measures that size on the first, uncaptured calls of the model's graphs:
the rise of the allocator's allocated-bytes peak from the start of the forward's first call
to the end of the backward's (the forward's temporaries, the saved activations, the backward's
working set and its gradients: what the captures will allocate). The peak counter is only
read, never reset, so the measurement exists only when the step set a new peak for the
process (the first training step usually does); otherwise the pool grows as before. Before the
first capture into a new pool, one block of the measured size is allocated into the pool by a
tiny captured graph (which keeps the pool alive) and freed again: the segment stays in the pool
for the captures to carve. ``EMBER_POOL_PRESIZE=0`` turns this off.

First calls. Each graph's first, uncaptured call allocates in a private pool of its own
(``CudaBackend.first_call_pool``), handed back when the call returns: its activations and
temporaries never share a segment of the default pool with a tensor that lives on. Before that,
CycleGAN's first step left its activations' segments in the default pool, the optimizer then
placed its momentum buffers into their free space, and 80 MiB of those segments stayed free
beside parameters and momentum for good, reusable by eager's activations but not by the graph
pool (408 MiB reserved against eager's 368 on the H100; 344 with the first-call pools). The
caching allocator's cached, unused blocks are released (``torch.cuda.empty_cache``) after each
first call, before the pool's reservation (the first calls' pools are free by then, once the
step's gradients are cleared) and after each capture into the pool. These are a few
synchronizations at the first steps and at a recapture, never per replay.

An inference graph gets a ``GraphPool`` of its own (``training=False``), measured, reserved and
released the same way; it never shares memory with the model's training graphs. Its
parameter-only values (bf16 weights under autocast, ``passes/freeze.py``) live as long as the model
and are made before the measured first call, outside its private pool: made inside it, bert's
167 MiB of them held a 222 MiB pool for good and the graph's pool was sized to 213 MiB for a
batch-1 call whose activations stay under 1 MiB.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ember.config import settings


def presize_enabled() -> bool:
    return settings().pool_presize


@dataclass
class PoolSizing:
    """What the first uncaptured calls measured, and what was reserved from it."""

    window: tuple[int, int] | None = None  # (allocated, peak) when the first first call began
    need: int = 0  # bytes: the peak's rise over the measured calls (0: not measured)
    reserved: list[int] = field(default_factory=list)  # bytes pre-allocated into each pool made
    released: int = 0  # bytes of cached memory released after first calls and captures
    note: str = ""

    def begin(self, counters: tuple[int, int] | None) -> None:
        if self.window is None and counters is not None:
            self.window = counters

    def end(self, counters: tuple[int, int] | None) -> None:
        if self.window is None or counters is None:
            return
        allocated, peak = self.window
        if counters[1] > peak:
            self.need = max(self.need, counters[1] - allocated)
            self.note = ""
        elif not self.need:
            self.note = "not pre-sized: the first calls set no new allocation peak for the process"


class GraphPool:
    """The memory pool that the training graphs (forward and backward) of one compiled model share.

    Captured in execution order into one pool, the backward's capture reuses the forward's
    temporaries and the saved activations it frees as it goes, as eager does; one pool per
    capture (what ``CudaGraphRunner`` does alone) keeps each graph's memory to itself. ``renew``
    starts a new pool: every graph of the old one is captured again on its next call."""

    def __init__(self, training: bool = True) -> None:
        # False: the pool of one inference graph alone; it is sized and released the same way.
        self.training = training
        self.state: object | None = None  # graph_memory.PoolState of the current pool
        self.renewals = 0
        self.sizing = PoolSizing()

    def renew(self) -> None:
        self.state = None
        self.renewals += 1

    def describe(self) -> str:
        s = self.sizing
        released = f"{s.released / 2**20:,.0f} MiB of cached memory released after first calls and captures" \
            if s.released else ""
        if s.reserved:
            sized = (f"pool pre-sized to {s.reserved[-1] / 2**20:,.0f} MiB in one segment (measured on the "
                     "first calls)")
        else:
            sized = s.note
        return "; ".join(x for x in (sized, released) if x)


def presize(pool: GraphPool, reserve: Callable[[int], object]) -> object | None:
    """Before the first capture into a new pool: allocate the measured size into it once
    (``reserve(nbytes)`` returns what keeps the pool alive). None when nothing was reserved."""
    if not presize_enabled():
        pool.sizing.note = "not pre-sized (EMBER_POOL_PRESIZE=0)"
        return None
    if not pool.sizing.need:
        return None
    try:
        keeper = reserve(pool.sizing.need)
    except Exception as err:  # noqa: BLE001 - out of memory, say: the pool grows as it would have
        pool.sizing.note = f"not pre-sized: reserving {pool.sizing.need / 2**20:,.0f} MiB failed ({type(err).__name__})"
        return None
    pool.sizing.reserved.append(pool.sizing.need)
    return keeper


def share_pool(compiled: Callable, pool: GraphPool, clock: object | None = None) -> None:
    """Make the CUDA-graph runner of ``compiled`` (an Ember program, boxed) capture into ``pool``;
    ``clock`` counts the model's calls, which gives each call of the graph within one its own
    graph (runtime/cudagraphs/call_sites.py)."""
    runner = getattr(getattr(compiled, "ember_graph", None), "run", None)
    if runner is not None and hasattr(runner, "pool") and hasattr(runner, "backend"):
        runner.pool = pool
        runner.clock = clock
