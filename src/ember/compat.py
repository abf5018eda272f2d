"""Every private PyTorch API Ember relies on, in one place.

Ember supports torch 2.11 and newer. The names below are not public and move between releases;
each wrapper says what it stands for, and where an API is missing it degrades the way its
callers expect (documented per function) instead of failing a compile. Nothing else in Ember
touches ``torch._C`` or ``torch._guards``; passes and the runtime import from here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger("ember.compat")


# --- storage and autograd bookkeeping (CUDA-graph runtime, memory plan) --------------------------

def storage_use_count(cdata: int) -> int:
    """How many references the C++ side holds to the storage with handle ``cdata``."""
    return torch._C._storage_Use_Count(cdata)


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


def detect_fake_mode(inputs: Sequence[object]) -> Any:
    from torch._guards import detect_fake_mode as detect
    return detect(inputs)


def recompile_limit_name() -> str:
    """Dynamo's per-frame recompile limit: ``recompile_limit`` (newer) or ``cache_size_limit``."""
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


def functorch_config() -> Any:
    """AOTAutograd's config module (settings patched per compile)."""
    return torch._functorch.config
