"""Warm start of a function (``ember.compile(fn, warm_start=True)``; ``ember.compile_step``'s train_fn).

The module warm start (capture/warm_start.py) saves a module's ``forward``; this one saves a plain
Python function, typically a training step's ``train_fn(*batch) -> loss`` that reads the model
from its closure or its module's globals. The file, its format, the load and the fallbacks are the
module warm start's; what differs is what the saved frame refers to:

- Closure variables. torch saves a function's closure cells *by value* and runs the loaded frame
  (and checks its guards) with those saved cells. A saved value would be stale in another process
  (another model object, another scale), so every closure value that is not a plain constant
  travels as torch's ``external_data`` and is taken from this process's function on load; plain
  constants (None, bool, int, float, str, tuples of them) are saved by value and their values are
  part of the file's key. On every call the function's cells must still hold what the loaded frame
  holds (by identity; constants by value): a reassigned closure variable loads (or compiles) again.
- Globals. The frame runs with the function's live module globals. Unlike the module warm start,
  Dynamo's guards on globals are saved and checked on every call (a script's ``model`` is usually a
  global: its parameters' shapes, dtypes and strides, its module types); every ``nn.Module`` among
  the function's globals travels as external data so that torch can save those guards. A guard that
  still cannot be saved (an object by id) is dropped or re-checked as in the module warm start.
- The key. Besides versions, device, options and the call: the function's module, qualified name and
  a hash of its source file; the class sources, parameter/buffer signatures and training flags of
  every module it reaches (closure, globals it names, and ``model=`` of ``compile_step``); the
  closure's constants.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ember.capture.frame_cache import warm_start_blocker
from ember.capture.warm_rechecks import (
    CONSTANT_TYPES,
    GuardGlobals,
    Rechecks,
    class_source,
    closure_values,
    code_digest,
    file_hash,
)
from ember.capture.warm_start import WarmStart, _value_signature, graph_stand_ins


def _constant(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_constant(v) for v in value)
    return isinstance(value, CONSTANT_TYPES)


def _names_read(code: types.CodeType) -> set[str]:
    """Global names the function's code (and the code nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _same(a: object, b: object) -> bool:
    return a is b or (_constant(a) and type(a) is type(b) and a == b)


class FunctionWarmStart(WarmStart):
    """A compiled function's calls with warm starts (see the module docstring)."""

    def __init__(self, fn: types.FunctionType, backend: Any, dynamo_fn: Callable, off: str | None) -> None:
        self.fn = fn
        self.named_modules: dict[str, torch.nn.Module] = {}  # compile_step's model=, for the key
        super().__init__(None, backend, dynamo_fn, off)  # type: ignore[arg-type] - no module here

    def add_modules(self, modules: dict[str, torch.nn.Module]) -> None:
        """Modules the function uses that the key must describe although it cannot find them itself."""
        self.named_modules.update(modules)
        if self.off is None:
            blocked = _hooked(modules)
            if blocked:
                self.off = blocked
                self.note(f"off: {blocked}")

    # -- the hooks of WarmStart ----------------------------------------------------------------

    def inference_with_grad(self) -> bool:
        return False  # a function has no eval mode to tell inference by (compile_step's train_fn trains)

    def traced(self) -> Callable:
        return self.fn

    def bound(self, args: tuple) -> tuple:
        return args

    def frame_globals(self) -> dict:
        return self.fn.__globals__

    def external_data(self) -> dict[str, object]:
        data = {f"ember_closure_{name}": value for name, value in closure_values(self.fn).items() if not _constant(value)}
        data.update({f"ember_global_{name}": value for name, value in self.fn.__globals__.items()
                     if isinstance(value, torch.nn.Module)})
        return data

    def keeps_guard(self, entry: Any) -> bool:
        return True  # guards on globals too: their modules travel as external data

    def recheck_names(self) -> dict[str, Any]:
        return {**closure_values(self.fn), "G": GuardGlobals(self.fn.__globals__)}

    def _closure_changed(self, rechecks: Rechecks) -> str | None:
        held = getattr(rechecks, "closure", None)
        if held is not None:
            for name, value in closure_values(self.fn).items():
                if not _same(value, held.get(name)):
                    return f"closure variable {name} holds another object than the loaded frame"
        return None

    def recheck(self, rechecks: Rechecks, args: tuple, kwargs: dict) -> str | None:
        return self._closure_changed(rechecks) or super().recheck(rechecks, args, kwargs)

    def rechecks_hold(self, rechecks: Rechecks, args: tuple, kwargs: dict) -> bool:
        return self._closure_changed(rechecks) is None and super().rechecks_hold(rechecks, args, kwargs)

    def _load_or_compile(self, ckey: str, args: tuple, kwargs: dict) -> Any:
        closure = closure_values(self.fn)  # what the frame is loaded (or compiled) with
        found = super()._load_or_compile(ckey, args, kwargs)
        if found is not None:
            found[1].closure = closure
        return found

    def modules(self) -> dict[str, torch.nn.Module]:
        """The modules the key describes, by a name that says where they were found."""
        found: dict[str, torch.nn.Module] = {}
        seen: set[int] = set()

        def add(name: str, value: object) -> None:
            if isinstance(value, torch.nn.Module) and id(value) not in seen:
                seen.add(id(value))
                found[name] = value

        for name, value in self.named_modules.items():
            add(name, value)
        for name, value in closure_values(self.fn).items():
            add(f"closure.{name}", value)
        for name in sorted(_names_read(self.fn.__code__)):
            add(f"global.{name}", self.fn.__globals__.get(name))
        return found

    def key(self, ckey: str, args: tuple, kwargs: dict) -> tuple[str, dict]:
        from ember.runtime.artifacts import _versions
        from ember.tune.apply import tuning_stamp
        options = self.backend.options
        modules = self.modules()
        opts = {k: v for k, v in vars(options).items() if k not in ("progress", "debug_dir", "cache_dir")}
        try:
            source = inspect.getsourcefile(self.fn)
        except (TypeError, OSError):
            source = None
        state = [f"{m}.{n}:{_value_signature(t)}" for m, module in modules.items()
                 for n, t in (*module.named_parameters(), *module.named_buffers())]
        parts = {
            "versions": f"{_versions()} python {sys.version.split()[0]}",
            "device": _device_name(args, kwargs, modules.values()),
            "tuning": tuning_stamp(options.cache_root()),
            "options": repr(sorted(opts.items())),
            "graph_stand_ins": graph_stand_ins(),
            # Two lambdas of one function share a qualified name and a file: their code tells them apart.
            "function": f"{self.fn.__module__}.{self.fn.__qualname__}@{file_hash(source)}",
            "code": f"{self.fn.__code__.co_firstlineno} {code_digest(self.fn.__code__)}",
            "classes": sorted(class_source(t) for t in {type(m) for module in modules.values() for m in module.modules()}),
            "modules": sorted(modules),
            "state": state,
            "training": [[m.training for m in module.modules()] for module in modules.values()],
            "closure": [f"{name}={value!r}"[:300] if _constant(value) else f"{name}:{type(value).__qualname__}"
                        for name, value in closure_values(self.fn).items()],
            "aliases": _aliases(self.external_data()),
            "call": ckey,
        }
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
        return digest, parts


def _aliases(external: dict[str, object]) -> list[str]:
    """Which external names hold the same object. torch saves a reference by the object's id, so an
    object held under two names (a global model that is also in the closure) is saved under one of
    them: a file must only be loaded where the same names share objects."""
    first: dict[int, str] = {}
    out = []
    for name in sorted(external):
        owner = first.setdefault(id(external[name]), name)
        if owner != name:
            out.append(f"{name}={owner}")
    return out


def _device_name(args: tuple, kwargs: dict, modules: Any) -> str:
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    tensors += [t for m in modules for t in (*m.parameters(), *m.buffers())]
    for t in tensors:
        if t.device.type == "cuda":
            return torch.cuda.get_device_name(t.device)
    return "cpu"


def _hooked(modules: dict[str, torch.nn.Module]) -> str | None:
    for name, module in modules.items():
        for m in module.modules():
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return f"{name} has module hooks (a warm start compiles the function, not the hooks around it)"
    return None


def unavailable(fn: object, options: Any) -> str | None:
    """Why function ``fn`` cannot warm start with ``options`` (None: it can)."""
    if not isinstance(fn, types.FunctionType):
        return f"only a Python function or an nn.Module's forward warm starts, not {type(fn).__name__}"
    try:
        closure = closure_values(fn)
    except ValueError:
        return "a closure variable of the function is not set yet"
    return _hooked({k: v for k, v in closure.items() if isinstance(v, torch.nn.Module)}) or warm_start_blocker(options)


def install(compiled: Callable, fn: types.FunctionType, backend: Any) -> Callable:
    """The compiled function, its calls routed through a FunctionWarmStart."""
    warm = FunctionWarmStart(fn, backend, compiled, unavailable(fn, backend.options))

    @functools.wraps(fn)
    def warm_compiled(*args: Any, **kwargs: Any) -> Any:
        return warm(*args, **kwargs)

    warm_compiled._ember_backend = backend  # type: ignore[attr-defined]
    warm_compiled._ember_warm_start = warm  # type: ignore[attr-defined]
    warm_compiled._torchdynamo_orig_callable = fn  # type: ignore[attr-defined] - what explain reports on
    return warm_compiled
