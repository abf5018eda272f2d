"""Memory-efficient attention with dropout, safe inside and outside CUDA graphs.

The forward (``_scaled_dot_product_efficient_attention``) returns the philox seed and offset the
backward needs to rebuild its dropout mask. Uncaptured it makes them host tensors holding the
values; under CUDA-graph capture it makes them device tensors that the kernel fills at every replay
from the generator's graph-safe state. The backward decides by its *own* capture status: captured,
it reads them through device pointers; uncaptured, it dereferences them on the host. A forward
replayed (device seeds) followed by a backward run uncaptured (its first call, a call whose outputs
were still held, a graph that could not be captured) read device memory on the host: a segmentation
fault on the H100 (BERT training, benchmarks/results/h100/2026-11-23_suite_compile_profile/). That is why this
attention was kept out of capture, and BERT's memory-efficient attention ran without CUDA graphs.

``ember::attention_seeds`` sits between the saved seeds and the backward and hands it the form its
capture status reads: host tensors when uncaptured (a copy from the device, which waits for it: only
on calls that run uncaptured after a replayed forward), device tensors under capture. A capture never
sees host seeds: the CUDA-graph runner defers capture while an input is a host tensor
(runtime/cudagraph.py), and the op refuses them under capture, so such a capture fails and runs
uncaptured rather than baking one seed into every replay.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

# Backward ops of memory-efficient attention: (op, index of philox_seed, index of philox_offset, index of dropout_p).
_SEEDED_BACKWARDS = {
    aten._scaled_dot_product_efficient_attention_backward.default: (7, 8, 9),
    aten._efficient_attention_backward.default: (12, 13, 11),
}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@torch.library.custom_op("ember::attention_seeds", mutates_args=())
def attention_seeds(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved philox seed and offset in the form the efficient-attention backward reads now."""
    if _capturing():
        if seed.device.type != "cuda" or offset.device.type != "cuda":
            raise RuntimeError("ember: memory-efficient attention's dropout seed is a host tensor under CUDA-graph "
                               "capture; a replay would repeat its dropout mask (running uncaptured instead)")
        return seed.clone(), offset.clone()
    return seed.to("cpu", copy=True), offset.to("cpu", copy=True)


@attention_seeds.register_fake
def _(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(seed), torch.empty_like(offset)


def _dropout_p(node: fx.Node, index: int) -> object:
    return node.args[index] if index < len(node.args) else node.kwargs.get("dropout_p", 0.0)


def route_attention_seeds(gm: fx.GraphModule) -> int:
    """Pass the seeds of every memory-efficient attention backward with dropout through
    ``ember::attention_seeds``; returns how many backward ops were rewritten."""
    op = torch.ops.ember.attention_seeds.default
    changed = 0
    for node in list(gm.graph.nodes):
        where = _SEEDED_BACKWARDS.get(node.target) if node.op == "call_function" else None
        if where is None:
            continue
        seed_at, offset_at, p_at = where
        if len(node.args) <= offset_at or _dropout_p(node, p_at) == 0:
            continue
        seed, offset = node.args[seed_at], node.args[offset_at]
        if not isinstance(seed, fx.Node) or not isinstance(offset, fx.Node):
            continue
        if seed.target is operator.getitem and getattr(seed.args[0], "target", None) == op:
            continue  # already routed
        with gm.graph.inserting_before(node):
            pair = gm.graph.call_function(op, (seed, offset))
            new_seed = gm.graph.call_function(operator.getitem, (pair, 0))
            new_offset = gm.graph.call_function(operator.getitem, (pair, 1))
        vals = (seed.meta.get("val"), offset.meta.get("val"))
        if all(isinstance(v, torch.Tensor) for v in vals):
            pair.meta["val"] = vals
            new_seed.meta["val"], new_offset.meta["val"] = vals
        args = list(node.args)
        args[seed_at], args[offset_at] = new_seed, new_offset
        node.args = tuple(args)
        changed += 1
    return changed
