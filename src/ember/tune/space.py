"""Candidate configurations of one generated kernel, and the cheap analytic model that ranks them.

A configuration is a dict of overrides of the generator's block-size rules:
  Triton (codegen/triton_kernel.py)  XBLOCK, RBLOCK (looped reductions, transposed tiles), SPLIT_PROGRAMS (looped
                                     float32 reductions), num_warps, num_stages
  numba  (codegen/cpu_kernel.py)     blk (points per work unit of column layouts), threads, chunk
                                     (units per piece of the parallel split, pieces dealt to the
                                     threads in turn; default: one contiguous share per thread)
``{}`` is the default (the rules). The model estimates each candidate's time from the bytes the
kernel moves, how many programs/units run in parallel (occupancy, waves, thread balance) and a
register-pressure/idle-lane penalty per tile; only the best few by this estimate are timed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ember.codegen.triton_tiles import next_pow2
from ember.schedule.plan import FusedGroup

# A device's numbers for the model (an H100's by default; CPU: per-core throughput).
GPU_BANDWIDTH = 3.0e12  # bytes/s
GPU_SMS = 132
CPU_BANDWIDTH_PER_THREAD = 8.0e9
CPU_UNIT_COST = 40e-9  # seconds per work unit (loop setup)
CPU_PARALLEL_COST = 3e-6  # a parallel region's fixed cost


@dataclass(frozen=True)
class Candidate:
    config: dict[str, int]
    estimate_s: float  # the model's estimate


def _group_bytes(group: FusedGroup) -> int:
    total = 0
    for n in list(group.inputs) + list(group.outputs):
        val = n.meta.get("val")
        if val is not None and hasattr(val, "numel"):
            total += val.numel() * val.element_size()
    return max(total, 1)


# -- Triton --------------------------------------------------------------------------------------

def _triton_estimate(nbytes: int, xnumel: int, xblock: int, rblock: int, split: int,
                     warps: int, sms: int) -> float:
    programs = -(-xnumel // xblock) * split
    tile = xblock * rblock
    resident = max(1, 64 // warps)  # warps per SM / warps per program
    slots = sms * resident
    waves = programs / slots
    tail = math.ceil(waves) / waves if waves > 0 else 1.0
    active_warps = min(programs, slots) * warps / sms
    occupancy = min(1.0, active_warps / 16.0)  # ~16 warps per SM keep HBM busy
    per_thread = tile / (32 * warps)
    pressure = 1.0 + max(0.0, per_thread / 64 - 1.0) * 0.5 + (1.0 / per_thread - 1.0 if per_thread < 1 else 0.0)
    split_bytes = 8 * xnumel * split if split > 1 else 0
    return (nbytes + split_bytes) / (GPU_BANDWIDTH * occupancy) * tail * pressure + programs * 2e-10 + 2e-6


def triton_candidates(group: FusedGroup, interpret: bool, sms: int = GPU_SMS) -> list[Candidate]:
    """Every configuration worth considering for ``group``'s Triton kernel, best estimate first."""
    from ember.codegen.triton_kernel import TritonWriter

    w = TritonWriter(group, interpret)
    nbytes = _group_bytes(group)
    xmax = next_pow2(w.xnumel)
    configs: list[dict[str, int]] = []
    if w.tile_dims:  # a transposed pointwise tile: its two sides
        for xb, rb, nw in itertools.product((16, 32, 64, 128), (16, 32, 64, 128), (2, 4, 8)):
            if xb <= max(xmax, 16) and rb <= max(next_pow2(w.rnumel), 16) and 1024 <= xb * rb <= 16384:
                configs.append({"XBLOCK": xb, "RBLOCK": rb, "num_warps": nw})
    elif not w.is_reduction:
        for xb, nw in itertools.product((128, 256, 512, 1024, 2048, 4096), (1, 2, 4, 8)):
            if xb <= max(xmax, 128) and 32 * nw <= xb:
                configs.append({"XBLOCK": xb, "num_warps": nw})
    elif w.persistent:
        rb = next_pow2(w.rnumel)
        for xb, nw in itertools.product((1, 2, 4, 8, 16, 32, 64, 128), (1, 2, 4, 8, 16)):
            if xb <= xmax and 256 <= xb * rb <= 32768 and 32 * nw <= max(32, xb * rb):
                configs.append({"XBLOCK": xb, "num_warps": nw})
    else:
        xbs = (8, 16, 32, 64, 128) if w.x_contiguous else (1,)
        splits = (0, 132, 264, 528, 1056) if w.split.split > 1 or w.xnumel < 528 else (0,)
        for xb, rb, nw, sp in itertools.product(xbs, (512, 1024, 2048, 4096, 8192, 16384), (2, 4, 8, 16), splits):
            if xb <= xmax and 512 <= xb * rb <= 16384 and rb <= next_pow2(w.rnumel):
                configs.append({"XBLOCK": xb, "RBLOCK": rb, "num_warps": nw, "SPLIT_PROGRAMS": sp}
                               if xb > 1 else {"RBLOCK": rb, "num_warps": nw, "SPLIT_PROGRAMS": sp})
    out = []
    for c in configs:
        xb = c.get("XBLOCK", 1)
        rb = c.get("RBLOCK", next_pow2(w.rnumel) if w.is_reduction else 1)
        split = 1
        if c.get("SPLIT_PROGRAMS"):
            programs = -(-w.xnumel // xb)
            split = max(1, min(-(-w.rnumel // rb), -(-c["SPLIT_PROGRAMS"] // programs)))
        out.append(Candidate(c, _triton_estimate(nbytes, w.xnumel, xb, 1 if not w.is_reduction else rb,
                                                 split, c["num_warps"], sms)))
    return sorted(out, key=lambda c: c.estimate_s)


# -- numba ---------------------------------------------------------------------------------------

def cpu_candidates(group: FusedGroup, threads: int) -> list[Candidate]:
    """Work-unit size and thread count candidates for ``group``'s numba kernel, best estimate first."""
    from ember.codegen.cpu_kernel import COLUMN_BLOCK, CpuWriter

    w = CpuWriter(group)
    nbytes = _group_bytes(group)
    configs: list[dict[str, int]] = []
    thread_options = sorted({1, max(1, threads // 2), threads})
    if w.layout == "columns" and w.loops_x:
        last = w._size(w.loops_x[-1])
        cap = COLUMN_BLOCK if w.loops_r else 65536
        blks = sorted({b for b in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
                       if b <= cap and b <= max(64, next_pow2(last))})
        configs = [{"blk": b, "threads": t} for b in blks for t in thread_options]
    else:
        configs = [{"threads": t} for t in thread_options]
    base_units = w.units()
    if threads > 1:
        # Parallel chunking: pieces of a quarter / a sixteenth of a thread's share, dealt in turn.
        share = -(-base_units // threads)
        for div in (4, 16):
            if share // div >= 1 and base_units >= 4 * threads:
                configs.append({"threads": threads, "chunk": max(1, share // div)})
    out = []
    for c in configs:
        units = base_units
        if "blk" in c:
            rows = base_units // max(1, -(-w._size(w.loops_x[-1]) // w._column_block()))
            units = rows * -(-w._size(w.loops_x[-1]) // c["blk"])
        t = max(1, min(c["threads"], units))
        per = -(-units // t)
        balance = per * t / max(units, 1)
        if "chunk" in c:
            pieces = -(-units // c["chunk"])
            balance = -(-pieces // t) * c["chunk"] * t / max(units, 1)
        est = nbytes / (CPU_BANDWIDTH_PER_THREAD * t) * balance + per * CPU_UNIT_COST \
            + (CPU_PARALLEL_COST if t > 1 else 0.0)
        out.append(Candidate(c, est))
    ranked = sorted(out, key=lambda c: c.estimate_s)
    # The model takes units as equal in cost, so it cannot see what chunking is for: the best
    # chunked candidate is always among the first two, to be timed.
    chunked = next((i for i, c in enumerate(ranked) if "chunk" in c.config), None)
    if chunked is not None and chunked > 1:
        ranked.insert(1, ranked.pop(chunked))
    return ranked
