"""CompiledGraph: a generated program bound to its kernels, callable the way AOTAutograd calls."""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from ember import config


class EmberMismatchError(AssertionError):
    """``check=True`` found a compiled result that differs from eager."""


def expect_strides(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` with exactly the strides its consumers were generated for (a copy if needed)."""
    if not isinstance(t, torch.Tensor) or t.stride() == stride or t.numel() <= 1:
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    return 1e-3, 1e-4


def compare_outputs(got: object, want: object, where: str) -> None:
    """Raise EmberMismatchError naming the first output that differs beyond dtype tolerance."""
    got_list = list(got) if isinstance(got, (list, tuple)) else [got]
    want_list = list(want) if isinstance(want, (list, tuple)) else [want]
    for i, (g, w) in enumerate(zip(got_list, want_list)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            raise EmberMismatchError(f"{where}: output {i} has shape/dtype {getattr(g, 'shape', None)}/"
                                     f"{getattr(g, 'dtype', None)}, eager gives {w.shape}/{w.dtype}")
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                raise EmberMismatchError(f"{where}: output {i} ({w.dtype}) differs from eager")
            continue
        rtol, atol = _tolerance(w.dtype)
        if not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol, equal_nan=True):
            err = (g.float() - w.float()).abs().max().item()
            raise EmberMismatchError(f"{where}: output {i} differs from eager by up to {err:.3g} "
                                     f"(rtol={rtol}, atol={atol})")


# Operator namespaces whose ops AOTAutograd's first-call aliasing analysis does not check
# (``_AnalyzeCustomOpInputOutputMode``: ATen, prims, higher-order ops) or that are Ember's own.
_CHECKED_ELSEWHERE = frozenset({"aten", "prims", "prim", "higher_order", "ember"})
_NAMESPACE = re.compile(r"torch\.ops\.(\w+)\.")


def analysis_checks_nothing(source: str) -> bool:
    """Whether a program calls no operator of a third party's library: then AOTAutograd's
    first-call analysis of custom operators' aliasing has nothing to check in it."""
    return set(_NAMESPACE.findall(source)) <= _CHECKED_ELSEWHERE


@contextlib.contextmanager
def without_idle_alias_analysis(source: str) -> Iterator[None]:
    """AOTAutograd runs a compiled function's first call under a Python dispatch mode that checks
    each custom operator's outputs for aliasing its inputs; every ATen call of the call passes
    through it (bert's forward program on an H200 under cProfile: 945 calls, 0.344 s of its
    0.530 s first run). Where the program calls no operator the mode would check, it is set
    aside for the call."""
    mode = _get_current_dispatch_mode()
    if type(mode).__name__ != "_AnalyzeCustomOpInputOutputMode" or not analysis_checks_nothing(source):
        yield
        return
    with _pop_mode_temporarily():
        yield


@dataclass
class CompiledGraph:
    """One compiled ATen graph. Called with a list of tensors (boxed), returns its outputs."""

    title: str
    source: str
    run: Callable[[list], object]
    reference: fx.GraphModule | None = None  # the captured graph, for check=True
    check: bool = False
    first_call_s: float | None = None
    calls: int = 0
    # Waits for what the first run needs and is still being prepared: the kernels the compile
    # workers build (runtime/precompile.py), so the next graph compiles meanwhile.
    before_first_call: Callable[[], None] | None = None
    after_first_call: Callable[[float], None] | None = None  # told the first run's seconds
    # What a warm start needs to link this program again in a new process without its graph
    # (capture/warm_start.py): the stored program and the replay rule's decision. None when the
    # graph ran as captured (an internal error, dynamic shapes).
    saved: dict | None = None
    # Makes the captured graph runnable as it was (ATen, op by op): what the first call falls back
    # to if the program raises before it wrote any input, with ``on_rescue`` told why.
    rescue: Callable[[], Callable[[list], object]] | None = None
    on_rescue: Callable[[str], None] | None = None
    # Runs of every compiled graph of the process: whether a model call ran compiled code before
    # it failed (capture/eager_fallback.py may run such a call again eagerly only if none did).
    runs: ClassVar[int] = 0

    def __call__(self, args: list) -> object:
        CompiledGraph.runs += 1
        self.calls += 1
        if self.calls > 1 and not self.check:
            return self.run(args)
        if self.before_first_call is not None:
            ready, self.before_first_call = self.before_first_call, None
            ready()
        saved = list(args) if self.check and self.reference is not None else None
        start = time.perf_counter()
        with without_idle_alias_analysis(self.source):
            out = self._first_run(args) if self.rescue is not None else self.run(args)
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - start
            if self.after_first_call is not None:
                self.after_first_call(self.first_call_s)
        if saved is not None:
            self.check = False
            with torch.no_grad():
                want = self.reference(*saved)
            compare_outputs(out, want, self.title)
        return out

    def _first_run(self, args: list) -> object:
        """The first call, with the captured graph to fall back to: a program that raises (a bug
        of Ember's: eager runs this graph) before it wrote any input gives the call to the graph
        as captured, now and from then on, and says so."""
        rescue, self.rescue = self.rescue, None
        held = list(args)
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in held]
        try:
            return self.run(args)
        except Exception as err:
            written = any(isinstance(a, torch.Tensor) and a._version != v for a, v in zip(held, versions))
            if rescue is None or written or config.strict() or isinstance(err, torch.OutOfMemoryError):
                raise
            why = f"{type(err).__name__}: {str(err)[:300]}"
            warnings.warn(f"ember: {self.title} failed on its first call ({why}); running it through ATen as "
                          "captured from now on. Please report this with the traceback from EMBER_STRICT=1.",
                          RuntimeWarning, stacklevel=3)
            if self.on_rescue is not None:
                self.on_rescue(why)
            self.run = rescue()
            return self.run(held)


def boxed(graph: CompiledGraph) -> Callable[[list], object]:
    """A plain function for AOTAutograd: it calls with one list of args that we may clear."""
    def run(args: list) -> object:
        return graph(args)
    run._boxed_call = True  # type: ignore[attr-defined]
    run.ember_graph = graph  # type: ignore[attr-defined]
    return run
