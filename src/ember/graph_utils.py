"""Small questions every stage asks of an FX graph: a module attribute by dotted name, whether a
value has symbolic sizes, and the names ops go by in plans and reports. Depends on torch only,
so any stage may import it."""

from __future__ import annotations

import torch
import torch.fx as fx

_REQUIRED = object()


# The attribute names of values the cleanup pass folds (passes/cleanup.py); the program keeps
# them itself (codegen/program.py).
FOLDED_PREFIX = "_ember_folded_"


def get_attr(gm: fx.GraphModule, target: str, default: object = _REQUIRED) -> object:
    """The attribute a ``get_attr`` node names (``"layer1.0.weight"``); ``default`` where any part
    of the dotted name is missing (without it a missing part raises AttributeError)."""
    obj: object = gm
    for part in target.split("."):
        if default is _REQUIRED:
            obj = getattr(obj, part)
        else:
            obj = getattr(obj, part, _REQUIRED)
            if obj is _REQUIRED:
                return default
    return obj


def is_symbolic(value: object) -> bool:
    """A SymInt, or a tensor with a symbolic size (dynamic shapes)."""
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(not isinstance(d, int) for d in value.shape)


def op_name(node: fx.Node) -> str:
    """The op with its overload, ``.default`` dropped (``add.Tensor``, ``relu``): how plans name it."""
    return getattr(node.target, "__name__", str(node.target)).replace(".default", "")


def op_family(node: fx.Node) -> str:
    """The op without its overload, with its namespace (``aten.add``): how reports count ops."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._overloadpacket.__name__}"
    return getattr(target, "__name__", str(target))


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides, smallest first, are the running products of its
    sizes (size-1 dims, whose stride says nothing, skipped). Such a tensor covers its storage
    span exactly, in some dim order."""
    step = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != step:
            return False
        step *= size
    return True

