"""Ember: compile PyTorch models into library calls plus generated kernels, and say what ran where.

    model = ember.compile(model)          # or torch.compile(model, backend="ember")
    print(ember.explain(model, x))        # what ran where, and why
    step = ember.compile_step(lambda x, y: F.cross_entropy(model(x), y), optimizer=opt)
    loss = step(x, y)                     # forward, backward, optimizer step: one CUDA graph
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "compile_step", "train_step", "explain", "EmberBackend", "EmberMismatchError", "Options",
           "TrainStep", "__version__"]

# Names imported on first use: a kernel-compile worker (runtime/precompile.py) imports
# ember.runtime.precompile, and with it this package, without paying for Dynamo's import.
_LAZY = {"EmberBackend": "ember.capture.backend", "ember_backend": "ember.capture.backend",
         "Options": "ember.config", "EmberMismatchError": "ember.runtime.program",
         "compile_step": "ember.train.step", "train_step": "ember.train.step", "TrainStep": "ember.train.step"}


def __getattr__(name: str) -> Any:
    if name == "data":  # ember.data.prefetch / doctor without an explicit import
        import importlib
        return importlib.import_module("ember.data")
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


def compile(model: Callable, **options: Any) -> Callable:  # noqa: A001 - mirrors torch.compile
    """Compile ``model`` (an nn.Module or function); returns a callable with the same signature.

    Options (``ember.config.Options`` lists each with its environment variable): ``target``
    ("auto", "triton", "triton-interpret", "cpu", "aten"), ``check`` (compare with eager on the
    first call), ``debug_dir``, ``cache_dir``, ``cache``, ``cudagraphs``, ``device``, ``freeze``,
    ``channels_last``, ``whole_call`` (CUDA inference: the whole call as one CUDA graph, see
    ``ember.runtime.cudagraphs.whole_call``), ``max_recompiles`` (static shape specialisations per frame before one
    dynamic-shape graph; see ``ember.capture.backend``). An argument wins over
    ``ember.config.patch``, which wins over the environment, which wins over the default.

    With ``optimizer=`` (and optionally ``scaler``, ``clip_grad_norm``, ``accumulate``, ``model``),
    ``model`` is a training function ``fn(*batch) -> loss`` and the result a whole-step program:
    ``ember.compile_step(fn, optimizer, ...)`` (see ``ember.train.step``).
    """
    if options.get("optimizer") is not None:
        from ember.train.step import compile_step
        return compile_step(model, **options)
    options.pop("optimizer", None)

    from ember.capture.backend import EmberBackend, optimize
    from ember.config import Options
    from ember.runtime.early_start import start_workers_early

    backend = EmberBackend(Options.from_env(**options))
    start_workers_early(model, backend.options)  # their start-up overlaps the user's code and Dynamo
    compiled = optimize(model, backend)
    # On the compiled object itself: torch's OptimizedModule forwards attribute writes to the user's
    # module, where a backend (locks, CUDA graphs) would stop copy.deepcopy and pickling of it.
    object.__setattr__(compiled, "_ember_backend", backend)
    if backend.options.warm_start and isinstance(compiled, torch_module()):
        from ember.capture.warm_start import install
        from ember.runtime.cpu_background import start as start_cpu_background
        start_cpu_background(model, backend.options)  # numba loads while the warm-start file is read
        install(compiled, model, backend)  # a new process loads what an earlier one compiled
    elif backend.options.warm_start:
        from ember.capture import warm_function
        compiled = warm_function.install(compiled, model, backend)  # a function: capture/warm_function.py
    if backend.options.whole_call and isinstance(compiled, torch_module()) and "forward" in compiled.__dict__:
        from ember.runtime.cudagraphs.whole_call import install as install_whole_call
        install_whole_call(compiled, model, backend)  # runtime/cudagraphs/whole_call.py
    from ember.capture.eager_fallback import install as install_eager_fallback
    return install_eager_fallback(compiled, model, backend)  # what Dynamo cannot trace runs eagerly


def torch_module() -> type:
    import torch
    return torch.nn.Module


def explain(model: Callable, *args: Any, **kwargs: Any) -> Any:
    """Compile and run ``model(*args, **kwargs)`` once and report what ran where (see report.explain)."""
    if getattr(model, "_ember_whole_step", False):
        return model.explain()  # a whole-step program reports what it did so far
    from ember.report.explain import explain as _explain
    return _explain(model, *args, **kwargs)


def _register() -> None:
    # With PYTHONPATH=src (no installed entry point) the name "ember" still resolves.
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend

        from ember.capture.backend import ember_backend
        if "ember" not in _BACKENDS:
            register_backend(name="ember")(ember_backend)
    except Exception:  # noqa: BLE001 - registration is a convenience; ember.compile still works
        import logging
        logging.getLogger("ember").debug("could not register the 'ember' torch.compile backend", exc_info=True)


if os.environ.get("EMBER_COMPILE_WORKER") != "1":
    _register()
