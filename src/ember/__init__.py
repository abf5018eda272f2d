"""Ember: compile PyTorch models into library calls plus generated kernels, and say what ran where.

    model = ember.compile(model)          # or torch.compile(model, backend="ember")
    print(ember.explain(model, x))        # what ran where, and why
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "explain", "EmberBackend", "EmberMismatchError", "Options", "__version__"]

# Names imported on first use: a kernel-compile worker (runtime/precompile.py) imports
# ember.runtime.precompile, and with it this package, without paying for Dynamo's import.
_LAZY = {"EmberBackend": "ember.capture.backend", "ember_backend": "ember.capture.backend",
         "Options": "ember.config", "EmberMismatchError": "ember.runtime.program"}


def __getattr__(name: str) -> Any:
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
    ``channels_last``, ``max_recompiles`` (static shape specialisations per frame before one
    dynamic-shape graph; see ``ember.capture.backend``). An argument wins over
    ``ember.config.patch``, which wins over the environment, which wins over the default.
    """
    import torch

    from ember.capture.backend import EmberBackend
    from ember.config import Options

    backend = EmberBackend(Options.from_env(**options))
    # What torch.compile calls, minus its backend wrapper, which would drop the backend's
    # backend_ctx_ctor: the per-call shape policy and recompile limit of this model.
    compiled = torch._dynamo.optimize(backend, dynamic=None)(model)
    compiled._ember_backend = backend
    return compiled


def explain(model: Callable, *args: Any, **kwargs: Any) -> Any:
    """Compile and run ``model(*args, **kwargs)`` once and report what ran where (see report.explain)."""
    from ember.report.explain import explain as _explain
    return _explain(model, *args, **kwargs)


def _register() -> None:
    # With PYTHONPATH=src (no installed entry point) the name "ember" still resolves.
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend

        from ember.capture.backend import ember_backend
        if "ember" not in _BACKENDS:
            register_backend(name="ember")(ember_backend)
    except Exception:  # noqa: BLE001 - registration is a convenience
        pass


if os.environ.get("EMBER_COMPILE_WORKER") != "1":
    _register()
