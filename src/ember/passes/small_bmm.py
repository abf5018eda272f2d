"""Batched products of small unaligned matrices to Ember's Triton kernel (GPU targets).

Every ``aten.bmm`` the rule ``ops/small_bmm.takes`` accepts (bf16/fp16, at most 128 x 128
results with K at most 64, a size that is not a multiple of 8: window attention's 49-token
products) becomes ``ember::small_bmm``, forward and backward alike; every other product stays
cuBLAS's. Runs after the padding pass, which leaves such small products alone (padding 49 to 56
adds a third more work and a copy per operand). ``EMBER_SMALL_BMM=0`` keeps them all on cuBLAS.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.ops import small_bmm  # registers torch.ops.ember.small_bmm
from ember.passes.graph_edit import add_node, fake_mode_of, node_val

aten = torch.ops.aten


def generate_small_bmms(gm: fx.GraphModule) -> int:
    """Replace the batched products the rule takes; returns how many (``ember.explain`` lists each
    as an Ember op with what runs behind it)."""
    mode = None
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.bmm.default)):
        a, b = node.args[:2]
        old = node_val(node)
        if not small_bmm.takes(node_val(a), node_val(b)) or not isinstance(old, torch.Tensor) \
                or not old.is_contiguous():
            continue
        if mode is None:
            mode = fake_mode_of(gm)
        with gm.graph.inserting_before(node):
            new = add_node(gm.graph, mode, torch.ops.ember.small_bmm.default, (a, b))
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    return changed
