"""Every private PyTorch API Ember relies on, in one place.

Ember supports torch 2.11 and newer. The names below are not public and move between releases;
each wrapper says what it stands for, and where an API is missing it degrades the way its
callers expect (documented per function) instead of failing a compile. Nothing else in Ember
touches ``torch._C`` or ``torch._guards``; passes and the runtime import from here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

log = logging.getLogger("ember.compat")


# --- storage and autograd bookkeeping (CUDA-graph runtime, memory plan) --------------------------

# How many references the C++ side holds to the storage with handle ``cdata`` (0: an expired weak
# reference). torch's builtin itself, not a wrapper: the CUDA-graph runner maps it over every
# output group before each replay, where a Python frame per group cost more than the count.
storage_use_count: Callable[[int], int] = torch._C._storage_Use_Count


@functools.cache
def storage_object_refs() -> int:
    """References a storage's Python object adds to its use count once ``untyped_storage()`` has
    made one (PyTorch keeps that object for the storage's life): the use count of a storage that
    one tensor and that object refer to, less the tensor's one. Measured once per process, so a
    release that counts differently is followed, not assumed."""
    t = torch.empty(1)
    return storage_use_count(t.untyped_storage()._cdata) - 1


def set_version_counters(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set autograd version counters, as if each tensor had been written in place (a replayed
    CUDA graph writes its inputs without autograd seeing it)."""
    torch._C._autograd._unsafe_set_version_counter(list(tensors), list(versions))


# --- CUDA caching-allocator pools (CUDA-graph runtime) ------------------------------------------

def can_route_allocations_to_pool() -> bool:
    """Whether this torch can route one thread's allocations to a private pool (torch >= 2.x)."""
    return hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool")


def begin_allocate_to_pool(device_index: int, handle: object) -> None:
    torch._C._cuda_beginAllocateCurrentThreadToPool(device_index, handle)


def end_allocate_to_pool(device_index: int, handle: object) -> None:
    """Stop routing to ``handle``'s pool and hand it back (its segments free once unused)."""
    torch._C._cuda_endAllocateToPool(device_index, handle)
    torch._C._cuda_releasePool(device_index, handle)


def cuda_driver_version() -> int | None:
    """The CUDA driver API version (e.g. 13000), None without CUDA."""
    try:
        return int(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        return None


# --- Dynamo / AOTAutograd context ----------------------------------------------------------------

def tracing_context() -> Any:
    """Dynamo's current TracingContext (None outside a compile)."""
    from torch._guards import TracingContext
    return TracingContext.try_get()


def aot_forward_metadata() -> Any:
    """AOTAutograd's ViewAndMutationMeta of the graph being compiled (None when unknown)."""
    context = tracing_context()
    return getattr(context, "fw_metadata", None) if context is not None else None


def current_compile_id() -> str | None:
    """Dynamo's id of the frame compile in progress ("0/1"), None outside one or where unknown."""
    from torch._guards import CompileContext
    cid = CompileContext.current_compile_id()
    if cid is None or not hasattr(cid, "frame_id"):
        return None
    return f"{cid.frame_id}/{cid.frame_compile_id}"


def outside_tracing() -> Any:
    """A context without the compile's tracing context: ``torch.load`` inside a backend call
    detects the fake mode of the frame being compiled and loads tensors as meta (no data)."""
    from torch._guards import tracing
    return tracing(None)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Neither the compile's tracing context nor an active fake mode: ``torch.load`` here makes
    tensors with data. Under an active FakeTensorMode torch 2.14 loads FakeTensors (the data
    silently lost) and torch 2.11 raises ("set the storage of a tensor on device meta")."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with outside_tracing(), unset_fake_temporarily():
        yield


def detect_fake_mode(inputs: Sequence[object]) -> Any:
    from torch._guards import detect_fake_mode as detect
    return detect(inputs)


def traced_producer(tensor: torch.Tensor) -> Any:
    """The FX node that produced ``tensor`` in the graph being traced with a decomposition table
    (make_fx / AOTAutograd), called from inside a decomposition; None outside such a trace or
    where the API is missing (callers then keep their general form)."""
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
        mode = get_proxy_mode()
        if mode is None:
            return None
        slot = get_proxy_slot(tensor, mode.tracer, None)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return None
    proxy = getattr(slot, "proxy", None)
    return getattr(proxy, "node", None)


def traced_tensor(node: Any) -> torch.Tensor | None:
    """The tensor the trace in progress tracks for graph ``node`` (the inverse of
    ``traced_producer``), None where it tracks none or outside a trace. A scan over the tracked
    tensors: for the few calls a decomposition makes per graph."""
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
        mode = get_proxy_mode()
        if mode is None:
            return None
        for tensor, slot in mode.tracer.tensor_tracker.items():
            if getattr(getattr(slot, "proxy", None), "node", None) is node:
                return tensor
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return None
    return None


def recompile_limit_name() -> str:
    """Dynamo's per-frame recompile limit: ``recompile_limit`` (newer) or ``cache_size_limit``."""
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


def functorch_config() -> Any:
    """AOTAutograd's config module (settings patched per compile)."""
    return torch._functorch.config


# -- warm start (capture/warm_start.py): torch's ahead-of-time compile of a whole-graph frame --------

def aot_compile_api() -> Any:
    """torch's ``aot_compile`` pieces a warm start uses, as one namespace; raises ImportError (with
    the missing name) on a torch without them."""
    import types

    from torch._dynamo import aot_compile as aot  # noqa: F401 - the module must exist
    from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
    from torch._dynamo.aot_compile_types import SerializableCallable
    from torch._dynamo.guards import CheckFunctionManager
    from torch._dynamo.hooks import Hooks
    from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._functorch._aot_autograd.schemas import AOTAutogradCacheInfo
    from torch._inductor.output_code import OutputCode
    for name in ("force_autograd_cache", "bundled_autograd_cache", "force_non_lazy_backward_lowering"):
        if not hasattr(torch._functorch.config, name):
            raise ImportError(f"torch._functorch.config.{name}")
    return types.SimpleNamespace(
        AOTCompiledFunction=AOTCompiledFunction, aot_compile_fullgraph=aot_compile_fullgraph,
        SerializableCallable=SerializableCallable, Hooks=Hooks, OutputCode=OutputCode,
        unserializable_guards=tuple(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES),
        deserialize_bundled_cache_entry=deserialize_bundled_cache_entry, AOTAutogradCache=AOTAutogradCache,
        AOTAutogradCacheInfo=AOTAutogradCacheInfo)


def bundled_entry_mode(api: Any) -> Any:
    """While active, AOTAutograd builds its bundled cache entry for each compile (the forward/backward
    split, its runtime metadata and each compiled graph's OutputCode) WITHOUT looking in or writing
    to its own on-disk cache: the entry travels only inside Ember's warm-start file, under Ember's
    key. (A lookup there could return a program compiled for other Ember options, or Inductor's.)"""
    import contextlib
    import dataclasses
    import inspect
    import time
    import uuid
    from unittest import mock

    # torch 2.14's try_load returns (compiled or None, the config carrying the cache info); older
    # releases return the compiled function or None and set the info on the config in place.
    returns_config = "tuple" in str(inspect.signature(api.AOTAutogradCache.try_load).return_annotation)

    def try_load(mod: Any, args: Any, aot_config: Any, *rest: Any, **kw: Any) -> Any:
        try:
            info = api.AOTAutogradCacheInfo(f"ember-{uuid.uuid4().hex}", time.time_ns(), forward_symints=[])
        except TypeError:  # a release whose cache info has no forward_symints
            info = api.AOTAutogradCacheInfo(f"ember-{uuid.uuid4().hex}", time.time_ns())
        if returns_config:
            return None, dataclasses.replace(aot_config, cache_info=info)
        aot_config.cache_info = info
        return None

    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch({
        "force_autograd_cache": True, "bundled_autograd_cache": True, "force_non_lazy_backward_lowering": True}))
    stack.enter_context(mock.patch.object(api.AOTAutogradCache, "try_load", staticmethod(try_load)))
    stack.enter_context(mock.patch.object(api.AOTAutogradCache, "_write_to_local_cache",
                                          staticmethod(lambda key, content: None)))
    return stack


def builtin_references_allowed() -> Any:
    """While active, a function compiled ahead of time may read builtins (``type``, ``len``) as
    globals. torch 2.11's AOT compile checks that every name the traced bytecode reads with
    LOAD_GLOBAL is among the globals it saved, and saved no builtins, so a model whose bytecode
    reads one (bert's does) could not be compiled ahead, nor loaded ("Missing required external
    references: ['type']"); torch 2.14 saves them. A function made from those globals finds its
    builtins through the interpreter's, so the check may pass over them."""
    import builtins
    from unittest import mock

    env = getattr(importlib.import_module("torch._dynamo.convert_frame"), "GraphRuntimeEnv", None)
    if getattr(env, "_check_external_refs", None) is None:
        return contextlib.nullcontext()

    def check(self: Any, f_globals: dict[str, Any]) -> None:
        missing = sorted(ref for ref in self.external_refs if ref not in f_globals and not hasattr(builtins, ref))
        if missing:  # torch's own error for what is really missing
            raise RuntimeError(f"Missing required external references: {missing}. "
                               "Please load AOT compiled function with `f_globals=<enclosing global scope>`")

    return mock.patch.object(env, "_check_external_refs", check)


def _reduce_by_init_fields(self: Any) -> tuple:
    import dataclasses
    return (self.__class__, tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init))


@contextlib.contextmanager
def guard_sources_pickled_by_init_fields() -> Iterator[None]:
    """While active, Dynamo's guard sources pickle the fields their ``__init__`` takes, and only those.
    torch 2.11's ``dataclass_with_cached_hash`` pickles a source as its class called with every field,
    also those set in ``__post_init__`` (``DefaultsSource``'s ``field`` and ``_name``), so a saved guard
    on a function's default argument (a model's forward inlined into a whole step's ``train_fn``) is
    written but cannot be loaded ("DefaultsSource.__init__() takes from 3 to 4 positional arguments but
    6 were given"); later torch pickles the init fields only, which this does for every version."""
    import dataclasses

    try:
        from torch._guards import Source
    except ImportError:
        yield
        return
    patched: dict[type, Any] = {}
    stack: list[type] = [Source]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        reduce = cls.__dict__.get("__reduce__")
        if (reduce is not None and "dataclass_with_cached_hash" in getattr(reduce, "__qualname__", "")
                and dataclasses.is_dataclass(cls) and not all(f.init for f in dataclasses.fields(cls))):
            patched[cls] = reduce
            cls.__reduce__ = _reduce_by_init_fields
    try:
        yield
    finally:
        for cls, reduce in patched.items():
            cls.__reduce__ = reduce


@contextlib.contextmanager
def inlined_sources_recorded_once() -> Iterator[None]:
    """While active, Dynamo's package records each inlined function's source once per package.
    For a compile it will save, Dynamo records the source of every function it inlines, each time it
    inlines it (``SourceInfo.add_code``: the function's lines through ``inspect``, checked against
    its module's lines, hashed): a model of twelve identical layers records one forward twelve
    times, and each record tokenizes the function again. A code object already recorded into the
    same ``SourceInfo`` gives the same record, so it is skipped (by identity: equal code objects
    of two files are recorded apart)."""
    from unittest import mock

    try:
        from torch._dynamo.package import SourceInfo
    except ImportError:
        yield
        return
    add = getattr(SourceInfo, "add_code", None)
    if add is None:
        yield
        return
    seen: dict[int, tuple[object, dict[int, object]]] = {}  # id(SourceInfo) -> (it, {id(code): code})

    def add_once(self: Any, code: Any) -> None:
        _, done = seen.setdefault(id(self), (self, {}))  # holding both keeps their ids unique
        if id(code) in done:
            return
        add(self, code)
        done[id(code)] = code

    with mock.patch.object(SourceInfo, "add_code", add_once):
        yield


_UNPICKLE_TENSOR_PARAMS = ["cls", "meta_tensor", "device", "pytype", "dispatch_keys_raw", "grad"]


@contextlib.contextmanager
def guard_tensors_unpickled_in_one_fake_mode() -> Iterator[None]:
    """While active, the tensors of Dynamo's saved guards load as fakes of one ``FakeTensorMode``.
    torch's ``GuardsStatePickler._unpickle_tensor`` builds a mode per tensor, and a mode's
    constructor extracts the Python stack: resnet50's warm-start load on an H100 host, 322 tensors,
    0.112 s of a 1.001 s load under cProfile (0.085 s of it the stacks). The guards read only each
    fake's metadata (sizes, strides, dtype, device, dispatch keys), which one mode gives alike; in
    a trace, too, every input is a fake of one mode. A torch whose helper takes other parameters
    keeps its own."""
    import inspect
    from unittest import mock

    try:
        from torch._dynamo.guards import GuardsStatePickler
    except ImportError:
        yield
        return
    original = GuardsStatePickler.__dict__.get("_unpickle_tensor")
    if not isinstance(original, classmethod) or list(
            inspect.signature(original.__func__).parameters) != _UNPICKLE_TENSOR_PARAMS:
        yield
        return
    shared: list[Any] = []

    def unpickle_tensor(cls: type, meta_tensor: torch.Tensor, device: torch.device, pytype: type,
                        dispatch_keys_raw: int, grad: Any) -> torch.Tensor:
        if not shared:
            from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode
            shared.extend([FakeTensorMode(), FakeTensorConverter()])
        mode, converter = shared
        out = converter.from_meta_and_device(mode, meta_tensor, device, pytype,
                                             torch._C.DispatchKeySet.from_raw_repr(dispatch_keys_raw))
        out.grad = grad
        return out

    with mock.patch.object(GuardsStatePickler, "_unpickle_tensor", classmethod(unpickle_tensor)):
        yield


@contextlib.contextmanager
def frame_names_shortened_once() -> Iterator[None]:
    """While active, torch's ``shorten_filename`` (a ``commonpath`` per call) answers each file name
    once. Rebuilding saved guards names each guard's user frame in its failure message: bert's
    warm-start load on an H100 host, 1,460 frames, 0.058 s under cProfile, over a few dozen files.
    Same text either way."""
    from unittest import mock

    import torch.utils._traceback as tb

    original = tb.shorten_filename
    names: dict[tuple[str, str | None], str] = {}

    def shorten_filename(fn: str, *, base: str | None = None) -> str:
        key = (fn, base)
        if key not in names:
            names[key] = original(fn, base=base)
        return names[key]

    with mock.patch.object(tb, "shorten_filename", shorten_filename):
        yield


def lazy_graph_modules() -> Any:
    """GraphModules made inside write their Python code only when it is read or run. torch's own
    frame compile sets this (``convert_frame``, ``config.use_lazy_graph_module``); its ahead-of-time
    compile, the warm start's path, does not, and AOTAutograd's graphs there were each written out
    at construction (bert's training trace on a 2-core CPU: 15 codegens, 1.1-1.4 s; 8 with it,
    0.5 s), though Ember never runs them."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        return contextlib.nullcontext()
    return _use_lazy_graph_module(bool(torch._dynamo.config.use_lazy_graph_module))
