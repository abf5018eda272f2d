"""What a whole-step replay depends on, and how a call is checked against it.

A captured step reads the batch at fixed addresses with a fixed layout, runs under the grad and
autocast modes and train/eval flags it was captured with, and updates the parameters it saw with
the hyperparameters it saw (``train/capture.py`` lists each). ``signature`` and ``hyper_change`` are
the full check's parts, which name what changed. ``ReplayGuard`` holds what the last replayed call
found and reads it back with few Python steps; only a call where something differs goes through
the full check. The device waits for the host's whole step call before its launch in a step
synchronised each time (on one H100 host the call took 0.96-1.56 ms, ``replay()`` 0.22-0.25 ms of
it); on the CI CPU mobilenet_v3's check took 46.4-47.0 us before the guard and 35.5-35.7 us with it
(medians of 3,000 checks, five rounds each, two alternating processes each). Reading the train
flags from the modules' dicts (``TrainFlags``) took that pass from 6.0-31.0 us to 2.7-7.3 us on
an H200's host for resnet50, bert, densenet121 and mobilenet_v3
(``benchmarks/results/h200/2026-11-28_replay_guard_flags_suite/``).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

_TRAINING = operator.attrgetter("training")
_FLAG = operator.itemgetter("training")
_DATA_PTR = torch.Tensor.data_ptr


def _batch_layout(batch: Sequence[Any]) -> list:
    return [(x.shape, x.stride(), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor)
            else (type(x), x) for x in batch]


def _modes(device: str) -> tuple:
    return torch.is_grad_enabled(), torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def signature(batch: Sequence[Any], modules: Sequence[torch.nn.Module], device: torch.device) -> list:
    """The grad/autocast modes, the batch's layout (non-tensors by value) and the train/eval flags."""
    return [*_modes(device.type), *_batch_layout(batch), tuple(map(_TRAINING, modules))]


def hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def hyper_change(old: dict, new: dict) -> str | None:
    """The first hyperparameter of a param_group that changed (tensors: replaced by another object)."""
    if old.keys() != new.keys():
        return f"keys {sorted(set(old) ^ set(new))}"
    for key, was in old.items():
        now = new[key]
        if isinstance(was, torch.Tensor) or isinstance(now, torch.Tensor):
            if was is not now:
                return key
        elif was != now:
            return key
    return None


@functools.cache
def _class_shadows_flag(cls: type) -> bool:
    """Whether a class has a data descriptor (a property) named ``training``, which Python reads
    in front of the instance dict. Asked once per class: a guard is remade after each full check."""
    attr = inspect.getattr_static(cls, "training", None)
    return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")


def _flag_in_dict(module: torch.nn.Module) -> bool:
    """Whether ``module.training`` is read from its instance dict."""
    return "training" in getattr(module, "__dict__", ()) and not _class_shadows_flag(type(module))


@dataclass
class TrainFlags:
    """The modules' train/eval flags as the last replay found them, read with few Python steps.

    A flag lives in its module's instance dict (``nn.Module.train`` and ``module.training = x``
    write it there): an item read of the dict costs about half an attribute read of the module,
    which looks through its class's MRO first. The dicts are split into the flags that were on and
    those that were off, so a check is two C-level ``all``/``any`` passes and builds no list.
    Modules whose flag is read another way (a property) are read through ``getattr``. (A module
    whose whole ``__dict__`` is replaced by another dict object is not seen; ``nn.Module`` itself
    only updates it in place.)"""

    on: list[dict]
    off: list[dict]
    other: list[torch.nn.Module]
    other_flags: list

    @classmethod
    def of(cls, modules: Sequence[torch.nn.Module]) -> TrainFlags:
        on, off, other = [], [], []
        for m in modules:
            if _flag_in_dict(m):
                (on if m.__dict__["training"] else off).append(m.__dict__)
            else:
                other.append(m)
        return cls(on, off, other, list(map(_TRAINING, other)))

    def hold(self) -> bool:
        try:
            return (all(map(_FLAG, self.on)) and not any(map(_FLAG, self.off))
                    and (not self.other or list(map(_TRAINING, self.other)) == self.other_flags))
        except KeyError:  # a flag deleted from its module: the full check decides
            return False


@dataclass
class ReplayGuard:
    """What the last call that replayed found: the same batch layout, modes, train/eval flags,
    optimizer objects, parameter addresses and hyperparameter objects (compared by identity)."""

    batch: list  # per argument: (shape, strides, dtype, device, requires_grad), or (type, value)
    modes: tuple  # grad mode, autocast enabled, autocast dtype
    training: TrainFlags
    groups: list[dict]  # the param_group objects
    group_params: list[list]  # each group's "params" list object
    ptrs: list[int]  # the addresses of the parameters those lists hold
    keys: list[list[str]]  # hyperparameter names per group
    values: list[list]  # their value objects
    state: object
    scale: object

    @classmethod
    def of(cls, batch: Sequence[Any], optimizer: torch.optim.Optimizer, scaler: Any,
           modules: Sequence[torch.nn.Module], device: str) -> ReplayGuard:
        groups = optimizer.param_groups
        keys = [[k for k in g if k != "params"] for g in groups]
        group_params = [g["params"] for g in groups]
        return cls(batch=_batch_layout(batch), modes=_modes(device), training=TrainFlags.of(modules),
                   groups=list(groups), group_params=group_params,
                   ptrs=list(map(_DATA_PTR, chain.from_iterable(group_params))), keys=keys,
                   values=[[g[k] for k in ks] for g, ks in zip(groups, keys)], state=optimizer.state,
                   scale=getattr(scaler, "_scale", None))

    def holds(self, batch: Sequence[Any], optimizer: torch.optim.Optimizer, scaler: Any, device: str) -> bool:
        """Whether everything held is as the last replay found it (False: run the full check)."""
        groups = optimizer.param_groups
        try:
            if len(batch) != len(self.batch) or _batch_layout(batch) != self.batch or _modes(device) != self.modes:
                return False
        except (RuntimeError, TypeError, ValueError):  # a value whose == is no truth value: the full check decides
            return False
        if (optimizer.state is not self.state or len(groups) != len(self.groups)
                or not all(map(operator.is_, groups, self.groups))
                or getattr(scaler, "_scale", None) is not self.scale):
            return False
        for group, params, keys, values in zip(groups, self.group_params, self.keys, self.values):
            if group["params"] is not params or len(group) != len(keys) + 1 \
                    or not all(map(operator.is_, map(group.get, keys), values)):
                return False
        # The addresses of the parameters the lists hold now: a parameter given other memory
        # (``.data = ...``, ``.to()``) or swapped into a list in place shows as another address
        # (a new Parameter object on the old one's memory would not).
        return list(map(_DATA_PTR, chain.from_iterable(self.group_params))) == self.ptrs and self.training.hold()
