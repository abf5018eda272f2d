"""The frame cache: a Dynamo frame compiled before, in any process, skips AOTAutograd and Ember.

Ember's program cache (runtime/artifacts.py) keys each ATen graph, so a warm process still pays
AOTAutograd's trace of every frame to find the key. This cache sits one level up, as Inductor's
AOTAutograd cache does: it keys the *Dynamo* graph the backend receives, and stores what
AOTAutograd made of it, its runtime wrapper (forward/backward split, ``ViewAndMutationMeta``)
around Ember's programs, as AOTAutograd's bundled cache entry holding ``EmberOutputCode``s
(capture/warm_artifact.py, the warm start's format). Every frame Dynamo hands to Ember takes part:
graph breaks or not, module or function, training or inference. Dynamo's own bytecode trace and
guards still run in every process; only what follows them is skipped.

The key (``frame_key``): the program cache's graph key of the Dynamo graph (its code, each
input's shape/stride/dtype/device/requires_grad, small constants by value, torch/triton/Ember
versions and Ember's source digest, the device's name), plus what AOTAutograd's result depends on
beyond the graph (what torch's AOTAutogradCache key covers and applies here): grad mode, autocast
outside the graph, deterministic algorithms, default dtype, matmul precision flags, AOTAutograd's
config; each input's aliasing (storage shared with an earlier input, offset, view), whether it is a
parameter or static input; Ember's options and settings, the tuning database's stamp, the frame's
target.

Refused (compiled as before, the reason in the log): ``frame_cache=False``, ``cache=False``,
``check``/``debug_dir``/``DEBUG`` or active instruments (every stage asked for), a warm start's own compile (it saves
the frame itself), dynamic shapes, a tensor subclass or symbolic input, ``call_module`` nodes,
a call of a function that is not torch's, ``operator``'s, ``math``'s or a builtin (a function
allowed in the graph could change while the graph text does not), a higher-order op, a custom
op outside aten/prims/Ember's, an argument that is not a plain constant, a constant tensor larger
than the graph key hashes or one that requires grad.

Storage: the ``frames`` table of ``<cache_dir>/programs.sqlite`` (WAL, checksummed rows, safe
under concurrent processes). A row that fails its checksum, cannot be unpickled or does not link
is deleted and the frame compiled afresh; a frame whose entry cannot be made or saved is compiled
and run as before. ``ember.explain`` and ``compiled._ember_backend.log.frame_cache`` say, per frame,
what happened.
"""

from __future__ import annotations

import hashlib
import json
import operator
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

TABLE = "frames"
_SAFE_MODULES = ("operator", "_operator", "math", "builtins")
_SAFE_OP_NAMESPACES = ("aten", "prims", "ember")
_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
              torch.memory_format, type(Ellipsis))
# Settings that change nothing a compiled frame holds (the rest are part of the key).
_SETTINGS_OUTSIDE_KEY = ("debug", "strict", "compile_workers", "explain_steps", "git_commit", "cpu_background_load",
                         "cpu_background_fault", "worker_niceness", "cpu_worker_timeout_s", "whole_step_warmup")
_OPTIONS_OUTSIDE_KEY = ("progress", "debug_dir", "cache_dir", "warm_start", "frame_cache")


# -- what may be cached ------------------------------------------------------------------------------

def option_blocker(backend: Any) -> str | None:
    """Why this backend's frames are not cached at all (None: they may be)."""
    options = backend.options
    if not options.frame_cache:
        return "off (frame_cache=False)"
    if backend.output_wrapper is not None:
        return "a warm start's compile (the warm start saves this frame)"
    from ember import instruments
    now = instruments.active()
    if now.before or now.around or now.after or now.capture_rule or now.cudagraph_device is not None:
        return "instruments are active (stage hooks or CUDA-graph seams ask for every stage)"
    return warm_start_blocker(options)  # cache=False, check, debug_dir, DEBUG, a torch without the API


def warm_start_blocker(options: Any) -> str | None:
    """Why these options rule a saved frame out, for the frame cache and the warm start alike (None:
    they do not)."""
    from ember import config
    if not options.cache:
        return "cache=False"
    if options.check or options.debug_dir or config.debug_level():
        return "check, debug_dir or DEBUG ask for every stage"
    try:
        from ember.capture import warm_artifact  # noqa: F401 - needs torch's aot_compile API
    except ImportError as err:
        return f"this torch has no ahead-of-time compile API ({err})"
    return None


def graph_blocker(gm: fx.GraphModule, example_inputs: list) -> str | None:
    """Why this Dynamo graph must not be cached by its text (None: it may be)."""
    with warnings.catch_warnings():  # torch 2.14 deprecates the flag (always on there)
        warnings.simplefilter("ignore")
        inlined = getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True)
    if not inlined:
        return "parameters are graph attributes (inline_inbuilt_nn_modules=False)"
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
                return f"input {i} is a {type(x).__name__} ({x.layout})"
            if any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
                return f"input {i} has symbolic sizes"
        elif not isinstance(x, _CONSTANTS):
            return f"input {i} is a {type(x).__name__}"
    return _nodes_blocker(gm)


def _nodes_blocker(gm: fx.GraphModule) -> str | None:
    if hasattr(gm, "saved_tensors_hooks_pack_0"):
        return "saved-tensor hooks (their graphs are not in the key)"
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return f"a call_module node ({node.target})"
        if node.op == "get_attr":
            try:
                from ember.graph_utils import get_attr
                value = get_attr(gm, node.target)
            except AttributeError:
                return f"graph attribute {node.target} cannot be read"
            if not isinstance(value, torch.Tensor):
                return f"graph attribute {node.target} is a {type(value).__name__}"
            if value.requires_grad:
                return f"graph attribute {node.target} requires grad"
        elif node.op == "call_function":
            why = _target_blocker(node.target)
            if why:
                return why
        if node.op in ("call_function", "call_method") and not (_plain(node.args) and _plain(node.kwargs)):
            return f"{node.name} takes an argument that is not a plain constant"
    return None


def _target_blocker(target: Any) -> str | None:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"a higher-order op ({target.name()}: its subgraphs' annotations are not in the key)"
    if isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
    elif isinstance(target, torch._ops.OpOverloadPacket):
        namespace = target._qualified_op_name.split("::")[0]
    else:
        module = getattr(target, "__module__", None) or getattr(getattr(target, "__objclass__", None),
                                                               "__module__", None) or ""
        if module == "torch" or module.startswith("torch.") or module in _SAFE_MODULES:
            return None
        if target in vars(operator).values():
            return None
        return f"a call of {module}.{getattr(target, '__qualname__', target)} (not torch's: it may change " \
               "while the graph does not)"
    if namespace not in _SAFE_OP_NAMESPACES:
        return f"a custom op ({namespace}::...)"
    return None


def _plain(value: Any) -> bool:
    if isinstance(value, (fx.Node, *_CONSTANTS)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, slice):
        return _plain((value.start, value.stop, value.step))
    return False


# -- the key ---------------------------------------------------------------------------------------

def _inputs_detail(example_inputs: list) -> list[str]:
    """What AOTAutograd reads of the inputs beyond their metadata: aliasing, views, static inputs."""
    storages: dict[int, int] = {}
    out = []
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            out.append("-")
            continue
        storage = x.untyped_storage().data_ptr()
        first = storages.setdefault(storage, i) if x.untyped_storage().nbytes() else i
        out.append(f"{type(x).__name__} alias={first} offset={x.storage_offset()} view={int(x._is_view())} "
                   f"conj={int(x.is_conj())} neg={int(x.is_neg())} leaf={int(x.is_leaf)} "
                   f"static={getattr(x, '_dynamo_static_input_type', None)}")
    return out


def _global_state() -> dict[str, Any]:
    """The torch state outside the graph that AOTAutograd's trace reads (torch's AOTAutogradCache
    key records the same: grad mode, autocast, deterministic algorithms, AOTAutograd's config)."""
    devices = getattr(torch._C, "_autocast_supported_devices", lambda: ["cpu", "cuda"])()
    autocast = {d: str(torch.get_autocast_dtype(d)) for d in devices if torch.is_autocast_enabled(d)}
    try:
        functorch = hashlib.sha256(torch._functorch.config.save_config()).hexdigest()
    except Exception as err:  # noqa: BLE001 - a config that cannot be saved: its type goes in instead
        functorch = f"unsaved {type(err).__name__}"
    return {
        "grad": torch.is_grad_enabled(), "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "matmul": [torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                   torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                   torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32],
        "functorch": functorch,
    }


def frame_key(gm: fx.GraphModule, example_inputs: list, options: Any, target: Any) -> str | None:
    """The frame's key (see the module docstring); None when the graph key refuses (a large constant)."""
    import dataclasses
    import sys

    from ember import config
    from ember.capture import warm_artifact
    from ember.runtime.artifacts import graph_key
    from ember.tune.apply import tuning_stamp

    base = graph_key(gm, example_inputs, target.name, "dynamo frame")
    if base is None:
        return None
    opts = {k: v for k, v in vars(options).items() if k not in _OPTIONS_OUTSIDE_KEY}
    now = {f.name: getattr(config.settings(), f.name) for f in dataclasses.fields(config.settings())
           if f.name not in _SETTINGS_OUTSIDE_KEY}
    parts = {"graph": base, "inputs": _inputs_detail(example_inputs), "state": _global_state(),
             "options": repr(sorted(opts.items())), "settings": repr(sorted(now.items())),
             "tuning": tuning_stamp(options.cache_root()), "python": sys.version.split()[0],
             "format": warm_artifact.FORMAT}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# -- load, compile and store ---------------------------------------------------------------------------

def compile_frame(backend: Any, gm: fx.GraphModule, example_inputs: list, target: Any, cid: str, n: int,
                  compile_fn: Callable[[], Callable]) -> Callable:
    """The frame's compiled function: loaded from the frame cache, or ``compile_fn()`` (stored when it
    can be). Never fails where ``compile_fn()`` alone would not."""
    note = backend.log.frame_cache.append
    why = option_blocker(backend) or graph_blocker(gm, example_inputs)
    key = None
    if why is None:
        try:
            key = frame_key(gm, example_inputs, backend.options, target)
        except Exception as err:  # noqa: BLE001 - an input the key cannot describe: not cached
            why = f"no key ({type(err).__name__}: {err})"
        else:
            why = None if key is not None else "a large constant tensor in the graph"
    if why is not None or key is None:
        if not backend.output_wrapper:  # a warm start's compile logs what it does itself
            note(f"frame {cid}: not cached: {why}")
        return compile_fn()
    from ember.runtime.artifacts import ProgramStore
    store = ProgramStore(backend.options.cache_root())
    data = store.load_bytes(key, TABLE)
    if store.discarded:
        note(f"frame {cid}: a damaged frame-cache entry was discarded ({store.discarded}); compiled afresh")
    if data is not None:
        start = time.perf_counter()
        try:
            fn = _load(backend, data, cid, n)
        except Exception as err:  # noqa: BLE001 - damaged or stale: discard it, compile afresh
            store.discard(key, TABLE)
            note(f"frame {cid}: a damaged frame-cache entry was discarded ({type(err).__name__}: "
                 f"{str(err)[:200]}); compiled afresh")
        else:
            note(f"frame {cid}: loaded from the frame cache in {time.perf_counter() - start:.3f} s "
                 f"({len(data)} bytes; no AOTAutograd trace, no Ember stage)")
            return fn
    return _compile_and_store(backend, store, key, cid, compile_fn)


def _load(backend: Any, data: bytes, cid: str, n: int) -> Callable:
    from ember.capture import warm_artifact as wa
    from ember.capture.aot_settings import gc_paused

    graphs, programs = len(backend.log.graphs), len(backend.programs)
    token, frame_token = wa.LOADING.set(backend), wa.LOADING_FRAME.set((cid, n))
    try:
        with gc_paused():
            return wa.EmberCompiledFrame.deserialize_compile_artifacts(data).compiled_fn
    except BaseException:
        del backend.log.graphs[graphs:], backend.programs[programs:]  # a half-linked frame leaves no record
        raise
    finally:
        wa.LOADING.reset(token)
        wa.LOADING_FRAME.reset(frame_token)


def _compile_and_store(backend: Any, store: Any, key: str, cid: str, compile_fn: Callable[[], Callable]) -> Callable:
    from ember.capture import warm_artifact as wa
    from ember.compat import bundled_entry_mode

    note = backend.log.frame_cache.append
    graphs, programs = len(backend.log.graphs), len(backend.programs)
    backend.output_wrapper = wa.EmberOutputCode.wrap
    try:
        with bundled_entry_mode(wa.API):  # the warm start's patches: AOTAutograd makes its bundled entry
            compiled = compile_fn()
    except Exception as err:  # noqa: BLE001 - compile as before, without the entry
        del backend.log.graphs[graphs:], backend.programs[programs:]
        note(f"frame {cid}: not cached: the compile that makes the entry failed ({type(err).__name__}: "
             f"{str(err)[:200]}); compiled as before")
        backend.output_wrapper = None
        return compile_fn()
    finally:
        backend.output_wrapper = None
    try:
        data = wa.EmberCompiledFrame.serialize_compile_artifacts(wa.EmberCompiledFrame(compiled))
    except Exception as err:  # noqa: BLE001 - it runs in this process, just not stored
        note(f"frame {cid}: not cached: {type(err).__name__}: {str(err)[:200]}")
        return compiled
    if store.save_bytes(key, data, f"frame {cid}", TABLE):
        note(f"frame {cid}: compiled and stored in the frame cache ({len(data)} bytes)")
    else:
        note(f"frame {cid}: not cached: {store.error}")
    return compiled
