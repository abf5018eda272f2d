"""Nested batches: apply a function to every tensor of a batch and rebuild the same structure.

Tuples, lists, named tuples, dicts (and other mappings) and dataclasses are walked; any other
leaf (strings, numbers, file names, None) passes through as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` in it replaced by ``fn(t)``, same containers."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(fn, x) for x in obj]
        try:
            return type(obj)(items)
        except TypeError:  # a subclass with another constructor
            return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested batch, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_of(x)
    elif isinstance(obj, Mapping):
        for x in obj.values():
            yield from tensors_of(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_of(getattr(obj, f.name))
