"""Whole-call programs: a compiled module's whole inference call replayed as one CUDA graph.

    model = ember.compile(model, whole_call=True)
    with torch.no_grad():
        y = model(x)          # from the third call of a form on: checks, one copy in, one replay

A batch-1 call is host-bound: on one H100 host, ResNet-50's per-graph replay spent 212 us of
host time per call (Dynamo's frame evaluation and guards, AOTAutograd's wrapper, Ember's runner
checks) for 0.4 ms of kernels. ``WholeCall`` captures the whole call — Dynamo's frame and every
Ember program in it, with their per-graph CUDA graphs passed through — into one graph, and a
later call of the same form does only what keeps the replay right. Before the launch, the call's
form: each argument's shape, strides, dtype, device and requires_grad (Python scalars by value),
the keyword names, and the grad, inference and autocast modes. Then the tensor arguments are
copied into the capture's buffers and the graph is launched. While the device runs it, the host
checks the rest; a replay writes only its own pool (the capture refuses forwards that write
their inputs or the model's tensors), so if a check fails the replay's outputs are dropped and
the normal path answers the call:

- the model's parameters and buffers at the addresses the capture saw. The capture keeps their
  storages, so memory a moved tensor left (``.to()``, ``.data = ...``, a replaced parameter) stays
  allocated and the replay reads stale values, not freed memory, until this check drops it. (A
  storage resized in place, ``untyped_storage().resize_()``, is the one move the kept storage
  does not cover.)
- no parameter, buffer or submodule registered anywhere since the last check (a global
  registration hook counts them; on a count change the model's own are compared by identity);
- the parameters' and buffers' versions: one changed in place (``load_state_dict``, ``copy_``)
  makes what Ember derives from them stale, so the normal path recomputes it and the next calls
  capture again;
- Dynamo's own guards of the frame the capture ran through, run on this call's arguments
  (``capture/dynamo_frames.py``): whatever Dynamo would compile again for runs the normal path.

The outputs are handed out as copies (the next replay overwrites the graph's own) in the
structure the capture returned. Refused, with the reason in ``status`` and ``ember.explain``: calls with
gradients on, graph breaks in forward, forward hooks on the module, outputs that are inputs or
parameters, a forward that writes its inputs or the model's tensors or waits for the device. What a replay cannot
repeat is Python: side effects inside forward (a counter, a cache filled on the first call) run
at capture, not on replays, as with ``torch.cuda.make_graphed_callables``.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo import eval_frame
from torch.utils import _pytree as pytree

from ember.capture.dynamo_frames import FrameLocals, entry_blocker, forward_function, passing_entry
from ember.runtime.cudagraphs.device import CudaBackend, run_noting_syncs
from ember.runtime.cudagraphs.memory import copy_in
from ember.runtime.cudagraphs.runner import inside_whole_call
from ember.runtime.frozen import addresses

WARMUP = 2  # uncaptured calls of a form before its capture (the first one compiles)
MAX_FORMS = 8  # call forms with a graph of their own (one memory pool for all)
MAX_MISSES = 3  # captures that found no frame to stand for: then the normal path for good
MAX_CAPTURES = 32  # then the call's state changes too often for a graph to pay: the normal path
_VERSION = operator.attrgetter("_version")
_SCALARS = (int, float, bool, str, type(None))


class _Registrations:
    """Parameters, buffers and submodules registered in this process since the hooks went in."""

    count = 0
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        module = torch.nn.modules.module
        for register in (module.register_module_parameter_registration_hook,
                         module.register_module_buffer_registration_hook,
                         module.register_module_module_registration_hook):
            register(cls.bump)

    @classmethod
    def bump(cls, *_: object) -> None:
        # Dynamo traces the hook when a compiled forward builds a module (Hugging Face's Llama
        # slices its ModuleList on every call): counting there would be a side effect Dynamo
        # guards on, and every call would compile again. A module a compiled frame builds is
        # the frame's own temporary, not a change to a model a graph reads.
        if torch.compiler.is_compiling():
            return
        cls.count += 1


def _modes() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"))


def _form(args: tuple, kwargs: dict, on_device: Callable[[torch.Tensor], bool]
          ) -> tuple[tuple | None, list[torch.Tensor]]:
    """What a replay of this call depends on besides the model (None: a call Ember does not
    replay), and the call's tensor arguments in the order the capture's buffers hold them."""
    parts: list = [_modes(), tuple(kwargs)]
    given = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            if not on_device(x):
                return None, given
            parts.append((x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
            given.append(x)
        elif isinstance(x, _SCALARS):
            parts.append((type(x), x))
        else:
            return None, given
    return tuple(parts), given


@dataclass
class CallGraph:
    """One call form's capture: the graph, the buffers it reads the tensor arguments from, its
    output leaves and their structure, and the Dynamo cache entry whose guards a replay runs."""

    graph: Any
    inputs: list[torch.Tensor]
    leaves: list
    spec: Any
    entry: Any
    reads: list[torch.Tensor]  # the model's tensors and the input buffers (the tests' stand-in reads them)
    tensors_at: list[int] = field(init=False)  # the leaves that are tensors

    def __post_init__(self) -> None:
        self.tensors_at = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]


class WholeCall:
    """The forward of an ``ember.compile`` result with ``whole_call=True`` (see the module docstring)."""

    def __init__(self, forward: Callable, model: torch.nn.Module, backend: CudaBackend | None = None,
                 warmup: int = WARMUP) -> None:
        self.forward = forward  # the normal path: Dynamo's frame, Ember's programs
        self.model = model
        self.warmup = warmup
        self.backend = backend or CudaBackend()
        self.fn = forward_function(model)
        self.frame_locals = FrameLocals(self.fn) if self.fn is not None else None
        self.disabled: str | None = None if self.fn is not None else \
            "the model's forward is not a function of its class (set on the instance, or a builtin)"
        self.graphs: dict[tuple, CallGraph] = {}
        self.warm: Counter = Counter()  # call form -> uncaptured calls seen
        self.tensors: list[torch.Tensor] = []  # the model's parameters and buffers the graphs read
        self.storages: list[torch.UntypedStorage] = []  # theirs at capture: kept allocated while graphs read them
        self.ptrs: list[int] = []
        self.versions: list[int] = []
        self.registrations = -1
        self.pool: Any = None
        self.side: Any = None
        self.calls = self.replays = self.captures = self.misses = 0
        self.uncaptured: Counter = Counter()  # reason -> calls that ran the normal path for it
        _Registrations.install()

    # -- one call ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.disabled is not None:
            return self._normal(self.disabled, args, kwargs)
        if torch.is_grad_enabled():
            return self._normal("gradients are on: whole calls are replayed under torch.no_grad() or "
                                "torch.inference_mode()", args, kwargs)
        form, given = _form(args, kwargs, self.backend.on_device)
        if form is None:
            return self._normal("an argument is not a CUDA tensor or a Python scalar", args, kwargs)
        graph = self.graphs.get(form)
        if graph is not None:
            self._launch(graph, given)
            # The rest of the check runs while the device replays: a replay writes only its own pool
            # (the capture refused forwards that write inputs or the model's tensors), so when the
            # check fails its outputs are dropped and the normal path answers the call instead.
            why = self._check(graph, args, kwargs)
            if why is None:
                self.replays += 1
                return self._outputs(graph)
            _settle(graph)  # the dropped replay finishes before its graph and pool memory can go
            if self.graphs.get(form) is graph:  # Dynamo's guards failed: this form is captured again
                del self.graphs[form]
                self.warm[form] = self.warmup - 1  # after this call, which compiles or picks its frame
            return self._normal(why, args, kwargs)
        seen = self.warm[form]
        if seen < self.warmup:
            self.warm[form] = seen + 1
            return self._warm_up(args, kwargs, given, checking=seen + 1 == self.warmup)
        if len(self.graphs) >= MAX_FORMS:
            return self._normal(f"{MAX_FORMS} call forms captured already", args, kwargs)
        if self.captures >= MAX_CAPTURES:
            self.disabled = (f"{MAX_CAPTURES} captures: what the call depends on keeps changing (a flag the forward "
                             "reads, the parameters), so each graph would be replayed too rarely to pay")
            return self._normal(self.disabled, args, kwargs)
        return self._capture(form, args, kwargs, given)

    def _normal(self, reason: str, args: tuple, kwargs: dict) -> Any:
        self.uncaptured[reason] += 1
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        """The normal path, as ``OptimizedModule.__call__`` enters it (``WholeCallModule`` skips that)."""
        with _IN_OPTIMIZED_MODULE():
            return self.forward(*args, **kwargs)

    def _check(self, graph: CallGraph, args: tuple, kwargs: dict) -> str | None:
        """None: the replay stands. Otherwise why this call runs the normal path."""
        if addresses(self.tensors) != self.ptrs:
            self._drop()
            return "a parameter or buffer moved (.to(), .data = ...): captured again"
        if _Registrations.count != self.registrations:
            if list(map(id, self._model_tensors())) != list(map(id, self.tensors)):
                self._drop()
                return "a parameter, buffer or submodule of the model was replaced: captured again"
            self.registrations = _Registrations.count
        if list(map(_VERSION, self.tensors)) != self.versions:
            self._drop()
            return "a parameter or buffer changed in place (load_state_dict, copy_): captured again"
        assert self.frame_locals is not None
        try:
            if graph.entry.guard_manager.check(self.frame_locals(self.model, args, kwargs)):
                return None
        except Exception:  # noqa: BLE001 - a call that does not bind, or a guard that cannot run
            pass
        return "Dynamo's guards of the captured frame fail for this call (it compiles or picks another frame)"

    def _launch(self, graph: CallGraph, given: list[torch.Tensor]) -> None:
        copy_in(graph.inputs, given)
        self.backend.replay(graph.graph, graph.reads)

    def _outputs(self, graph: CallGraph) -> Any:
        # The next replay overwrites the graph's outputs: the caller gets copies, made by one
        # multi-tensor copy (one kernel launch for a language model's logits and key/value cache).
        leaves, at = list(graph.leaves), graph.tensors_at
        if len(at) == 1:
            leaves[at[0]] = leaves[at[0]].clone()
        elif at:
            made = [torch.empty_like(leaves[i]) for i in at]
            torch._foreach_copy_(made, [leaves[i] for i in at])
            for i, x in zip(at, made):
                leaves[i] = x
        return pytree.tree_unflatten(leaves, graph.spec)

    # -- before a capture ----------------------------------------------------------------------

    def _model_tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _drop(self) -> None:
        if self.graphs:  # an earlier call's replay may still run on the device
            _settle(next(iter(self.graphs.values())))
        self.graphs.clear()
        self.warm.clear()
        self.storages = []

    def _warm_up(self, args: tuple, kwargs: dict, given: list[torch.Tensor], checking: bool) -> Any:
        """An uncaptured call on a side stream; the last one before a capture looks for waits."""
        self.uncaptured[f"warm-up ({self.warmup} uncaptured call(s) of each call form before its capture)"] += 1
        device = _device(given)
        if device.type != "cuda":  # the tests' CPU stand-in of the device
            with inside_whole_call():
                return self._run(args, kwargs)
        if self.side is None:
            self.side = torch.cuda.Stream(device)
        self.side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.side), inside_whole_call():
            if checking:
                out, syncs = run_noting_syncs(lambda: self._run(args, kwargs))
            else:
                out, syncs = self._run(args, kwargs), []
        torch.cuda.current_stream(device).wait_stream(self.side)
        if syncs and self.disabled is None:
            self.disabled = (f"the call waits for the device ({syncs[0]}), which a CUDA graph cannot hold "
                             "(.item(), .cpu(), a data-dependent shape, or a host-side check)")
        return out

    def _blocker(self, device: torch.device, tensors: list[torch.Tensor]) -> str | None:
        hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        if any(getattr(self.model, h, None) for h in hooks) or torch.nn.modules.module._has_any_global_hook():
            return "the module has forward hooks, which run in Python on every call"
        if any(t.device != device for t in tensors):
            return f"parameters or buffers on another device than the call's {device}"
        return None

    def _capture(self, form: tuple, args: tuple, kwargs: dict, given: list[torch.Tensor]) -> Any:
        device = _device(given)
        tensors = self._model_tensors()
        why = self._blocker(device, tensors)
        if why is not None:
            self.disabled = why
            return self._normal(why, args, kwargs)
        assert self.fn is not None and self.frame_locals is not None
        entry = passing_entry(self.fn, self.frame_locals(self.model, args, kwargs))
        if entry is None:
            self.misses += 1
            self.warm[form] = 0  # the next calls warm up again before another try
            if self.misses >= MAX_MISSES:
                self.disabled = (f"{MAX_MISSES} captures found no compiled frame of forward whose guards pass "
                                 "(forward compiles again on every call form, or a warm start loaded it)")
            return self._normal("Dynamo's guards pass for none of its compiled frames of forward (it would "
                                "compile again; or a warm start loaded the program, which Dynamo's cache does "
                                "not hold: whole_call needs warm_start=False)", args, kwargs)
        why = entry_blocker(entry)
        if why is not None:  # this frame only (a flag may pick another one later): the normal path for it
            return self._normal(why, args, kwargs)
        inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
                  .requires_grad_(x.requires_grad) for x in given]
        buffers = iter(inputs)
        s_args = tuple(next(buffers) if isinstance(x, torch.Tensor) else x for x in args)
        s_kwargs = {k: next(buffers) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if not entry.guard_manager.check(self.frame_locals(self.model, s_args, s_kwargs)):
            return self._normal("Dynamo's guards fail for the capture's copies of the arguments", args, kwargs)
        before = list(map(_VERSION, inputs))
        held = list(map(_VERSION, tensors))
        if self.pool is None:
            # The warm-up's cached blocks (its side stream's) go back first: only the graph's pool stays.
            self.backend.release_cached(device)
            self.pool = self.backend.new_pool(device, shared=True)  # one pool for every call form's graph
        try:
            with inside_whole_call():
                reads = [*tensors, *inputs]
                graph, out = self.backend.capture(lambda _: self._run(s_args, s_kwargs), list(reads), device,
                                                  self.pool)
        except Exception as err:  # noqa: BLE001 - never fail where eager works
            self.backend.recover(device)
            self.disabled = f"capture failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            return self._normal(self.disabled, args, kwargs)
        leaves, spec = pytree.tree_flatten(out)
        why = _output_blocker(leaves, inputs, tensors, device)
        if why is None and list(map(_VERSION, inputs)) != before:
            why = "the forward writes its inputs (a replay would write the capture's copies)"
        if why is None and list(map(_VERSION, tensors)) != held:
            why = "the forward writes the model's parameters or buffers (replays would not count the writes)"
        if why is not None:
            self.disabled = why
            return self._normal(why, args, kwargs)
        self.graphs[form] = CallGraph(graph, inputs, leaves, spec, entry, reads)
        # What the warm-up left cached goes back too: the side stream's blocks and the cuBLAS
        # workspaces the capture handed back (32 MiB each on Hopper), so only the graph's pool stays.
        self.backend.release_cached(device)
        self.tensors, self.storages = tensors, [t.untyped_storage() for t in tensors]
        self.ptrs, self.versions = addresses(tensors), list(map(_VERSION, tensors))
        self.registrations = _Registrations.count
        self.captures += 1
        self._launch(self.graphs[form], given)  # a capture runs nothing: this call replays
        self.replays += 1
        return self._outputs(self.graphs[form])

    def describe(self) -> str:
        if self.disabled is not None:
            return f"not replayed: {self.disabled}"
        text = (f"{self.calls} call(s): {self.replays} replayed one CUDA graph, {self.captures} capture(s), "
                f"{len(self.graphs)} call form(s) captured")
        if self.uncaptured:
            text += "; normal path: " + "; ".join(f"{n} x {why}" for why, n in self.uncaptured.most_common())
        return text


def _device(given: list[torch.Tensor]) -> torch.device:
    """The device a call runs on: its first tensor argument's, else the current CUDA device."""
    return given[0].device if given else torch.device("cuda", torch.cuda.current_device())


def _settle(graph: CallGraph) -> None:
    first = graph.reads[0] if graph.reads else None
    if first is not None and first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()


def _output_blocker(leaves: list, inputs: list[torch.Tensor], tensors: list[torch.Tensor],
                    device: torch.device) -> str | None:
    held = {t.untyped_storage().data_ptr() for t in (*inputs, *tensors) if t.numel()}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return f"an output on {leaf.device}, not on {device}"
            if leaf.numel() and leaf.untyped_storage().data_ptr() in held:
                return "an output is (a view of) an input, a parameter or a buffer"
        elif not isinstance(leaf, _SCALARS):
            return f"an output of type {type(leaf).__name__}, which Ember cannot rebuild after a replay"
    return None


_IN_OPTIMIZED_MODULE = getattr(eval_frame, "_set_in_optimized_module", contextlib.nullcontext)
_HAS_GLOBAL_HOOK = torch.nn.modules.module._has_any_global_hook


class WholeCallModule(eval_frame.OptimizedModule):
    """An ``ember.compile`` result with ``whole_call=True``. Without hooks on it, a call goes
    straight to its ``WholeCall``, skipping ``OptimizedModule.__call__`` and nn.Module's call path
    (12.8-19.0 us per replayed call on the CI CPU, ``benchmarks/results/cpu/2026-11-28_whole_call_host_ab/``).
    The normal path still enters the compiled forward as ``OptimizedModule.__call__`` does
    (``WholeCall._run``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                or _HAS_GLOBAL_HOOK()):
            return super().__call__(*args, **kwargs)
        return self.__dict__["forward"](*args, **kwargs)


def install(compiled: torch.nn.Module, model: torch.nn.Module, backend: Any) -> WholeCall:
    """Put a ``WholeCall`` in front of ``compiled``'s forward (an ``OptimizedModule``)."""
    whole = WholeCall(compiled.__dict__["forward"], model)
    compiled.__dict__["forward"] = whole
    if type(compiled) is eval_frame.OptimizedModule:
        compiled.__class__ = WholeCallModule
    backend.whole_call = whole
    return whole
