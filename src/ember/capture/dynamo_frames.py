"""Dynamo's compiled frame of a module's forward, read back: its guards, and whether it is one graph.

A whole-call replay (``runtime/cudagraphs/whole_call.py``) skips Dynamo's frame evaluation, not its
guards: it runs the guards of the cache entry its capture went through on the call's own
arguments, so whatever Dynamo would compile again for (a config flag the forward reads, an
input's dtype, a parameter's shape) sends the call down the normal path. The cache-entry API is
private to torch; where it is missing the replay is refused, never guessed.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

# How the transformed code of a frame with a graph break names the functions it resumes in
# (``__resume_at_<offset>_<n>`` globals; torch_dynamo_resume_in_<fn>_at_<line> code objects).
RESUME_PREFIXES = ("__resume_at", "torch_dynamo_resume_in")
COMPILED_PREFIX = "__compiled_fn"


def forward_function(model: torch.nn.Module) -> types.FunctionType | None:
    """The function whose frame Dynamo compiles for ``model(...)``: its class's ``forward``
    (decorators included, as called); None for a forward set on the instance."""
    forward = model.__dict__.get("forward", type(model).__dict__.get("forward", None))
    if forward is None:
        forward = getattr(type(model), "forward", None)
    return forward if isinstance(forward, types.FunctionType) else None


def cache_entries(fn: types.FunctionType) -> list[Any]:
    """Dynamo's cache entries for ``fn``'s code, in the order Dynamo tries them ([] if unknown)."""
    reader = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    reader = getattr(reader, "_debug_get_cache_entry_list", None)
    if reader is None:
        return []
    try:
        return list(reader(fn.__code__))
    except (RuntimeError, TypeError):
        return []


def entry_blocker(entry: Any) -> str | None:
    """Why a replay cannot stand for this cache entry's transformed code (None: it can)."""
    names = entry.code.co_names
    breaks = [n for n in names if n.startswith(RESUME_PREFIXES)]
    if breaks:
        return (f"the forward has {len(breaks)} graph break(s): Python runs between its graphs on every call, "
                "which a replay would skip")
    graphs = [n for n in names if n.startswith(COMPILED_PREFIX)]
    if not graphs:
        return ("the forward's frame runs no compiled graph itself (Dynamo compiled its work in frames it calls: "
                "a graph break at a call)")
    if len(graphs) != 1:
        return f"the forward's frame runs {len(graphs)} compiled graphs, not one"
    if not callable(getattr(getattr(entry, "guard_manager", None), "check", None)):
        return "this torch's Dynamo cache entries have no guard check Ember can call"
    return None


def passing_entry(fn: types.FunctionType, f_locals: dict) -> Any | None:
    """The first cache entry whose guards pass for these arguments (None: Dynamo would compile)."""
    for entry in cache_entries(fn):
        try:
            if entry.guard_manager.check(f_locals):
                return entry
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated is a failed guard
            continue
    return None


class FrameLocals:
    """The mapping Dynamo's guards read for a call of ``fn``: its arguments by parameter name,
    defaults filled, ``*args`` a tuple and ``**kwargs`` a dict, and its closure's free variables,
    as the frame sees them on entry.

    The binding is worked out once per call form (positional count, keyword names) with
    ``inspect``; later calls of that form only place the values (the forward's own call raises
    for a call that does not bind)."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.signature = inspect.signature(fn, follow_wrapped=False)
        self.plans: dict[tuple, list[tuple[str, int, Any]]] = {}
        # A closure's free variables are locals of its frame too (a decorator's wrapper reads
        # ``func``); the guards read them from the cells, as the frame does on entry.
        self.cells = list(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def __call__(self, owner: object, args: tuple, kwargs: dict) -> dict:
        form = (len(args), *kwargs)
        plan = self.plans.get(form)
        if plan is None:
            plan = self.plans[form] = self._plan(len(args), tuple(kwargs))
        values = (owner, *args)
        out = {}
        for name, kind, ref in plan:
            if kind == _POSITIONAL:
                out[name] = values[ref]
            elif kind == _KEYWORD:
                out[name] = kwargs[ref]
            elif kind == _DEFAULT:
                out[name] = ref
            elif kind == _REST:
                out[name] = values[ref:]
            else:
                out[name] = {k: kwargs[k] for k in ref}
        for name, cell in self.cells:
            try:
                out[name] = cell.cell_contents
            except ValueError:  # an empty cell: not bound yet when the frame starts
                pass
        return out

    def _plan(self, nargs: int, keys: tuple[str, ...]) -> list[tuple[str, int, Any]]:
        marks = [_Mark(_POSITIONAL, k) for k in range(nargs + 1)]
        bound = self.signature.bind(*marks, **{k: _Mark(_KEYWORD, k) for k in keys})
        bound.apply_defaults()
        plan: list[tuple[str, int, Any]] = []
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                start = value[0].ref if value else nargs + 1
                plan.append((name, _REST, start))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                plan.append((name, _EXTRA, tuple(value)))
            elif isinstance(value, _Mark):
                plan.append((name, value.kind, value.ref))
            else:
                plan.append((name, _DEFAULT, value))
        return plan


_POSITIONAL, _KEYWORD, _DEFAULT, _REST, _EXTRA = range(5)


class _Mark:
    __slots__ = ("kind", "ref")

    def __init__(self, kind: int, ref: Any) -> None:
        self.kind, self.ref = kind, ref
