"""The memory checks the CUDA-graph runner makes before each replay (runtime/cudagraphs/memory.py):
whether an output group lies in memory held throughout a capture (against a brute-force answer),
and which held outputs of another graph in the pool a replay may overwrite."""

from __future__ import annotations

import torch
from cudagraph_fakes import COTANGENT, new_batch, runner_pair, train_step
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from ember.runtime.cudagraphs import memory as graph_memory
from ember.runtime.cudagraphs.memory import OutputGroup, inside, merged

_ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)).map(lambda t: (t[0], t[0] + t[1])),
                   max_size=12)


def _group(ptr: int, nbytes: int) -> OutputGroup:
    return OutputGroup(ptr, nbytes, [0], StorageWeakRef(torch.empty(1).untyped_storage()))


@settings(max_examples=300, deadline=None)
@given(_ranges, st.integers(0, 250), st.integers(1, 60))
def test_inside_is_coverage_by_the_union_of_ranges(ranges: list[tuple[int, int]], ptr: int, nbytes: int) -> None:
    covered = set()
    for lo, hi in ranges:
        covered.update(range(lo, hi))
    expected = all(b in covered for b in range(ptr, ptr + nbytes))
    assert inside(_group(ptr, nbytes), merged(ranges)) == expected


def test_merged_joins_overlapping_and_touching_ranges() -> None:
    assert merged([(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]) == [(0, 8), (10, 30), (40, 41)]
    assert merged([]) == []


def test_protected_memory_is_never_a_hazard() -> None:
    fw, bw, _ = runner_pair()
    w = torch.randn(8, 4)
    for _ in range(3):
        train_step(fw, bw, w)
    kept = train_step(fw, bw, w)[1]  # a replay's gradient
    fw.g.protected = [(grp.ptr, grp.ptr + grp.nbytes) for grp in bw.g.groups]
    assert graph_memory.overwrite_hazards(fw.g, [new_batch(), w]) == []
    fw.g.protected = []
    assert graph_memory.overwrite_hazards(fw.g, [new_batch(), w]) == bw.g.groups
    del kept


def test_arguments_that_the_program_consumes_are_not_a_hazard() -> None:
    fw, bw, _ = runner_pair()
    w = torch.randn(8, 4)
    for _ in range(3):
        train_step(fw, bw, w)
    bw.g.protected = []
    h = fw([new_batch(), w])[1]
    assert graph_memory.overwrite_hazards(bw.g, [h, w, COTANGENT]) == []  # only the backward's arguments hold h
    kept = h[1:]  # somebody else holds it too
    assert graph_memory.overwrite_hazards(bw.g, [h, w, COTANGENT]) != []
    del kept
