"""Static sizes for the RNG states activation checkpointing saves, so its backward compiles.

With ``torch.utils.checkpoint`` around dropout, AOTAutograd records the forward's draw as
``run_and_save_rng_state(op, ...)`` (the generator's state, then the op) and the recompute in the
backward as ``run_with_rng_state(state, op, ...)``, so both draw one mask. The saved state reaches
the backward graph with a symbolic size (``uint8[s86]``): the state's size is the generator's, not
the model's, and AOTAutograd does not know it. Ember generates code for static shapes only, so the
whole backward would run op by op as captured. The size is fixed per generator (5,056 bytes for
the CPU one, 16 for a CUDA one; a CPU tensor either way): where a symbolic input is only ever
handed to ``run_with_rng_state`` as its state, it is given the size of the generator of the
device its op draws on, and the graph is static again.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.graph_utils import is_symbolic


def _is_run_with_rng_state(target: object) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator) and target.name() == "run_with_rng_state"


def _drawing_device(state: fx.Node) -> torch.device | None:
    """The device of the tensors the recomputed op reads (``run_with_rng_state(state, op, *args)``)."""
    for user in state.users:
        for arg in [*user.args[2:], *user.kwargs.values()]:
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if isinstance(val, torch.Tensor):
                return val.device
    return None


def _state_size(device: torch.device) -> int | None:
    if device.type == "cpu":
        return torch.get_rng_state().numel()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device).numel()
    return None


def fix_rng_state_sizes(graph: fx.GraphModule, inputs: list) -> int:
    """Give each RNG-state input of ``graph`` (and its entry of ``inputs``) its device's static
    size; returns how many it fixed."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    fixed = 0
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() == 1 and val.dtype == torch.uint8 and is_symbolic(val)):
            continue
        if not node.users or not all(_is_run_with_rng_state(u.target) and u.args[0] is node for u in node.users):
            continue
        # The generator is the device the op draws on; the state itself is a CPU tensor either way
        # (``torch.cuda.get_rng_state()`` returns one).
        size = _state_size(_drawing_device(node) or val.device)
        if size is None:
            continue
        mode = getattr(val, "fake_mode", None)
        if mode is None:
            continue
        with mode:
            static = torch.empty(size, dtype=torch.uint8, device=val.device)
        node.meta["val"] = static
        if i < len(inputs) and isinstance(inputs[i], torch.Tensor) and is_symbolic(inputs[i]):
            inputs[i] = static
        fixed += 1
    return fixed
