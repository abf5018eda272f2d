"""Helpers shared by Ember's window ops (max pooling, reflection padding): where their Triton
kernels live, and outputs allocated in their input's memory format."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch._prims_common import suggest_memory_format

from ember.runtime.kernels import load_module

WINDOW_KERNELS = Path(__file__).with_name("window_kernels.py")
# What the window kernels take: they hold values in float32, so float64 would come back rounded
# and stays ATen's.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def window_kernels(interpret: bool) -> ModuleType:
    """ops/window_kernels.py, interpreted (CPU tensors) or compiled."""
    return load_module(WINDOW_KERNELS, interpret)


def empty_like_layout(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``shape`` in ``like``'s memory format (NCHW or NHWC)."""
    return torch.empty(shape, dtype=dtype, device=like.device, memory_format=suggest_memory_format(like))


def channels_last(t: torch.Tensor) -> bool:
    return suggest_memory_format(t) == torch.channels_last
