"""Values a program derives from parameters alone, computed once and kept while they stay valid."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's data address (one C call per tensor, no Python method lookups)."""
    return list(map(_DATA_PTR, tensors))


def _key(tensors: tuple) -> tuple:
    # Address and version counter: a new tensor, an in-place update (optimizer step, copy_ under
    # no_grad, load_state_dict) or a reassigned parameter all change the key. Read through map
    # (checked before every replay: 199 parameters of a BERT-base in 19.9 us instead of 38.1 us).
    try:
        return tuple(zip(map(_DATA_PTR, tensors), map(_VERSION, tensors)))
    except (TypeError, AttributeError):  # not all tensors: the same key, one by one
        return tuple((t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else id(t) for t in tensors)


class FrozenValues:
    """``frozen(prepare, *params)`` -> ``prepare(*params)``, recomputed only when a param changed."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.values: tuple = ()
        self.computed = 0  # how often ``prepare`` ran (explain and tests read it)
        self.moved = 0  # how often the values were recomputed at new addresses (not in place)

    def __call__(self, prepare: Callable[..., tuple], *params: object) -> tuple:
        key = _key(params)
        if key != self.key:
            self.key = None  # a failing prepare must not leave stale values marked valid
            with torch.no_grad():
                values = prepare(*params)
                if _same_layout(values, self.values):
                    # Where the old values were: a captured CUDA graph reads them at their addresses.
                    torch._foreach_copy_([o for o in self.values if isinstance(o, torch.Tensor)],
                                         [v for v in values if isinstance(v, torch.Tensor)])
                else:
                    self.moved += bool(self.values)
                    self.values = values
            self.key = key
            self.computed += 1
        return self.values

    def refresh(self, prepare: Callable[..., tuple], *params: object) -> bool:
        """Recompute if a parameter changed; True when the values now lie elsewhere (a CUDA graph
        that read the old ones must be captured again)."""
        moved = self.moved
        self(prepare, *params)
        return self.moved != moved


def _same_layout(new: tuple, old: tuple) -> bool:
    """Whether ``new`` can be copied into ``old`` tensor by tensor (a parameter changed in place)."""
    if len(new) != len(old) or not old:
        return False
    for a, b in zip(new, old):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor) and (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype
                                            or a.device != b.device or a.storage_offset() != b.storage_offset()
                                            or a._base is not None or b._base is not None):
            return False
        if not isinstance(a, torch.Tensor) and a != b:
            return False
    return True
