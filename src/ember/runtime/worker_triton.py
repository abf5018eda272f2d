"""Triton set up in a compile worker without torch and without the GPU.

A worker compiles kernels to binaries and never launches one, so all it needs from the GPU is
the target (``cuda``, compute capability, warp size). Triton's own CUDA driver gets that from
torch (``GPUDriver.__init__`` imports torch and ``torch.cuda.get_device_capability`` initialises
CUDA), seconds per worker, paid by every worker at once while the parent captures the graph.
Here the parent passes its target in the environment (``TARGET_ENV``) and the worker installs a
driver that answers only what ``JITFunction.warmup`` asks (the target, device 0, stream 0).

Argument dtypes reach ``warmup`` as stand-ins printing as torch's dtypes (``torch.float32``),
which is what Triton's specialisation reads from a tensor's dtype: the binary, and Triton's key
for it, are the ones a launch with real tensors looks up. The warm-up kernel checks the types on
the worker's first compile; a Triton that reads dtypes differently sends the worker back to its
own driver (with torch).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator
from typing import Any

TARGET_ENV = "EMBER_WORKER_TRITON_TARGET"


def target_text(target: Any) -> str:
    """``cuda:90:32`` for Triton's ``GPUTarget`` (backend, arch, warp size); "" where the backend
    is not CUDA (the workers then use Triton's own driver)."""
    if getattr(target, "backend", None) != "cuda" or not isinstance(getattr(target, "arch", None), int):
        return ""
    return f"cuda:{target.arch}:{int(target.warp_size)}"


class TargetOnlyDriver:
    """Triton's active driver in a worker: the target it compiles for, nothing to launch with."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:  # launching, benchmarking: not in a worker
        raise AttributeError(f"a compile worker's Triton driver has no {name!r} (it only compiles)")


def install_target_driver(text: str) -> bool:
    """Make Triton compile for ``text`` (``target_text``'s form) without its CUDA driver; False
    (nothing changed) for an empty or unreadable text."""
    try:
        backend, arch, warp_size = text.split(":")
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        target = GPUTarget(backend, int(arch), int(warp_size))
        driver.set_active(TargetOnlyDriver(target))
    except (ValueError, ImportError, AttributeError):
        return False
    return True


def uninstall_target_driver() -> None:
    """Back to Triton's own driver (it imports torch when first used)."""
    from triton.runtime import driver

    driver.reset_active()


class _RefuseTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            raise ModuleNotFoundError("torch is not imported by a compile worker", name="torch")


@contextlib.contextmanager
def torch_import_refused() -> Iterator[None]:
    """``import torch`` raises ModuleNotFoundError inside (where torch is not imported yet).
    Triton 3.6's native argument specialisation imports torch once, at its first use, only to
    recognise torch tensors, and carries on without it (measured on the H100 host: a worker's
    start then took 4.1-4.6 s instead of about 1 s). A worker's first compile runs inside this."""
    if "torch" in sys.modules:
        yield
        return
    finder = _RefuseTorch()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class DtypeName:
    """A stand-in for a torch dtype: prints as ``torch.<name>``. One object per name, kept for the
    process's life (Triton's specialisation may remember a dtype object by its identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


_DTYPES: dict[str, DtypeName] = {}


def pointer_arg(dtype_name: str) -> Any:
    """What ``JITFunction.warmup`` takes for a tensor argument of ``dtype_name`` (16-byte aligned)."""
    from triton.runtime.jit import MockTensor

    dtype = _DTYPES.setdefault(dtype_name, DtypeName(dtype_name))
    return MockTensor(dtype)


def typed_arguments(compiled: Any) -> dict[str, str]:
    """Argument name -> the type Triton gave it, of a ``CompiledKernel`` (constexprs included)."""
    names = list(compiled.src.fn.arg_names)
    typed = {}
    for k, v in dict(getattr(compiled.src, "signature", {})).items():
        position = k if isinstance(k, int) else k[0] if isinstance(k, tuple) else names.index(k)
        typed[names[position]] = v
    return typed
