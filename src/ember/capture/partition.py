"""The split of AOTAutograd's joint graph into forward and backward: torch's min-cut partition,
without importing Inductor for the two helpers its CSE step borrows.

The default partitioner saves every forward value the backward reads. The min-cut partitioner
(what Inductor uses) saves a minimal set and recomputes cheap pointwise chains in the backward,
where they fuse into the backward's kernels: fewer, smaller saved activations, lower peak memory.

Before partitioning, torch's ``fx_graph_cse`` imports ``compute_mutation_region_ids`` and
``same_mutation_regions`` from ``torch._inductor.pattern_matcher``; that import loads much of
Inductor (its lowerings, decompositions, sympy's simplifier, Triton's autotuner: 0.58 s on a
2-core CPU, in a cold training first call of 2.2-2.7 s), for two functions that number the
graph's stretches between mutating ops. Where Inductor is not imported yet and the region of every node
can be told exactly (every call is an ATen/prims operator overload or ``getitem``: the graphs
AOTAutograd makes), the partition runs with a stand-in module under that name that supplies
these two helpers, numbering the regions by torch's own rule (``is_mutation_op``: an operator
overload outside the ``inductor`` namespace mutates when its schema is mutable). Any other name
asked of the stand-in imports the real module. The stand-in is removed when the partition ends.
Graphs holding other calls (higher-order operators, Python functions) import the real module.
"""

from __future__ import annotations

import importlib
import operator
import sys
import threading
import types

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

PATTERN_MATCHER = "torch._inductor.pattern_matcher"
_LOCK = threading.Lock()


def _mutates(node: fx.Node) -> bool | None:
    """Whether torch's ``is_mutation_op`` counts ``node`` as a mutation; None where this module
    does not decide it (then the real helpers run)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.kwargs.get("out") is not None
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace != "inductor":
        return target._schema.is_mutable
    if target is operator.getitem:  # its name matches none of the mutation patterns
        return node.kwargs.get("out") is not None
    return None


def regions_decidable(graph: fx.Graph) -> bool:
    """Whether the stand-in numbers every node of ``graph``'s mutation regions as torch does."""
    return all(_mutates(n) is not None for n in graph.nodes)


def compute_mutation_region_ids(graph: fx.Graph) -> None:
    """Each node's ``mutation_region_id``: the number of mutating nodes up to and including it."""
    region = 0
    for node in graph.nodes:
        if _mutates(node):
            region += 1
        node.meta["mutation_region_id"] = region


def same_mutation_regions(a: fx.Node, b: fx.Node) -> bool:
    return a.meta["mutation_region_id"] == b.meta["mutation_region_id"]


class _StandIn(types.ModuleType):
    """``torch._inductor.pattern_matcher`` while a partition runs: the two helpers, and the real
    module for any other name."""

    compute_mutation_region_ids = staticmethod(compute_mutation_region_ids)
    same_mutation_regions = staticmethod(same_mutation_regions)

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # the import system's questions (``__path__``): not a module's names
            raise AttributeError(name)
        with _LOCK:
            if sys.modules.get(PATTERN_MATCHER) is self:
                del sys.modules[PATTERN_MATCHER]
        return getattr(importlib.import_module(PATTERN_MATCHER), name)


def partition_joint_graph(joint_module: fx.GraphModule, joint_inputs: object, **kwargs: object
                          ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's ``partition_fn``: the min-cut partition (Inductor's recomputation rules)."""
    stand_in = None
    with _LOCK:
        if PATTERN_MATCHER not in sys.modules and regions_decidable(joint_module.graph):
            stand_in = _StandIn(PATTERN_MATCHER)
            sys.modules[PATTERN_MATCHER] = stand_in
    try:
        return min_cut_rematerialization_partition(joint_module, joint_inputs, compiler="inductor", **kwargs)
    finally:
        if stand_in is not None:
            with _LOCK:
                if sys.modules.get(PATTERN_MATCHER) is stand_in:
                    del sys.modules[PATTERN_MATCHER]
