"""Ember: compile PyTorch models into library calls plus generated kernels, and say what ran where.

    model = ember.compile(model)          # or torch.compile(model, backend="ember")
    print(ember.explain(model, x))        # what ran where, and why
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ember.capture.backend import EmberBackend, ember_backend
from ember.config import Options
from ember.runtime.program import EmberMismatchError

__version__ = "0.1.0"
__all__ = ["compile", "explain", "EmberBackend", "EmberMismatchError", "Options", "__version__"]


def compile(model: Callable, **options: Any) -> Callable:  # noqa: A001 - mirrors torch.compile
    """Compile ``model`` (an nn.Module or function); returns a callable with the same signature.

    Options (see ``ember.config.Options``): ``target`` ("auto", "triton", "triton-interpret",
    "aten"), ``check`` (compare with eager on the first call), ``debug_dir``, ``cache_dir``,
    ``max_recompiles``.
    """
    backend = EmberBackend(Options.from_env(**options))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled._ember_backend = backend
    _limit_recompiles(backend.options.max_recompiles)
    return compiled


def _limit_recompiles(limit: int) -> None:
    # Dynamo's per-frame limit: past it the frame runs eagerly (correct, uncompiled) and warns.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, limit)


def explain(model: Callable, *args: Any, **kwargs: Any) -> Any:
    """Compile and run ``model(*args, **kwargs)`` once and report what ran where (see report.explain)."""
    from ember.report.explain import explain as _explain
    return _explain(model, *args, **kwargs)


def _register() -> None:
    # With PYTHONPATH=src (no installed entry point) the name "ember" still resolves.
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
        if "ember" not in _BACKENDS:
            register_backend(name="ember")(ember_backend)
    except Exception:  # noqa: BLE001 - registration is a convenience
        pass


_register()
