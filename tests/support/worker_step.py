"""One call of a compiled model beside eager, shared by the fresh-process test workers
(warm_worker.py, frame_cache_worker.py): a training step (forward, ``square().sum()``, backward)
or an inference call, and how far the compiled model's output and gradients are from eager's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def run_beside_eager(compiled: Any, model: nn.Module, ref: nn.Module, x: torch.Tensor,
                     mode: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, float], float]:
    """(compiled output, eager output, gradient sums per parameter, largest gradient difference);
    ``model`` is what ``compiled`` wraps, ``ref`` an eager copy of it."""
    if mode != "train":
        with torch.no_grad():
            return compiled(x), ref(x), {}, 0.0
    out = compiled(x)
    out.square().sum().backward()
    want = ref(x)
    want.square().sum().backward()
    grads = {n: p.grad.double().sum().item() for n, p in model.named_parameters()}
    grad_err = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out, want, grads, grad_err
