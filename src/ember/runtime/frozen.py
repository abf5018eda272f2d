"""Values a program derives from parameters alone, computed once and kept while they stay valid."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _key(tensors: tuple) -> tuple:
    # Address and version counter: a new tensor, an in-place update (optimizer step, copy_ under
    # no_grad, load_state_dict) or a reassigned parameter all change the key.
    return tuple((t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else id(t) for t in tensors)


class FrozenValues:
    """``frozen(prepare, *params)`` -> ``prepare(*params)``, recomputed only when a param changed."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.values: tuple = ()
        self.computed = 0  # how often ``prepare`` ran (explain and tests read it)

    def __call__(self, prepare: Callable[..., tuple], *params: object) -> tuple:
        key = _key(params)
        if key != self.key:
            self.key = None  # a failing prepare must not leave stale values marked valid
            with torch.no_grad():
                self.values = prepare(*params)
            self.key = key
            self.computed += 1
        return self.values
