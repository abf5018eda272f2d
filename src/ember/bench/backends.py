"""The backends ``ember bench`` compares: eager, Inductor in its modes, and Ember.

A backend is a factory ``model -> callable with the model's signature`` (the model is already
on its device, in train or eval mode). It may also bring its own training step, which is the
hook for backends that compile more than the model (the optimizer step, or the whole step):

    train_step(model, optimizer, loss_fn, autocast) -> step

``step(inputs, target)`` runs one whole training step: forward and loss under ``autocast()``
(a context manager factory: bf16 autocast or a no-op, as the run's precision says),
backward, ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``, and returns the
loss (detached). The harness times exactly that call. Backends without the hook get
``default_train_step`` around their compiled model. Inference always uses the model factory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "TrainStepFactory",
    "default_backends",
    "default_train_step",
    "peer_mode",
    "register_backend",
    "train_step_factory",
]

BackendFactory = Callable[[nn.Module], Callable[..., Any]]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
Autocast = Callable[[], contextlib.AbstractContextManager[Any]]
TrainStep = Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]
TrainStepFactory = Callable[[nn.Module, torch.optim.Optimizer, LossFn, Autocast], TrainStep]


class BackendUnavailable(RuntimeError):
    """The backend cannot be used in this environment (e.g. ember.compile missing)."""


@dataclass(frozen=True)
class Backend:
    """A named backend: ``compile`` makes the model callable; ``mode`` says how (stored in every
    result row as ``peer_mode``); ``train_step`` optionally replaces the whole training step;
    ``opt_in`` backends are never in the default list (they compile for minutes, or are variants)."""

    compile: BackendFactory
    mode: str
    train_step: TrainStepFactory | None = None
    opt_in: bool = False
    train_only: bool = False  # no inference rows (they would repeat another backend's)
    infer_only: bool = False  # no training rows (they would repeat another backend's)

    def __call__(self, model: nn.Module) -> Callable[..., Any]:
        return self.compile(model)


def default_train_step(fn: Callable[..., Any], optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                       autocast: Autocast) -> TrainStep:
    """Forward through ``fn``, loss, backward, eager optimizer step, zero_grad."""

    def step(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        with autocast():
            loss = loss_fn(fn(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ---------------------------------------------------------------------------------------
# The peers
# ---------------------------------------------------------------------------------------


def _eager(model: nn.Module) -> Callable[..., Any]:
    return model


def _inductor(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model)


def _marking_steps(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Tell Inductor's CUDA-graph trees where each step begins, as PyTorch's docs ask of loops
    that call a reduce-overhead model once per step: outputs of the step before may then be
    overwritten instead of forcing a new recording."""

    def call(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return call


def _inductor_cudagraphs(model: nn.Module) -> Callable[..., Any]:
    return _marking_steps(torch.compile(model, mode="reduce-overhead"))


def _inductor_cudagraphs_rnn(model: nn.Module) -> Callable[..., Any]:
    """Inductor with CUDA graphs and Dynamo's ``allow_rnn`` on during the calls: nn.LSTM / GRU / RNN
    traced into the graph (Inductor then decomposes them per step), as Ember does by default."""
    compiled = torch.compile(model, mode="reduce-overhead")

    def call(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(allow_rnn=True):
            return compiled(*args, **kwargs)

    return call


def _inductor_max_autotune(model: nn.Module) -> Callable[..., Any]:
    return _marking_steps(torch.compile(model, mode="max-autotune"))


def _compiled_optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                             autocast: Autocast) -> TrainStep:
    """Inductor with CUDA graphs for the model plus the optimizer step compiled as PyTorch's
    compiled-optimizer recipe does (``@torch.compile(fullgraph=False)`` around ``opt.step()``)."""
    fn = _inductor_cudagraphs(model)

    @torch.compile(fullgraph=False)
    def opt_step() -> None:
        optimizer.step()

    def step(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        with autocast():
            loss = loss_fn(fn(*inputs), target)
        loss.backward()
        opt_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _ember(model: nn.Module, **options: Any) -> Callable[..., Any]:
    # Imported here: the compiler core may not be importable (or written) yet, and that
    # must only fail this backend's rows.
    try:
        import ember

        compile_fn = ember.compile
    except (ImportError, AttributeError) as err:
        raise BackendUnavailable(f"ember.compile is not available: {err}") from err
    return compile_fn(model, **options)


def _ember_whole_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                      autocast: Autocast) -> TrainStep:
    """Ember's whole-step program: forward and loss compiled by Ember, backward, the optimizer's
    update and zero_grad replayed as one CUDA graph where safe (``ember.compile_step``)."""
    try:
        import ember
    except ImportError as err:
        raise BackendUnavailable(f"ember is not available: {err}") from err

    def train_fn(*batch: torch.Tensor) -> torch.Tensor:
        with autocast():
            return loss_fn(model(*batch[:-1]), batch[-1])

    whole = ember.compile_step(train_fn, optimizer, model=model)

    def step(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        return whole(*inputs, target)

    step.explain = whole.explain  # type: ignore[attr-defined]
    step.whole_step = whole  # type: ignore[attr-defined]
    return step


BACKENDS: dict[str, BackendFactory] = {
    "eager": Backend(_eager, "eager"),
    "inductor": Backend(_inductor, "torch.compile default"),
    "inductor-cudagraphs": Backend(_inductor_cudagraphs, "torch.compile mode=reduce-overhead"),
    "inductor-cudagraphs-rnn": Backend(_inductor_cudagraphs_rnn,
                                       "torch.compile mode=reduce-overhead, Dynamo's allow_rnn on (RNNs traced)",
                                       opt_in=True),
    "inductor-max-autotune": Backend(_inductor_max_autotune, "torch.compile mode=max-autotune", opt_in=True),
    "inductor-cudagraphs-compiled-optimizer": Backend(
        _inductor_cudagraphs, "torch.compile mode=reduce-overhead + optimizer step compiled (fullgraph=False)",
        train_step=_compiled_optimizer_step, opt_in=True),
    "ember": Backend(_ember, "ember.compile defaults"),
    "ember-whole-step": Backend(_ember, "ember.compile_step: forward, backward and optimizer as one program",
                                train_step=_ember_whole_step, train_only=True),
    "ember-whole-call": Backend(functools.partial(_ember, whole_call=True), "ember.compile(whole_call=True): the inference call as one CUDA "
                                "graph behind Dynamo's guards", infer_only=True),
}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Add (or replace) a backend: a plain factory or a ``Backend``; tests use this to plug in fakes."""
    BACKENDS[name] = factory


def peer_mode(name: str) -> str:
    """How backend ``name`` compiles, for the result rows."""
    return getattr(BACKENDS[name], "mode", name)


def train_only(name: str) -> bool:
    """Whether backend ``name`` has no inference rows."""
    return bool(getattr(BACKENDS[name], "train_only", False))


def infer_only(name: str) -> bool:
    """Whether backend ``name`` has no training rows."""
    return bool(getattr(BACKENDS[name], "infer_only", False))


def train_step_factory(name: str) -> TrainStepFactory | None:
    """The backend's own training step, or None for the default step around its model."""
    return getattr(BACKENDS[name], "train_step", None)


def default_backends(device: torch.device) -> list[str]:
    """eager, inductor and ember; on a GPU also Inductor with CUDA graphs (Ember replays CUDA
    graphs too, so that is the peer to beat). Opt-in backends only on request."""
    names = ["eager", "inductor", "inductor-cudagraphs", "ember", "ember-whole-step", "ember-whole-call"] \
        if device.type == "cuda" else [
        "eager", "inductor", "ember"]
    return [n for n in names if n in BACKENDS]
