"""Whole-step training programs: forward, loss, backward, gradient clipping, optimizer step and
zero_grad as one compiled program, replayed as one CUDA graph where that is safe.

    step = ember.compile_step(lambda x, y: F.cross_entropy(model(x), y), optimizer=opt)
    for x, y in loader:
        loss = step(x, y)          # one optimizer step (or one micro-step with accumulate=N)
        scheduler.step()           # schedulers, state_dict(), checkpoints work as in eager

The user writes forward and loss (``train_fn(*batch) -> loss``); the step does the rest, exactly
as the canonical eager loop does it:

    optimizer.zero_grad()                        # first micro-step of an optimizer step
    loss = train_fn(*batch)                      # compiled by Ember (forward and backward)
    scaled = loss / accumulate                   # accumulate > 1
    (scaler.scale(scaled) if scaler else scaled).backward()
    if last micro-step:
        if clip_grad_norm: scaler.unscale_(optimizer) (with a scaler); clip_grad_norm_(params, clip)
        scaler.step(optimizer); scaler.update()  # or optimizer.step()

The optimizer is the user's own object and runs PyTorch's implementation of it, so parameters,
gradients and optimizer state stay in the user's tensors. ``train_fn`` is compiled by Ember with
its per-graph CUDA graphs off; on CUDA, ``capture.CudaWholeStep`` captures the whole step as
one graph (``train/capture.py`` says what it changes in the optimizer and why). Whatever cannot
be captured runs as these eager-style steps, with the reason warned once and kept in
``step.status`` / ``step.explain()`` / ``ember.explain(step)``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

# Optimizers whose step Ember captures: PyTorch's own implementations, no host reads in step().
CAPTURED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# Optimizers that need a closure (they evaluate the loss several times per step).
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def optimizer_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's step cannot be part of a captured whole step (None: it can)."""
    kind = type(optimizer)
    if isinstance(optimizer, CLOSURE_OPTIMIZERS):
        return (f"{kind.__name__} needs a closure (it evaluates the loss several times per step): each step "
                "runs optimizer.step(closure) uncaptured")
    if kind not in CAPTURED_OPTIMIZERS:
        return (f"optimizer {kind.__module__}.{kind.__name__} is not one Ember captures "
                f"({', '.join(k.__name__ for k in CAPTURED_OPTIMIZERS)}): its step runs uncaptured")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "differentiable=True optimizers are not captured"
    return None


def whole_step_options(options: dict[str, Any], optimizer: torch.optim.Optimizer, cudagraph: bool) -> dict[str, Any]:
    """``ember.compile``'s options for ``train_fn``. The warm start, where the user left it unset, is
    on for a step that will replay as one CUDA graph: a replay runs behind Ember's own guard
    (train/replay_guard.py) and never calls the loaded function, so torch's check of its saved guards
    (slower than Dynamo's own on torch 2.11, which keeps the warm start off for other GPU compiles)
    runs only on the uncaptured calls before the capture. Elsewhere the usual default applies."""
    from ember import config
    if "warm_start" in options or not config.left_unset("warm_start"):
        return options
    if cudagraph and optimizer_blocker(optimizer) is None:
        return {**options, "warm_start": True}
    return options


@dataclasses.dataclass
class WholeStepReport:
    """What a whole-step program did so far. ``print()`` it."""

    mode: str  # one line: how steps run now
    optimizer: str
    calls: int
    optimizer_steps: int
    captured_calls: int  # calls that replayed a CUDA graph
    uncaptured_calls: Counter  # reason -> calls that ran eager-style for it
    captures: int
    graphs: list[str]  # compiled Ember graphs of train_fn (titles)
    reasons: list[str]  # every reason a call ran uncaptured, in the order first seen
    warm_start: list[str] = dataclasses.field(default_factory=list)  # what warm_start=True did (loaded, saved, off)

    def __str__(self) -> str:
        lines = [f"whole-step program: {self.mode}",
                 f"  optimizer: {self.optimizer}",
                 f"  calls: {self.calls} ({self.optimizer_steps} optimizer steps), {self.captured_calls} replayed "
                 f"a CUDA graph, {self.captures} capture(s)",
                 f"  train_fn compiled by Ember into {len(self.graphs)} graph(s)"
                 + (f": {', '.join(self.graphs)}" if self.graphs else "")]
        lines += [f"  warm start: {line}" for line in self.warm_start]
        if self.uncaptured_calls:
            lines.append("  uncaptured calls:")
            lines += [f"    {n} x {why}" for why, n in self.uncaptured_calls.most_common()]
        return "\n".join(lines)


class TrainStep:
    """One training step of ``train_fn`` with ``optimizer``; call it with a batch, get the loss.

    See the module docstring. Build it with ``ember.compile_step`` or ``@ember.train_step``.
    """

    _ember_whole_step = True

    def __init__(self, train_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, *,
                 model: torch.nn.Module | None = None, scaler: Any = None, clip_grad_norm: float | None = None,
                 accumulate: int = 1, cudagraph: bool = True, compile: bool = True,  # noqa: A002
                 warmup: int | None = None, **options: Any) -> None:
        from ember import config
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ember.compile_step: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if int(accumulate) != accumulate or accumulate < 1:
            raise ValueError(f"ember.compile_step: accumulate must be a positive integer, got {accumulate!r}")
        self.train_fn = train_fn
        self.optimizer = optimizer
        self.model = model
        self.scaler = scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() else None
        self.clip_grad_norm = clip_grad_norm
        self.accumulate = int(accumulate)
        self.closure_mode = isinstance(optimizer, CLOSURE_OPTIMIZERS)
        if self.closure_mode and self.accumulate > 1:
            raise ValueError(f"ember.compile_step: {type(optimizer).__name__} evaluates the loss itself; "
                             "accumulate > 1 is not possible with it")
        if self.closure_mode and self.scaler is not None:
            raise ValueError("ember.compile_step: GradScaler does not support closure optimizers (PyTorch's "
                             f"GradScaler.step raises for them), and {type(optimizer).__name__} needs one")
        self.backend = None
        self.cudagraph = cudagraph and config.whole_step_cudagraph_enabled()
        if compile:
            import ember
            # Ember's per-graph CUDA graphs are off: on CUDA the whole step is one graph, and a
            # graph inside another's capture would replay nothing.
            options = whole_step_options(options, optimizer, self.cudagraph)
            self.compiled_fn = ember.compile(train_fn, **{**options, "cudagraphs": False})
            self.backend = self.compiled_fn._ember_backend
            warm = getattr(self.compiled_fn, "_ember_warm_start", None)  # warm_start=True: capture/warm_function.py
            if warm is not None and model is not None:
                warm.add_modules({"model": model})  # its parameters' signatures are part of the file's key
        else:
            self.compiled_fn = train_fn
        self.warmup = warmup if warmup is not None else config.whole_step_warmup()
        self.micro = 0  # index of the next call within its optimizer step (accumulate > 1)
        self.calls = 0
        self.optimizer_steps = 0
        self.captured_calls = 0
        self.uncaptured: Counter = Counter()
        self._reasons: list[str] = []
        self._warned: set[str] = set()
        self.cuda = None  # capture.CudaWholeStep, made on the first call with CUDA tensors
        self.blocker = optimizer_blocker(optimizer)
        if self.blocker and self.closure_mode:
            self._note(self.blocker, warn=True)

    # -- the public surface --------------------------------------------------------------------

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def __call__(self, *batch: Any) -> torch.Tensor:
        first = self.micro == 0
        last = self.micro == self.accumulate - 1
        self.calls += 1
        loss = None
        device = self._device(batch)
        if device.type == "cuda" and self.cudagraph and not self.closure_mode:
            if self.cuda is None:
                from ember.train.capture import CudaWholeStep
                self.cuda = CudaWholeStep(self, device)
            loss, replayed = self.cuda.run(batch, first, last)  # uncaptured calls note their reason
            self.captured_calls += int(replayed)
        elif device.type == "cuda" and not self.closure_mode:
            self._uncaptured("whole-step CUDA graphs are off (cudagraph=False or EMBER_WHOLE_STEP_CUDAGRAPH=0)")
        elif device.type != "cuda":
            self._uncaptured(f"{device.type} tensors: compiled by Ember, run without a CUDA graph", warn=False)
        if loss is None:
            loss = self.run_eager(batch, first, last)
        self.micro = 0 if last else self.micro + 1
        if last:
            self.optimizer_steps += 1
        return loss

    @property
    def status(self) -> str:
        """One line: how this step runs now, and why."""
        if self.cuda is not None:
            return self.cuda.describe()
        if self.closure_mode:
            return f"uncaptured: {self.blocker}"
        if self._reasons:
            return f"uncaptured: {self._reasons[-1]}"
        return "not called yet"

    def explain(self) -> WholeStepReport:
        """What this step did so far, and why any call ran outside a CUDA graph."""
        log = getattr(self.backend, "log", None)
        return WholeStepReport(
            mode=self.status, optimizer=_describe_optimizer(self.optimizer), calls=self.calls,
            optimizer_steps=self.optimizer_steps, captured_calls=self.captured_calls,
            uncaptured_calls=Counter(self.uncaptured), captures=self.cuda.captures if self.cuda is not None else 0,
            graphs=[g.title for g in log.graphs] if log is not None else [], reasons=list(self._reasons),
            warm_start=list(log.warm_start) if log is not None else [])

    # -- one micro-step, as eager PyTorch runs it (also the body a CUDA graph captures) ----------

    def run_eager(self, batch: tuple, first: bool, last: bool, set_to_none: bool = True) -> torch.Tensor:
        """One micro-step run op by op (the compiled train_fn plus PyTorch's optimizer)."""
        if self.closure_mode:
            return self._closure_step(batch)
        return self.body(batch, first, last, set_to_none)

    def body(self, batch: tuple, first: bool, last: bool, set_to_none: bool) -> torch.Tensor:
        opt = self.optimizer
        if first:
            # set_to_none=False once a CUDA graph holds the gradients: they must stay its tensors.
            opt.zero_grad(set_to_none=set_to_none)
        loss = _as_loss(self.compiled_fn(*batch))
        scaled = loss / self.accumulate if self.accumulate > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if last:
            if self.clip_grad_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
            if self.scaler is not None:
                self.scaler.step(opt)
                self.scaler.update()
            else:
                opt.step()
        return loss.detach()

    def _closure_step(self, batch: tuple) -> torch.Tensor:
        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            loss = _as_loss(self.compiled_fn(*batch))
            loss.backward()
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
            return loss
        self.uncaptured[self.blocker] += 1
        loss = self.optimizer.step(closure)
        return loss.detach() if isinstance(loss, torch.Tensor) else loss

    # -- bookkeeping ---------------------------------------------------------------------------

    def _device(self, batch: tuple) -> torch.device:
        for x in batch:
            if isinstance(x, torch.Tensor):
                return x.device
        for p in self.params:
            return p.device
        return torch.device("cpu")

    def _note(self, reason: str, warn: bool = True) -> None:
        if reason not in self._reasons:
            self._reasons.append(reason)
        if warn and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"ember.compile_step: {reason}", stacklevel=4)

    def _uncaptured(self, reason: str, warn: bool = True) -> None:
        """This call runs eager-style: count it under ``reason`` (warned once)."""
        self.uncaptured[reason] += 1
        self._note(reason, warn)


def _as_loss(out: object) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TypeError("ember.compile_step: train_fn must return the loss, a one-element tensor; got "
                        f"{type(out).__name__}{list(out.shape) if isinstance(out, torch.Tensor) else ''}")
    return out


def _describe_optimizer(opt: torch.optim.Optimizer) -> str:
    group = opt.param_groups[0] if opt.param_groups else {}
    flags = [f"{k}={group[k]}" for k in ("foreach", "fused", "capturable") if k in group]
    return f"{type(opt).__name__} ({', '.join(flags)})" if flags else type(opt).__name__


def compile_step(train_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, **kwargs: Any) -> TrainStep:
    """A whole training step: ``step(*batch)`` runs ``train_fn(*batch)`` (forward and loss, compiled
    by Ember), backward, optional ``clip_grad_norm``, the ``scaler`` (a GradScaler), ``optimizer.step()``
    and ``zero_grad``; on CUDA replayed as one CUDA graph where safe. ``accumulate=N``: each call is
    a micro-batch and every N-th call steps the optimizer. Other keywords are ``ember.compile``
    options (``target``, ``warm_start`` ...), plus ``model`` (its train/eval mode is part of what a replay
    checks; with ``warm_start=True`` its parameters' signatures are part of the saved file's key),
    ``cudagraph`` (False: never capture) and ``warmup`` (uncaptured optimizer steps before capture)."""
    return TrainStep(train_fn, optimizer, **kwargs)


def train_step(optimizer: torch.optim.Optimizer, **kwargs: Any) -> Callable[[Callable[..., torch.Tensor]], TrainStep]:
    """Decorator form of ``compile_step``::

        @ember.train_step(opt, clip_grad_norm=1.0)
        def step(x, y):
            return F.cross_entropy(model(x), y)
    """
    def wrap(train_fn: Callable[..., torch.Tensor]) -> TrainStep:
        return TrainStep(train_fn, optimizer, **kwargs)
    return wrap
