"""AOTAutograd renders the joint, forward and backward graphs as text on every compile, for its
logs and for Inductor's cache, whether or not a log will show them (``print_readable`` of three
graphs: about 0.6 s of ResNet-50's training compile on the H100). Ember uses neither the cache nor
the text, so while Ember's backend runs, the two logging steps see an ``AOTConfig`` with
``enable_log=False`` unless a log that shows the graphs is on (``TORCH_LOGS=aot_graphs``,
``aot_joint_graph``, or a structured trace through ``TORCH_TRACE``)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator

_LOGGING_STEPS = ("_log_joint_graph", "_log_fw_bw_graphs")
_TRACE_VARS = ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG")


@contextlib.contextmanager
def aot_graph_text_off() -> Iterator[None]:
    """Within the block, AOTAutograd's graph logging steps skip rendering graphs nobody reads."""
    try:
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:  # another torch layout: nothing to skip
        yield
        return
    steps = {n: getattr(graph_compile, n) for n in _LOGGING_STEPS if callable(getattr(graph_compile, n, None))}
    if not steps or _graph_logs_wanted(graph_compile):
        yield
        return
    for name, step in steps.items():
        setattr(graph_compile, name, _without_log(step))
    try:
        yield
    finally:
        for name, step in steps.items():
            setattr(graph_compile, name, step)


def _graph_logs_wanted(graph_compile: object) -> bool:
    if any(os.environ.get(v) for v in _TRACE_VARS):
        return True
    loggers = [getattr(graph_compile, n, None) for n in ("aot_joint_log", "aot_graphs_log")]
    return any(isinstance(lg, logging.Logger) and lg.isEnabledFor(logging.INFO) for lg in loggers)


def _without_log(step: Callable) -> Callable:
    def call(*args: object, **kwargs: object) -> object:
        return step(*[_log_off(a) for a in args], **{k: _log_off(v) for k, v in kwargs.items()})
    return call


def _log_off(x: object) -> object:
    """A copy of an AOTConfig with ``enable_log=False``; anything else as it is."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and getattr(x, "enable_log", None) is True:
        x = copy.copy(x)
        object.__setattr__(x, "enable_log", False)
    return x
