"""What Ember's backend changes while AOTAutograd and Ember compile a graph (capture/backend.py);
each is a context manager, and everything is restored afterwards.

- ``aot_graph_text_off``: AOTAutograd renders the joint, forward and backward graphs as text on
  every compile, for its logs and for Inductor's cache, whether or not a log will show them
  (``print_readable`` of three graphs: 1.23 s of ResNet-50's training compile under cProfile on an
  H100, torch 2.11, 2026-11-23).
  Ember uses neither, so the two logging steps see an ``AOTConfig`` with ``enable_log=False``
  unless a log that shows the graphs is on (``TORCH_LOGS=aot_graphs``, ``aot_joint_graph``, or a
  structured trace through ``TORCH_TRACE``).
- ``backward_with_forward``: AOTAutograd compiles a training graph's backward on its first use.
  On GPU targets it is compiled right after the forward instead: the forward's kernels are still
  compiling in the workers (runtime/precompile.py), and the backward's passes and code generation
  overlap them rather than follow the forward's first run. A backward that fails to compile falls
  back inside ``compile_graph`` as before, so the eager compile raises nothing new.
- ``rng_ops_kept``: random ops stay ATen ops, whose CUDA kernels are graph-safe (see there).
- ``gc_paused``: a compile allocates millions of Python objects, which trigger full garbage
  collections, and each full collection walks every object of the process (torch, Triton, the
  model and the compile's own graphs). On a 2-core CPU (``benchmarks/scripts/cpu_gc_during_compile.py``,
  result in ``benchmarks/results/cpu/2026-11-24_gc_during_compile/cpu_gc_during_compile_2026-11-24.json``) 4 full collections took 1.08 s
  of ResNet-50's 5.43 s first call; with the collector paused while AOTAutograd and Ember compile,
  one remains (0.19 s, outside the block), the first call takes 4.91 s and peak resident memory
  grows by 31 MiB (1,124 -> 1,155 MiB). Freezing the objects that existed (``gc.freeze``) was
  tried instead of the pause and helped less: the compile's own objects are most of what a
  collection walks. Both together: the older objects are frozen while the collector is paused,
  and one collection at the block's end walks only the block's objects; without the freeze, the
  collections that came right after the block (a young one over the compile's objects, then a
  full one over every object of the process) took 0.92-1.06 s of bert's cold training call on the
  CI CPU, with it 0.41-0.50 s. The warm start's compile is one such block from Dynamo's trace to
  the saved file (capture/warm_start.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Iterator

import torch

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


@contextlib.contextmanager
def backward_with_forward(on: bool) -> Iterator[None]:
    """Within the block (when ``on``), AOTAutograd compiles a training graph's backward right away."""
    cfg = torch._functorch.config
    if not on or not hasattr(cfg, "force_non_lazy_backward_lowering"):
        yield
        return
    with cfg.patch(force_non_lazy_backward_lowering=True):
        yield


@contextlib.contextmanager
def rng_ops_kept() -> Iterator[None]:
    """Within the block, AOTAutograd keeps random ops as the ATen ops they are
    (``functionalize_rng_ops=False``, its default, even if the user turned it on). Their CUDA
    kernels draw from the default generator's philox state, which a CUDA graph registers and
    advances at every replay; functionalized, they become ``philox_rand`` with the seed and offset
    as host-tensor graph inputs, which a replay would read once (runtime/cudagraphs/rules.py)."""
    from torch._functorch import config as cfg

    if not getattr(cfg, "functionalize_rng_ops", False):
        yield
        return
    with cfg.patch(functionalize_rng_ops=False):
        yield


# What was frozen when Ember was imported: the interpreter's own objects (CPython 3.12 keeps 375
# static tuples there, 3.11 and 3.13 none). The block's unfreeze moves those to the oldest
# generation too, which changes nothing for them (they are never garbage).
_FROZEN_AT_IMPORT = gc.get_freeze_count()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within the block, no garbage collection runs; at its end, one collection of the objects made
    inside it. The objects from before the block are frozen (``gc.freeze``) while it runs, so that
    collection walks only the block's objects, as a young collection would, and the full
    collection the block's survivors would otherwise trigger soon after (walking every object of
    the process) is not paid here. The old objects are unfrozen at once, so their garbage is
    collected later as before. A caller with the collector off, or a process that froze objects itself since Ember
    was imported, keeps its own arrangement (the block only pauses)."""
    if not gc.isenabled():
        yield
        return
    freeze = gc.get_freeze_count() <= _FROZEN_AT_IMPORT
    if freeze:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            try:
                gc.collect()
            finally:
                gc.unfreeze()
        gc.enable()
