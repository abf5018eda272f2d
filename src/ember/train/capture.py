"""A whole training step as CUDA graphs, after PyTorch's whole-network capture recipe.

    warm-up     ``warmup`` optimizer steps run uncaptured on a side stream (lazy initialisation:
                optimizer state, momentum buffers, cuBLAS workspaces, Ember's kernels); the last
                one under ``torch.cuda.set_sync_debug_mode("warn")``: a step that waits for the
                device (``.item()``, a host-side inf check) cannot be captured.
    memory      before the first capture into a new pool: the warm-up's cached blocks are handed
                back (they sat in the default pool beside the graph's pool: resnet50's reserved
                peak was 12,674 MiB against eager's 7,294 on the H100), and the pool is reserved
                as one segment of what the last warm-up step allocated at its peak, which the
                capture then carves by best fit (runtime/cudagraphs/pool.py explains the
                segment growth this avoids). The warm-up's gradients are dropped before that
                (a first capture sets them to None anyway): held through it, bert's 419 MiB of
                them stayed reserved beside the pool (peak 4,644 against eager's 4,542 MiB on
                the H100; 4,202 without them). Then (``compact_optimizer_state``, on) the
                optimizer state moves to fresh memory through the host (``compact_tensors``): the
                first optimizer step had allocated it beside that step's temporaries (cyclegan's
                peak 378 -> 318 MiB, eager's 368; bert 4,202 -> 4,164). Only up to
                ``MAX_COMPACT_BYTES`` of state: a larger one would cost seconds of copies.
                Captures use Ember's one capture stream per device:
                the allocator hands a freed block only to allocations on the stream it was freed on.
    capture     with every gradient set to None, ``torch.cuda.graph`` records forward, loss,
                backward, clipping, the GradScaler and ``optimizer.step()`` reading the batch from
                static input buffers; the backward then allocates the gradients in the graph's
                pool and every replay writes this step's gradients there (the zero_grad).
                With ``accumulate=N`` there are up to three graphs in one pool: the first
                micro-step (fresh gradients), the middle ones (accumulate in place) and the last
                (accumulate, then update).
    replay      check the call against the last replay's guard (``ReplayGuard``; anything else
                goes through the full check below), copy the batch into the static buffers,
                replay, put the captured gradients back (after the launch for a first
                micro-step, before it when the step accumulates), hand out a copy of the loss.

What capture changes in the user's optimizer, and why (each makes the replay do what eager does):
- SGD, Adam and AdamW with the foreach (or default) implementation: ``fused=True``,
  ``foreach=False`` (setting ``fused_optimizers``): torch's fused kernel reads each parameter,
  gradient and state tensor once and writes the parameter and state once, where the foreach step
  makes several passes (SGD with momentum three, capturable Adam eight or more); the same update up
  to rounding. Not where the user chose ``foreach=False`` or ``differentiable=True``, nor for a
  subclass, nor for an Adam with tensor betas (the fused step reads them on the host).
- Adam/AdamW: ``capturable=True`` (torch refuses to capture the step of any Adam without it; the
  foreach step then keeps ``step`` on the device and computes bias corrections there instead of
  reading them on the host); ``state["step"]`` moves to the parameters' device as
  ``load_state_dict`` does for capturable optimizers.
- Adam/AdamW and fused SGD: ``lr`` becomes a 0-d float32 tensor on the device, so an LR scheduler's
  new rate (PyTorch's schedulers ``fill_`` a tensor lr in place) reaches the replays.
- foreach SGD reads ``lr`` as a Python number (``alpha=-lr``): the graph holds the value it was
  captured with. Every replay first compares each param_group's hyperparameters with those
  captured; a change (a StepLR decay) captures the step again; a change within ``HYPER_INTERVAL``
  steps of the last one (a per-step schedule) makes the step run uncaptured from then on, with
  the reason. Never a replay with a stale value.
- GradScaler: only with optimizers that take ``grad_scale``/``found_inf`` on the device (fused
  SGD/Adam/AdamW): their step skips the update on inf inside the graph, and ``scaler.update()``
  is device-only. Other optimizers' ``scaler.step`` checks for inf with ``.item()``: uncaptured.

Also checked before each replay: the batch's shapes, strides, dtypes and non-tensor values,
grad and autocast mode, the model's train/eval flags, the optimizer's state and param_groups
objects (``load_state_dict`` replaces them: capture again), the parameters' addresses.
Python side effects inside ``train_fn`` run only when a step is captured or uncaptured: the
replay runs kernels, nothing else (as in PyTorch's recipe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ember.config import compact_optimizer_state_enabled, fused_optimizers_enabled
from ember.runtime import library_warmup
from ember.runtime.cudagraphs.device import CudaBackend, capture_stream, run_noting_syncs
from ember.runtime.cudagraphs.memory import copy_in
from ember.runtime.cudagraphs.pool import presize_enabled
from ember.runtime.frozen import addresses
from ember.train.replay_guard import ReplayGuard, hyper_change, hyperparameters, signature

HYPER_INTERVAL = 10  # optimizer steps between hyperparameter changes that still recapture
MAX_CAPTURES = 32  # then the step runs uncaptured: something changes every few steps
MAX_COMPACT_BYTES = 4 << 30  # optimizer state compacted through the host before a first capture, at most


# Optimizers whose foreach step a capture switches to torch's fused kernel (setting
# fused_optimizers), with the foreach passes over parameter-sized tensors it replaces (capturable
# Adam: weight decay, lerp, mul, addcmul, sqrt, two divisions, add, addcdiv). Exact types only:
# a subclass may override step() or rely on the foreach path.
FUSED_KINDS: dict[type, str] = {torch.optim.SGD: "three", torch.optim.Adam: "eight or more",
                                torch.optim.AdamW: "eight or more"}


def _keeps_its_implementation(group: dict) -> bool:
    """A param group the fused switch must leave alone: already fused, an explicit for-loop
    (``foreach=False``), ``differentiable``, a torch without ``fused``, or tensor betas (the fused
    Adam reads them on the host, which a CUDA graph cannot hold)."""
    return ("fused" not in group or bool(group["fused"]) or bool(group.get("differentiable"))
            or group.get("foreach") is False
            or any(isinstance(b, torch.Tensor) for b in group.get("betas", ())))


class CapturedStep(Protocol):
    """What ``CudaWholeStep`` reads and calls of the training step it captures
    (``train/step.TrainStep``), which makes one on its first call with CUDA tensors."""

    optimizer: torch.optim.Optimizer
    scaler: Any
    model: torch.nn.Module | None
    backend: Any
    blocker: str | None
    warmup: int
    optimizer_steps: int

    @property
    def params(self) -> list[torch.Tensor]: ...

    def body(self, batch: tuple, first: bool, last: bool, set_to_none: bool) -> torch.Tensor: ...

    def run_eager(self, batch: tuple, first: bool, last: bool, set_to_none: bool = True) -> torch.Tensor: ...

    def _uncaptured(self, reason: str, warn: bool = True) -> None: ...


class CaptureRefused(Exception):
    """The step cannot be captured; the message says why."""


@dataclass
class PhaseGraph:
    """One captured micro-step kind: its graph, its static loss and the gradients it writes."""

    graph: torch.cuda.CUDAGraph
    loss: torch.Tensor
    grads: list[torch.Tensor | None]


def _phase(first: bool, last: bool) -> str:
    return "full" if first and last else "first" if first else "last" if last else "middle"


class CudaWholeStep:
    """Captures and replays one ``TrainStep``'s micro-steps on ``device``."""

    def __init__(self, step: CapturedStep, device: torch.device) -> None:
        self.step = step
        self.device = device
        self.disabled: str | None = step.blocker
        self.prepared = False
        self.changes: list[str] = []  # what capture changed in the optimizer
        self.graphs: dict[str, PhaseGraph] = {}
        self.pool: Any = None
        self.static_batch: tuple | None = None
        self.signature: list | None = None
        self.modules: list[torch.nn.Module] | None = None  # whose train/eval flags the signature holds
        self.captures = 0
        self.replays = 0
        self.warm_steps = 0
        self.steps_at_capture = 0
        self.last_hyper_change: int | None = None
        self.guard: dict[str, Any] = {}
        self.fast: ReplayGuard | None = None  # the last replay's guard (None: run the full check)
        self.side: Any = None  # the warm-up stream, made on first use
        self.need = 0  # bytes the last warm-up step allocated at its peak (0: not measured)
        self.keeper: Any = None  # the graph that reserved the pool's segment (keeps the pool alive)

    # -- one call ------------------------------------------------------------------------------

    def run(self, batch: tuple, first: bool, last: bool) -> tuple[torch.Tensor, bool]:
        """This micro-step's loss, and whether it replayed a graph."""
        if self.disabled is None and not self.prepared:
            self.prepared = True
            self.disabled = self._prepare()
        if self.disabled is not None:
            return self._eager(batch, first, last, self.disabled), False
        if self.warm_steps < self.step.warmup or (self.captures == 0 and not first):
            return self._warm_up(batch, first, last), False
        phase = _phase(first, last)
        why = self._check(batch, first)
        if why:
            return self._eager(batch, first, last, why), False
        graph = self.graphs.get(phase)
        if graph is None:
            if phase != "full" and not first and "first" not in self.graphs:
                return self._eager(batch, first, last, "waiting for the next optimizer step to capture"), False
            try:
                graph = self._capture(first, last)
            except Exception as err:  # noqa: BLE001 - never fail where eager works
                self._drop()
                self.keeper = self.pool = None  # the reserved segment goes back with the pool
                self.disabled = f"capture failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                return self._eager(batch, first, last, self.disabled), False
            self.graphs[phase] = graph
        return self._replay(graph, batch), True

    def _eager(self, batch: tuple, first: bool, last: bool, reason: str) -> torch.Tensor:
        self.step._uncaptured(reason, warn=not reason.startswith("waiting"))
        if self.graphs:
            self._restore_grads(next(iter(self.graphs.values())), first)
            return self.step.run_eager(batch, first, last, set_to_none=False)
        return self.step.run_eager(batch, first, last)

    def _warm_up(self, batch: tuple, first: bool, last: bool) -> torch.Tensor:
        """An uncaptured micro-step on a side stream; the last warm-up step also looks for host syncs."""
        self.step._uncaptured(f"warm-up ({self.step.warmup} optimizer step(s) run uncaptured before capture)",
                              warn=False)
        checking = self.warm_steps == self.step.warmup - 1
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        start = (torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device))
        with torch.cuda.stream(self.side):
            if checking:
                loss, syncs = run_noting_syncs(lambda: self.step.run_eager(batch, first, last))
            else:
                loss, syncs = self.step.run_eager(batch, first, last), []
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak > start[1]:  # the counter is only read, never reset: a new peak says what the step needs
            self.need = max(self.need, peak - start[0])
        if last:
            self.warm_steps += 1
        if syncs and self.disabled is None:
            self.disabled = (f"the step waits for the device ({syncs[0]}), which a CUDA graph cannot hold "
                             "(.item(), .cpu(), a data-dependent shape, or a host-side check)")
        if self.warm_steps >= self.step.warmup and self.disabled is None:
            self.disabled = self._graph_blocker()
        return loss

    # -- before the first capture --------------------------------------------------------------

    def _prepare(self) -> str | None:
        """Make the user's optimizer capturable (see the module docstring); or say why not."""
        step, opt = self.step, self.step.optimizer
        params = step.params
        if not params:
            return "the optimizer has no parameters"
        devices = {p.device for p in params}
        if devices != {self.device}:
            return f"parameters on {sorted(str(d) for d in devices)}, the batch on {self.device}: one device only"
        if any(p.is_sparse for p in params):
            return "sparse parameters are not captured"
        self._fuse_optimizer(opt, params)
        fused = any(g.get("fused") for g in opt.param_groups)
        if step.scaler is not None:
            if not getattr(opt, "_step_supports_amp_scaling", False):
                return ("GradScaler with a non-fused optimizer: scaler.step checks for inf/NaN with .item() before "
                        "optimizer.step, which a CUDA graph cannot hold (construct the optimizer with fused=True "
                        "to capture the whole step)")
            if getattr(step.scaler, "_device", "cuda") != "cuda":
                return f"GradScaler on {step.scaler._device}"
        adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
        for group in opt.param_groups:
            # Fused Adam too: torch refuses to capture step() of any Adam whose capturable is False.
            if adam and not group.get("capturable"):
                group["capturable"] = True
                self._changed("capturable=True (torch captures an Adam/AdamW step only with it: step counts and "
                              "bias corrections stay on the device)")
            if (adam or group.get("fused")) and not (isinstance(group["lr"], torch.Tensor)
                                                     and group["lr"].device == self.device):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
                self._changed("lr is a 0-d tensor on the device (schedulers fill it in place)")
            if group.get("capturable") or group.get("fused"):
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    if isinstance(state.get("step"), torch.Tensor) and state["step"].device != p.device:
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        if not adam and not fused:
            self._changed("lr read as a number: a change captures again (or runs uncaptured if it changes "
                          "every step; SGD(fused=True) takes a tensor lr)")
        return None

    def _fuse_optimizer(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """A foreach SGD, Adam or AdamW runs as torch's fused kernel (see the module docstring),
        every group or none."""
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        kind = type(opt)
        groups = opt.param_groups
        if (not fused_optimizers_enabled() or kind not in FUSED_KINDS
                or self.device.type not in _get_fused_kernels_supported_devices()
                or not all(torch.is_floating_point(p) for p in params)
                or any(_keeps_its_implementation(g) for g in groups)):
            return
        for group in groups:
            group["fused"], group["foreach"] = True, False
        # What the constructor sets with fused=True: GradScaler hands the step its scale and inf
        # flag on the device; the first step checks every parameter's device and dtype.
        opt._step_supports_amp_scaling = True
        opt._need_device_dtype_check_for_fused = True
        self._changed(f"fused=True ({kind.__name__}'s update in one pass: torch's fused kernel instead of "
                      f"{FUSED_KINDS[kind]} foreach passes)")

    def _changed(self, what: str) -> None:
        if what not in self.changes:
            self.changes.append(what)

    def _graph_blocker(self) -> str | None:
        """After warm-up: why Ember's compiled graphs of train_fn cannot be captured, if they cannot."""
        if any(p.grad is not None and p.grad.is_sparse for p in self.step.params):
            return "sparse gradients are not captured"
        log = getattr(self.step.backend, "log", None)
        for record in log.graphs if log is not None else []:
            if record.dynamic:
                return f"{record.title} has dynamic shapes"
            if record.whole_step_blocker:
                return f"{record.title}: {record.whole_step_blocker}"
        return None

    # -- guards --------------------------------------------------------------------------------

    def _check(self, batch: tuple, first: bool) -> str | None:
        """Why this call must not replay (None: replay, capturing first where needed)."""
        step = self.step
        if self.fast is not None and self.fast.holds(batch, step.optimizer, step.scaler, self.device.type):
            return None
        why = self._full_check(batch, first)
        if why is None and self.graphs:
            self.fast = ReplayGuard.of(batch, step.optimizer, step.scaler, self.modules or (), self.device.type)
        return why

    def _full_check(self, batch: tuple, first: bool) -> str | None:
        step = self.step
        if self.modules is None:
            # The model's modules, listed once: walking model.modules() before every replay cost
            # ~0.5 ms of host time per resnet50 step on the H100's host, ahead of the launch.
            self.modules = list(step.model.modules()) if step.model is not None else []
        sig = signature(batch, self.modules, self.device)
        if self.signature is None:
            for i, x in enumerate(batch):
                if isinstance(x, torch.Tensor) and x.device != self.device:
                    return f"batch argument {i} is on {x.device}, not {self.device} (move batches to the GPU first)"
            self.signature = sig
            self.static_batch = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                                      if isinstance(x, torch.Tensor) else x for x in batch)
        elif sig != self.signature:
            return "the batch (shapes, strides, dtypes, values), grad/autocast mode or train/eval mode differ from the captured step"
        if not self.graphs:
            return None
        why, hyper = self._guard_change()
        if why is None:
            return None
        if not first:
            return f"{why}: captured again at the next optimizer step"
        steps = step.optimizer_steps
        if hyper:
            if self.last_hyper_change is not None and steps - self.last_hyper_change < HYPER_INTERVAL:
                self.disabled = (f"{why} again after {steps - self.last_hyper_change} steps: a value the captured "
                                 "step reads as a Python number changes too often to capture each time")
                self._drop()
                return self.disabled
            self.last_hyper_change = steps
        if self.captures >= MAX_CAPTURES:
            self.disabled = f"{why} after {self.captures} captures"
            self._drop()
            return self.disabled
        self._drop()  # the next _capture records the step anew
        return None

    def _snapshot(self) -> None:
        opt = self.step.optimizer
        self.guard = {"state": opt.state, "groups": opt.param_groups, "group_objs": list(opt.param_groups),
                      "hyper": [hyperparameters(g) for g in opt.param_groups],
                      "ptrs": addresses(self.step.params),
                      "scale": getattr(self.step.scaler, "_scale", None)}

    def _guard_change(self) -> tuple[str | None, bool]:
        opt, g = self.step.optimizer, self.guard
        if opt.state is not g["state"] or opt.param_groups is not g["groups"] or \
                len(opt.param_groups) != len(g["group_objs"]) or \
                any(a is not b for a, b in zip(opt.param_groups, g["group_objs"])):
            return "the optimizer's state or param_groups were replaced (load_state_dict?)", False
        if addresses(self.step.params) != g["ptrs"]:
            return "a parameter moved to other memory", False
        if getattr(self.step.scaler, "_scale", None) is not g["scale"]:
            return "the GradScaler's scale tensor was replaced", False
        for i, (was, group) in enumerate(zip(g["hyper"], opt.param_groups)):
            key = hyper_change(was, hyperparameters(group))
            if key is not None:
                return f"param_group {i}'s {key} changed", True
        return None, False

    # -- capture and replay --------------------------------------------------------------------

    def _drop(self) -> None:
        self.graphs.clear()
        self.fast = None

    def _capture(self, first: bool, last: bool) -> PhaseGraph:
        step = self.step
        params = step.params
        # A first micro-step discards the gradients it finds, so none are kept for a failed capture:
        # held here, the warm-up's gradients (bert: 419 MiB) outlived _reserve's empty_cache and
        # their segments stayed reserved, unused, in the default pool beside the graph's.
        before = [None if first else p.grad for p in params]
        scaler_states = _scaler_states(step.scaler)
        fresh = self.pool is None or first and not self.graphs
        if fresh:
            self.pool = torch.cuda.graph_pool_handle()  # a fresh pool for a new set of graphs
        if first:
            for p in params:
                p.grad = None  # the backward allocates them in the graph's pool: replays overwrite them
        if fresh:
            self._reserve()
        graph = torch.cuda.CUDAGraph()
        assert self.static_batch is not None
        library_warmup.join_all()  # a global-mode capture: no other thread may touch the device
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device)):
                loss = step.body(self.static_batch, first, last, set_to_none=True)
        except BaseException:
            for p, grad in zip(params, before):
                p.grad = grad
            _restore_scaler(step.scaler, scaler_states)
            raise
        grads = [p.grad for p in params]
        if not first and any(a is not b for a, b in zip(grads, before)):
            for p, grad in zip(params, before):
                p.grad = grad
            raise CaptureRefused("the backward did not accumulate gradients in place")
        self.captures += 1
        if first or not self.guard:
            self.steps_at_capture = step.optimizer_steps
            self._snapshot()
        return PhaseGraph(graph, loss, grads)

    def _reserve(self) -> None:
        """Hand back the warm-up's cached memory, then reserve the new pool as one segment of
        what the warm-up step needed (see the module docstring)."""
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            if compact_optimizer_state_enabled():
                state = [v for s in self.step.optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.device == self.device]
                if sum(v.numel() * v.element_size() for v in state) <= MAX_COMPACT_BYTES:
                    compact_tensors(state, torch.cuda.empty_cache)
            torch.cuda.empty_cache()
        if self.need and presize_enabled():
            self.keeper = CudaBackend().reserve(self.pool, self.need, self.device)

    def _restore_grads(self, graph: PhaseGraph, first: bool) -> None:
        """The gradients a replay writes are the captured tensors: put them back where the user
        replaced them (``zero_grad()`` between steps), keeping what they hold mid-accumulation."""
        for p, static in zip(self.step.params, graph.grads):
            if p.grad is static or static is None:
                continue
            if not first:
                if p.grad is None:
                    static.zero_()
                else:
                    static.copy_(p.grad)
            p.grad = static

    def _replay(self, graph: PhaseGraph, batch: tuple) -> torch.Tensor:
        assert self.static_batch is not None
        bufs, given = [], []
        for buf, x in zip(self.static_batch, batch):
            if isinstance(x, torch.Tensor):
                bufs.append(buf)
                given.append(x)
        copy_in(bufs, given, non_blocking=True)
        first = graph is self.graphs.get("full") or graph is self.graphs.get("first")
        if not first:  # the replay adds to what the gradients hold: they must be in place before it
            self._restore_grads(graph, first)
        graph.graph.replay()
        if first:
            # A first micro-step overwrites the captured gradients without reading them, so they are
            # put back after the launch, while the device runs (the host time before the launch is
            # time the device waits in a step synchronised each time).
            self._restore_grads(graph, first)
        self.replays += 1
        return graph.loss.clone()  # the next replay overwrites the static loss

    def describe(self) -> str:
        if self.disabled is not None:
            return f"uncaptured: {self.disabled}"
        if not self.graphs:
            return (f"warming up: {self.warm_steps} of {self.step.warmup} optimizer step(s) run uncaptured "
                    "before the whole step is captured")
        phases = ", ".join(self.graphs)
        text = (f"captured: each micro-step replays one CUDA graph ({len(self.graphs)}: {phases}), "
                f"{self.replays} replays, {self.captures} capture(s)")
        if self.changes:
            text += "; optimizer: " + "; ".join(self.changes)
        return text


def compact_tensors(tensors: Sequence[torch.Tensor], release: Callable[[], None]) -> int:
    """Give ``tensors`` fresh memory, each keeping its tensor object (the user's optimizer state
    stays the user's): values to the host, old memory released (``release``: the allocator's
    ``empty_cache``), then a new buffer each with its size, strides and values. The warm-up's
    first optimizer step allocates its state beside that step's temporaries; those segments
    cannot be released while the state lies in them, and once the activations live in the
    graph's pool nothing reuses their free parts. Tensors that share memory are left as they
    are (moving them apart would break the sharing). Returns the bytes moved."""
    unique = list({id(t): t for t in tensors if t.numel() > 0}.values())
    bases = [t.untyped_storage().data_ptr() for t in unique]
    if len(set(bases)) != len(bases):
        return 0
    held = []
    for t in unique:
        held.append((t, t.detach().to("cpu", copy=True), t.size(), t.stride()))
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    release()
    for t, host, size, stride in held:
        fresh = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
        fresh.copy_(host)
        t.data = fresh
    return sum(host.numel() * host.element_size() for _, host, _, _ in held)


def _scaler_states(scaler: Any) -> dict | None:
    states = getattr(scaler, "_per_optimizer_states", None)
    return {k: dict(v) for k, v in states.items()} if states is not None else None


def _restore_scaler(scaler: Any, states: dict | None) -> None:
    """A failed capture ran the scaler's Python bookkeeping, not its kernels: undo the bookkeeping."""
    if scaler is None or states is None:
        return
    current = scaler._per_optimizer_states
    current.clear()
    for k, v in states.items():
        current[k] = v
