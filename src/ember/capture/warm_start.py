"""Warm start: a new process runs a model Ember compiled before without tracing it again.

On by default for CPU compiles (``config.Options``: unset ``warm_start`` resolves to on when the
device or target is the CPU or no CUDA device is present); ``ember.compile(model, warm_start=True)``
(or ``EMBER_WARM_START=1``) turns it on everywhere. For an ``nn.Module`` whose
``forward`` Dynamo captures as ONE graph, the first call of each input signature goes through
torch's ahead-of-time compile (``torch._dynamo.aot_compile.aot_compile_fullgraph``): Dynamo's
guards and bytecode plus Ember's backend result (capture/warm_artifact.py: AOTAutograd's
forward/backward split and Ember's programs) are saved in ``<cache>/warm_start/<key>.ember-warm``.
A later process computes the same key, loads that file, checks Dynamo's saved guards and the
traced sources, and runs: no Dynamo trace, no AOTAutograd, no Ember stage.

What keeps a stale program out:
- The file's key: Ember's version and source digest, torch/triton/Python versions, the tuning
  database's stamp, the device's name, Ember's options, the model's class and a hash of the source
  files of every module class in it, every parameter's and buffer's name/shape/dtype/device/
  requires_grad, the training flags, the inputs' shapes/strides/dtypes/devices/requires_grad,
  grad mode and autocast state.
- Dynamo's guards, saved with the frame and checked on every call (tensor shapes, dtypes, devices,
  strides of inputs and parameters, module types, grad mode, global torch state). torch drops the
  guards it cannot serialise (guards on module globals, ID_MATCH and the like, listed in
  ``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``); the key stands in for those it can
  (sources, module classes), not for the *value* of a module global the forward reads.
- Identity guards torch cannot save (a code object's or a builtin's id, e.g. transformers' decorated
  forward and its GELU's builtin): re-checked on every call by what the object is
  (capture/warm_rechecks.py).
- The source of every function Dynamo traced, checked against the file's checksums on load.
- A damaged or unreadable file: a warning, the file removed, a fresh compile.

A forward Dynamo cannot capture whole (a graph break), a module with forward hooks, ``check=True``,
``debug_dir``, ``cache=False`` or a torch without this API: today's path, and ``explain`` says why.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import os
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ember import compat
from ember.capture.frame_cache import warm_start_blocker
from ember.capture.warm_rechecks import (
    GuardGlobals,
    Rechecks,
    class_source,
    closure_values,
    recheck_for,
    replaceable,
)
from ember.config import settings
from ember.runtime.library_warmup import BackgroundReplay, replay_here
from ember.runtime.library_warmup import collecting as collecting_library_calls

MAGIC = b"EMBERWARM2\n"
SUFFIX = ".ember-warm"
OFF_SUFFIX = ".ember-warm-off"  # the model cannot warm start at this key: why (a text file)
MAX_FILES_PER_KEY = 8  # saved programs of one key that differ in re-checked values (global flags)


def unavailable(model: object, options: Any) -> str | None:
    """Why ``model`` cannot warm start with ``options`` (None: it can)."""
    if not isinstance(model, torch.nn.Module):
        return "only an nn.Module's forward warm starts"
    if model._forward_hooks or model._forward_pre_hooks or model._backward_hooks or model._backward_pre_hooks:
        return "the module has hooks (a warm start compiles forward, not the hooks around it)"
    return warm_start_blocker(options)


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _value_signature(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{x.dtype}{tuple(x.shape)}{x.stride()}{x.device}{int(x.requires_grad)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}[{','.join(_value_signature(v) for v in x)}]"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k!r}:{_value_signature(v)}" for k, v in x.items()) + "}"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)[:200]
    return type(x).__qualname__


def _aliasing(args: tuple, kwargs: dict) -> str:
    """Which tensor inputs are one object passed twice ("" when none is): Dynamo traces such a call
    with one input for both, and the guard that says so (DUPLICATE_INPUT) is one torch may not
    save, so the pattern is part of the key."""
    leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    first: dict[int, int] = {}
    pattern = [first.setdefault(id(x), i) for i, x in enumerate(leaves)]
    return "" if pattern == list(range(len(leaves))) else f"|same={pattern}"


def call_key(args: tuple, kwargs: dict) -> str:
    """What selects a saved frame before its guards are checked: the inputs and global modes."""
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return (f"{_value_signature(args)}|{_value_signature(kwargs)}|grad={torch.is_grad_enabled()}|{autocast}"
            f"{_aliasing(args, kwargs)}")


def _device_name(args: tuple, kwargs: dict, model: torch.nn.Module) -> str:
    tensors = [t for t in (*args, *kwargs.values(), *model.parameters(), *model.buffers()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cuda":
            return torch.cuda.get_device_name(t.device)
    return "cpu"


def graph_stand_ins() -> str:
    """The CUDA-graph parts instruments replace (tests run CUDA graphs through a CPU stand-in): a
    program saved under them carries the capture decisions made for them, so they are in the key."""
    from ember.instruments import active
    hooks = active()
    return repr([None if h is None else type(h).__qualname__ for h in (hooks.cudagraph_device, hooks.capture_rule)])


def model_key(model: torch.nn.Module, options: Any, ckey: str, args: tuple, kwargs: dict) -> tuple[str, dict]:
    """The file key (see the module docstring) and its parts, for the file's readable header."""
    from ember.runtime.artifacts import _versions
    from ember.tune.apply import tuning_stamp
    opts = {k: v for k, v in vars(options).items() if k not in ("progress", "debug_dir", "cache_dir")}
    parts = {
        "versions": f"{_versions()} python {sys.version.split()[0]}",
        "device": _device_name(args, kwargs, model),
        "tuning": tuning_stamp(options.cache_root()),
        "options": repr(sorted(opts.items())),
        "graph_stand_ins": graph_stand_ins(),
        "model": class_source(type(model)),
        "classes": sorted(class_source(t) for t in {type(m) for m in model.modules()}),
        "state": [f"{n}:{_value_signature(t)}" for n, t in (*model.named_parameters(), *model.named_buffers())],
        "training": [m.training for m in model.modules()],
        "call": ckey,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return digest, parts


class WarmStart:
    """The compiled module's ``forward`` with warm starts (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, backend: Any, dynamo_forward: Callable, off: str | None) -> None:
        self.model = model
        self.backend = backend
        self.dynamo_forward = dynamo_forward
        # (call key, torch's AOTCompiledFunction, the identity guards Ember re-checks: warm_rechecks.py)
        self.entries: list[tuple[str, Any, Rechecks]] = []
        self.off = off
        if off:
            self.note(f"off: {off}")

    def note(self, line: str) -> None:
        self.backend.log.warm_start.append(line)

    # -- what is compiled: a module's forward here; a function in capture/warm_function.py ----------

    def traced(self) -> Callable:
        """The callable torch's ahead-of-time compile captures."""
        return self.model.forward

    def bound(self, args: tuple) -> tuple:
        """The positional arguments of ``traced`` for a call with ``args`` (the module comes first)."""
        return (self.model, *args)

    def frame_globals(self) -> dict:
        """The globals the traced bytecode runs with."""
        return _forward_globals(self.model)

    def external_data(self) -> dict[str, object]:
        """Objects the saved frame refers to that are taken from this process, not from the file."""
        return _closure_functions(self.model)

    def keeps_guard(self, entry: Any) -> bool:
        """Whether torch saves a guard it can save; a module's guards on globals are Ember's re-checks
        (warm_rechecks.py: torch's default filter drops them for a module's forward)."""
        return not entry.is_global

    def key(self, ckey: str, args: tuple, kwargs: dict) -> tuple[str, dict]:
        return model_key(self.model, self.backend.options, ckey, args, kwargs)

    def recheck_names(self) -> dict[str, Any]:
        """What the re-checks' expressions may name besides the call's arguments."""
        forward = type(self.model).forward
        closure = closure_values(forward) if isinstance(forward, types.FunctionType) else {}
        return {**closure, "self": self.model, "G": GuardGlobals(self.frame_globals())}  # a decorator's `func`

    def recheck(self, rechecks: Rechecks, args: tuple, kwargs: dict) -> str | None:
        """The first re-check that fails for this call (None: all hold), by description."""
        return rechecks.failing(self.recheck_names(), self.traced(), args, kwargs)

    def rechecks_hold(self, rechecks: Rechecks, args: tuple, kwargs: dict) -> bool:
        """Whether the re-checks hold for a later call (by identity, as Dynamo's guards in a process)."""
        return rechecks.holds(self.recheck_names, self.traced(), args, kwargs)

    def folder(self) -> Path:
        return Path(self.backend.options.cache_root()) / "warm_start"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.backend.call_clock.calls += 1  # a model call (runtime/cudagraphs/call_sites.py)
        if self.off or _global_hooks():
            return self.dynamo_forward(*args, **kwargs)
        ckey = call_key(args, kwargs)
        for key, fn, rechecks in self.entries:
            if (key == ckey and fn.guard_check(*self.bound(args), **kwargs)
                    and self.rechecks_hold(rechecks, args, kwargs)):
                return fn.fn(*self.bound(args), **kwargs)
        if len(self.entries) >= max(1, self.backend.options.max_recompiles):
            return self.dynamo_forward(*args, **kwargs)  # Dynamo's recompiles and dynamic shapes take over
        if self.inference_with_grad():
            return self.dynamo_forward(*args, **kwargs)
        with self.backend.shape_policy():
            fn = self._load_or_compile(ckey, args, kwargs)
        if fn is None:
            return self.dynamo_forward(*args, **kwargs)
        fn, rechecks = fn
        try:
            out = fn.fn(*self.bound(args), **kwargs)
        except Exception as err:  # noqa: BLE001 - never fail where today's path works
            # A torch whose internals differ from what the warm start was written against fails
            # here, before the program runs: warn once and take today's path for good.
            self.off = f"the warm-start program failed on its first call ({type(err).__name__}: {str(err)[:200]})"
            self.note(f"off: {self.off}")
            warnings.warn(f"ember: {self.off}; compiling without warm start", RuntimeWarning, stacklevel=2)
            return self.dynamo_forward(*args, **kwargs)
        self.entries.append((ckey, fn, rechecks))
        from ember.runtime.cpu_background import LOADER
        for line in LOADER.problems:  # a background load that failed was redone on this thread
            self.note(f"background CPU load: {line}")
        return out

    def inference_with_grad(self) -> bool:
        """An eval-mode module called with gradients on and trainable parameters: most likely
        inference that no backward follows. A saved frame holds its backward compiled (torch's
        ahead-of-time compile lowers it with the forward), which Dynamo's path compiles only when a
        backward first runs, so such calls keep Dynamo's path (``torch.no_grad()`` warm-starts)."""
        if self.model.training or not torch.is_grad_enabled():
            return False
        if not any(p.requires_grad for p in self.model.parameters()):
            return False
        if not getattr(self, "_noted_grad", False):
            self._noted_grad = True
            self.note("not used for this call: the module is in eval mode with gradients on (its backward "
                      "would be compiled too); Dynamo's path, or call it under torch.no_grad()")
        return True

    # -- load ----------------------------------------------------------------------------------

    def _load_or_compile(self, ckey: str, args: tuple, kwargs: dict) -> Any:
        key, parts = self.key(ckey, args, kwargs)
        stem = key[:40]
        refused = _off_marker(self.folder() / stem)
        if refused.exists():  # an earlier process found guards no re-check covers: Dynamo's path
            self.off = f"{refused.read_text()[:300]} (found by an earlier process: {refused.name})"
            self.note(f"off: {self.off}")
            return None
        # One file per set of re-checked values (a global flag set either way): newest first.
        saved = sorted(self.folder().glob(f"{stem}*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
        from ember.capture.aot_settings import gc_paused

        for path in saved:
            start = time.perf_counter()
            try:
                with gc_paused():  # loading allocates as a compile does (capture/aot_settings.py)
                    fn = self._load(path, args, kwargs)
            except Exception as err:  # noqa: BLE001 - damaged, truncated or from elsewhere: compile afresh
                warnings.warn(f"ember: the warm-start file {path} cannot be used ({type(err).__name__}: "
                              f"{str(err)[:300]}); compiling afresh", RuntimeWarning, stacklevel=4)
                path.unlink(missing_ok=True)
                self.note(f"damaged file removed ({type(err).__name__}); compiled afresh")
            else:
                if fn is not None:
                    self.note(f"loaded {path.name} in {time.perf_counter() - start:.3f} s (no trace)")
                    return fn
        for old in saved[MAX_FILES_PER_KEY - 1:]:  # the oldest give way to the one about to be saved
            old.unlink(missing_ok=True)
        with gc_paused():  # Dynamo's trace, the guards and the save too: one collection at the end
            return self._compile(self.folder() / stem, parts, args, kwargs)

    def _load(self, path: Path, args: tuple, kwargs: dict) -> Any:
        blob = path.read_bytes()
        if not blob.startswith(MAGIC):
            raise ValueError("not an Ember warm-start file")
        n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
        head = json.loads(blob[len(MAGIC) + 8:len(MAGIC) + 8 + n])
        data = blob[len(MAGIC) + 8 + n:]
        rechecks = Rechecks(head.get("rechecks", []))
        modules = head.get("modules", {})
        if _checksum(data, rechecks.items, modules) != head.get("sha256"):
            raise ValueError("checksum mismatch")
        # cuDNN's and cuBLAS's first-call set-up in a helper thread while this one loads
        library = head.get("library_calls") or []
        helper = BackgroundReplay(library) if library and settings().library_warmup else None
        here = None
        try:
            linked = self._link_saved(path, data, rechecks, modules, args, kwargs)
            if linked is not None and helper is not None:
                here = replay_here(library)  # this thread runs the forward: its own plans, meanwhile
            return linked
        finally:
            if helper is not None:
                replayed = helper.join()
                self.note(f"beside the load: {replayed.describe()}" if replayed else
                          "beside the load: the library set-up thread ended without a result")
                if here is not None and here.calls:
                    self.note(f"on this thread after the load: {here.describe()}")

    def _link_saved(self, path: Path, data: bytes, rechecks: Rechecks, modules: dict[str, str], args: tuple,
                    kwargs: dict) -> Any:
        from ember.capture import warm_artifact as wa
        f_globals = {**self.frame_globals(), **{name: importlib.import_module(m) for name, m in modules.items()}}
        token = wa.LOADING.set(self.backend)
        try:
            closure = self.external_data()
            with compat.builtin_references_allowed(), compat.guard_tensors_unpickled_in_one_fake_mode(), \
                    compat.frame_names_shortened_once():
                fn = (wa.API.AOTCompiledFunction.deserialize(data, f_globals=f_globals, external_closure_data=closure)
                      if closure else wa.API.AOTCompiledFunction.deserialize(data, f_globals=f_globals))
        finally:
            wa.LOADING.reset(token)
        changed = _changed_sources(fn)
        if changed:
            self.note(f"source changed since {path.name} was saved ({changed}); compiled afresh")
            return None
        if not fn.guard_check(*self.bound(args), **kwargs):
            self.note(f"{path.name}: a saved guard fails for this call; compiled afresh")
            return None
        failed = self.recheck(rechecks, args, kwargs)
        if failed:
            self.note(f"{path.name}: a re-checked guard fails ({failed}); compiled afresh")
            return None
        return fn, rechecks

    # -- compile and save -----------------------------------------------------------------------

    def _compile(self, path: Path, parts: dict, args: tuple, kwargs: dict) -> Any:
        """Trace and compile through torch's ahead-of-time compile; save the result as ``path``
        (the key's stem) plus the digest of its re-checks."""
        from ember.capture import warm_artifact as wa
        from ember.compat import bundled_entry_mode

        backend = self.backend
        dropped: list[str] = []
        unchecked: list[str] = []
        rechecked: list[list] = []

        def keep(entries: list) -> list[bool]:
            out = []
            for g in entries:
                if not self.keeps_guard(g):  # a global: Ember re-checks it, or nothing may be saved
                    item = recheck_for(g, self.frame_globals())
                    (rechecked if item else unchecked).append(item or f"{g.guard_type} {g.name}")
                    out.append(False)
                elif g.guard_type in wa.API.unserializable_guards:  # an identity: re-checked where it can be
                    item = recheck_for(g, self.frame_globals())
                    (rechecked if item else dropped).append(item or f"{g.guard_type} {g.name}")
                    out.append(False)
                elif (item := replaceable(g, wa.API.unserializable_guards)) is not None:
                    rechecked.append(item)  # torch cannot save it: Ember re-checks it
                    out.append(False)
                else:
                    out.append(True)
            return out

        def serializable_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            with bundled_entry_mode(wa.API):
                return wa.EmberCompiledFrame(backend(gm, example_inputs))

        backend.output_wrapper = wa.EmberOutputCode.wrap
        from ember.capture.backend import WARM_COMPILE_ID
        compile_id = WARM_COMPILE_ID.set(f"warm/{len(self.entries)}")  # the graphs' titles and the log
        try:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True), \
                    collecting_library_calls() as library_calls, \
                    _functions_by_code(), compat.builtin_references_allowed(), \
                    compat.guard_sources_pickled_by_init_fields(), compat.inlined_sources_recorded_once(), \
                    compat.lazy_graph_modules():
                fn = wa.API.aot_compile_fullgraph(self.traced(), (args, kwargs), wa.API.Hooks(guard_filter_fn=keep),
                                                  serializable_backend)
        except Exception as err:  # noqa: BLE001 - a graph break, or anything torch's AOT compile refuses
            self.off = f"no whole-graph capture ({type(err).__name__}: {_first_line(err)})"
            self.note(f"off: {self.off}; today's path (Dynamo, graph breaks allowed) from now on")
            # The same code at the same key breaks again: later processes go straight to Dynamo's
            # path instead of tracing up to the break first.
            _write_marker(_off_marker(path), self.off)
            return None
        finally:
            backend.output_wrapper = None
            WARM_COMPILE_ID.reset(compile_id)
        self.note(f"compiled and traced; {len(dropped)} guard(s) torch cannot save were dropped "
                  f"({', '.join(sorted(set(g.split()[0] for g in dropped)))})" if dropped else "compiled and traced")
        rechecks = Rechecks(rechecked)
        failed = None if unchecked else self.recheck(rechecks, args, kwargs)
        if unchecked or failed:
            # Saved without them, the program could run where Dynamo would trace again: this model
            # keeps Dynamo's path, here and (through the marker file) in later processes.
            kinds = sorted({u.split()[0] for u in unchecked})
            self.off = (f"{len(unchecked)} guard(s) on globals no re-check covers ({', '.join(kinds)}; "
                        f"first: {unchecked[0].split(maxsplit=1)[1][:120]})" if unchecked
                        else f"a re-check does not hold where it was made ({failed})")
            self.note(f"off: {self.off}; today's path (Dynamo) from now on")
            _write_marker(_off_marker(path), self.off)
            return None
        if rechecked:
            self.note(f"{len(rechecked)} guard(s) torch cannot save (on globals, by identity) are re-checked by Ember")
        try:
            modules = _installed_modules(fn, self.frame_globals())
            closure = self.external_data()
            with compat.builtin_references_allowed(), compat.guard_sources_pickled_by_init_fields():
                result = (wa.API.AOTCompiledFunction.serialize(fn, closure) if closure
                          else wa.API.AOTCompiledFunction.serialize(fn))
            data = getattr(result, "serialized_data", result)  # torch >= 2.13 wraps the bytes
            variant = hashlib.sha256(json.dumps(rechecked, default=str).encode()).hexdigest()[:12]
            path = path.with_name(f"{path.name}-{variant}{SUFFIX}")
            _write(path, data, parts, rechecked, modules, library_calls)
            self.note(f"saved {path.name} ({len(data)} bytes)")
        except Exception as err:  # noqa: BLE001 - it still runs in this process, just not saved
            self.note(f"not saved: {type(err).__name__}: {_first_line(err)}")
        return fn, rechecks


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines() or [""])[0][:300]


def _forward_globals(model: torch.nn.Module) -> dict:
    forward = type(model).forward
    return getattr(forward, "__globals__", {})


def _installed_modules(fn: Any, f_globals: dict) -> dict[str, str]:
    """Globals Dynamo installed for the traced bytecode under names holding an object's id
    (``___module_collections_<id>_c0``): a new process has no such name, so each module among them
    is saved by its import name. Raises if the bytecode needs another such object (not saved then)."""
    import builtins
    env = getattr(getattr(fn, "_artifacts", None), "runtime_env", None)
    modules: dict[str, str] = {}
    known = {**(getattr(env, "import_sources", None) or {}), **(getattr(env, "used_globals", None) or {})}
    for ref in sorted(getattr(env, "external_refs", None) or ()):  # a torch without the record: none
        if ref in known or hasattr(builtins, ref):
            continue
        value = f_globals.get(ref)
        if isinstance(value, types.ModuleType) and ref.startswith("___"):
            modules[ref] = value.__name__
        elif ref not in f_globals or ref.startswith("___"):
            raise RuntimeError(f"the traced bytecode reads {ref}, an object Dynamo names by its id in this process")
    return modules


def _functions_by_code() -> Any:
    """While Dynamo saves its guards: a function whose qualified name leads to another object (a
    decorated method's undecorated original, which ``functools.wraps`` gave its name to the wrapper)
    is saved by its code, module and defaults, as torch saves a nested function, instead of as
    missing (torch's "fqn mismatch"), which fails any guard that reads it on load. One with a closure
    keeps torch's rule (its cells may hold what cannot be saved)."""
    import contextlib
    from unittest import mock

    try:
        from torch._dynamo.guards import GuardsStatePickler
        original = GuardsStatePickler.reducer_override
        GuardsStatePickler._unpickle_nested_function  # noqa: B018 - a torch without it: leave torch's rule
    except (ImportError, AttributeError):
        return contextlib.nullcontext()

    def reducer_override(self: Any, obj: Any) -> Any:
        if (inspect.isfunction(obj) and "<locals>" not in obj.__qualname__
                and obj.__module__ in sys.modules):
            found: Any = sys.modules[obj.__module__]
            for name in obj.__qualname__.split("."):
                found = getattr(found, name, None)
            if found is not obj:
                return type(self)._unpickle_nested_function, (obj.__code__, obj.__module__, obj.__qualname__,
                                                              obj.__defaults__, obj.__closure__)
        return original(self, obj)

    return mock.patch.object(GuardsStatePickler, "reducer_override", reducer_override)


def _closure_functions(model: torch.nn.Module) -> dict[str, object]:
    """The functions in the closure of the module's forward (a decorator's wrapper: transformers'
    ``can_return_tuple`` holds the undecorated forward). torch pickles a function by its name, which
    names the wrapper, not it: they travel as external data instead, taken from this process on load.
    The traced sources and the identity re-checks (warm_rechecks.py) cover what they are."""
    func = getattr(model.forward, "__func__", None)
    cells = getattr(func, "__closure__", None) or ()
    return {f"ember_forward_closure_{i}": c.cell_contents for i, c in enumerate(cells)
            if isinstance(getattr(c, "cell_contents", None), types.FunctionType)}


def _changed_sources(fn: Any) -> str:
    """The first traced source whose text differs from what the file was saved from ("" if none)."""
    from torch._dynamo import package
    try:
        infos = fn.source_info().inlined_sources
    except Exception:  # noqa: BLE001
        return "no source record"
    for src in infos:
        module = sys.modules.get(src.module)
        try:
            if module is None:
                import importlib
                module = importlib.import_module(src.module)
            text = "".join(package._get_sourcelines(module, src.firstlineno, src.lastlineno))
            if package._hash_source(text) != src.checksum:
                return f"{src.module} lines {src.firstlineno}-{src.lastlineno}"
        except Exception as err:  # noqa: BLE001 - cannot check it: treat as changed
            return f"{src.module}: {type(err).__name__}"
    return ""


def _checksum(data: bytes, rechecks: list[list[str]], modules: dict[str, str]) -> str:
    return hashlib.sha256(data + json.dumps([rechecks, modules], sort_keys=True).encode()).hexdigest()


def _write(path: Path, data: bytes, parts: dict, rechecks: list[list[str]], modules: dict[str, str],
           library_calls: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"sha256": _checksum(data, rechecks, modules), "rechecks": rechecks, "modules": modules,
                       "key": parts, "library_calls": library_calls}, default=str).encode()
    buf = io.BytesIO()
    buf.write(MAGIC)
    buf.write(len(head).to_bytes(8, "little"))
    buf.write(head)
    buf.write(data)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, prefix=".warm-") as tmp:
        tmp.write(buf.getvalue())
    os.replace(tmp.name, path)


def _off_marker(stem: Path) -> Path:
    """The file saying why the model at this key (``stem``: the folder and the key) cannot warm start."""
    return stem.with_name(f"{stem.name}{OFF_SUFFIX}")


def _write_marker(path: Path, reason: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=".warm-") as tmp:
            tmp.write(reason)
        os.replace(tmp.name, path)
    except OSError:  # a read-only cache: the next process finds out again
        pass


def install(compiled: torch.nn.Module, model: torch.nn.Module, backend: Any) -> None:
    """Route the compiled module's calls through a WarmStart (ember.compile(warm_start=True))."""
    warm = WarmStart(model, backend, compiled.forward, unavailable(model, backend.options))
    compiled.forward = warm
    object.__setattr__(compiled, "_ember_warm_start", warm)
