"""Helpers for the end-to-end tests: run a function eagerly and compiled, compare forward and gradients.

Not a test module; test files import it by name (pyproject.toml puts tests/support on the path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ember.report.records import CompileLog

RTOL, ATOL = 1e-4, 1e-5  # fp32


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    if want.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def forward_backward(fn: Callable, inputs: Sequence[torch.Tensor], cotangent_seed: int = 0,
                     params: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn(*inputs)`` on fresh leaf copies, then backward of a fixed random cotangent.

    Returns the output and the gradients of every input and every tensor in ``params``.
    """
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    for p in params:
        p.grad = None
    out = fn(*leaves)
    gen = torch.Generator().manual_seed(cotangent_seed)
    cot = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    out.backward(cot)
    grads = [x.grad for x in leaves if x.requires_grad] + [p.grad for p in params]
    assert all(g is not None for g in grads), "a gradient is missing"
    return out.detach(), [g.detach().clone() for g in grads]


def check_against_eager(compiled: Callable, eager: Callable, inputs: Sequence[torch.Tensor],
                        params: Sequence[torch.Tensor] = ()) -> None:
    """Forward output and every gradient of ``compiled`` match ``eager`` on the same inputs."""
    want, want_grads = forward_backward(eager, inputs, params=params)
    got, got_grads = forward_backward(compiled, inputs, params=params)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, "forward")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, f"gradient {i}")


def log_of(compiled: Callable) -> CompileLog:
    return compiled._ember_backend.log


def assert_compiled_cleanly(log: CompileLog) -> None:
    """Every graph went through Ember's pipeline (no silent fall back to the captured graph)."""
    assert log.graphs, "Ember compiled no graph"
    for g in log.graphs:
        assert g.error is None, f"{g.title}: {g.error}"
        assert g.program, f"{g.title}: no program"


def bn_dropout_net() -> torch.nn.Module:
    """A small training net with batch norm (buffers updated in place) and dropout (random)."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5),
                         nn.Linear(4 * 6 * 6, 2)).train()
