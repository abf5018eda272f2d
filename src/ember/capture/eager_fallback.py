"""A model Dynamo cannot trace runs eagerly: never fail where eager works.

Dynamo raises when it cannot trace a call (a fake-tensor error in the model's own code, as in
Hugging Face's Nystromformer, whose compile-only attention mask does not fit its scores; an
internal Dynamo error). ``torch.compile`` hands that error to the user; eager would have run the
model. Here the call is run again eagerly, through the user's own model, outside Dynamo:

- eager succeeds: the error was the trace's, not the input's. The model runs eagerly from then on
  (every later call would trace and fail again), said once as a warning and in ``explain``;
- eager raises too: the input is bad (a wrong shape, another device). The caller gets eager's
  error, with the trace's chained to it, and nothing is switched off: the next good call compiles.

The second run is safe only if no compiled code of the call ran before the trace failed (a graph
break's earlier graph may have written buffers): the wrapper counts compiled-graph runs
(``CompiledGraph.runs``) across the call and hands the error on unchanged when any ran. Dynamo
applies a frame's Python side effects only after its graph runs, so a trace that fails before its
first graph has changed nothing the eager run would see.

Only Dynamo's trace errors qualify: Ember's own device check (``EmberDeviceError``) is an answer to
the user's ``device=`` option, and an Ember compile error (``BackendCompilerFailed``) does so only
outside strict mode, where the tests want Ember's bugs to raise.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import exc as dynamo_exc

from ember.capture.backend import EmberDeviceError
from ember.config import strict
from ember.runtime.program import CompiledGraph


def _qualifies(err: BaseException) -> bool:
    if isinstance(err, EmberDeviceError) or not isinstance(err, dynamo_exc.TorchDynamoException):
        return False
    return not isinstance(err, dynamo_exc.BackendCompilerFailed) or not strict()


def _first_line(err: BaseException) -> str:
    """The error's first line, with Dynamo's explanation where it gives one (a fake-tensor error's
    first line names no op; its explanation holds the model's own error)."""
    lines = [line.strip() for line in str(err).strip().splitlines()]
    text = f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
    why = next((line for line in lines if line.startswith("Explanation:")), None)
    return f"{text} ({why[len('Explanation:'):].strip()[:400]})" if why else text


class EagerFallback:
    """``compiled``'s calls, with ``eager`` run instead where Dynamo cannot trace (module docstring)."""

    __slots__ = ("compiled", "eager", "backend", "reason", "__wrapped__")

    def __init__(self, compiled: Callable, eager: Callable, backend: Any) -> None:
        self.compiled = compiled
        self.eager = eager
        self.backend = backend
        self.reason: str | None = None  # set once eager ran a call Dynamo could not trace
        self.__wrapped__ = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reason is not None:
            return self.eager(*args, **kwargs)
        started = CompiledGraph.runs
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            if not _qualifies(err) or CompiledGraph.runs != started:
                raise
            out = self.eager(*args, **kwargs)  # eager's own error, if it raises, is the caller's
            self.give_up(err)
            return out

    def give_up(self, err: BaseException) -> None:
        self.reason = _first_line(err)
        note = f"the whole model (Dynamo could not trace a call that eager runs: {self.reason})"
        self.backend.log.gave_up.append(note)
        warnings.warn(f"ember: Dynamo could not trace this model ({self.reason}); the call ran eagerly and "
                      "the model runs eagerly from now on (correct results, no Ember code). torch.compile "
                      "raises this error; ember.explain(model, ...) shows it again.", RuntimeWarning, stacklevel=3)


def install(compiled: Callable, model: Callable, backend: Any) -> Callable:
    """Put an ``EagerFallback`` in front of an ``ember.compile`` result: a module's ``forward``
    (outermost, around the warm start and the whole-call graph), or a function, wrapped."""
    if isinstance(compiled, torch.nn.Module) and "forward" in compiled.__dict__:
        compiled.__dict__["forward"] = EagerFallback(compiled.__dict__["forward"], model, backend)
        return compiled
    fallback = EagerFallback(compiled, model, backend)

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fallback(*args, **kwargs)

    call._ember_fallback = fallback  # type: ignore[attr-defined]
    return call
