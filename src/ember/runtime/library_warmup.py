"""cuDNN's and cuBLAS's first-call set-up, paid where the process waits anyway.

A library's first calls in a process load its kernels and sub-libraries and build a plan per
shape. Measured on the H100 (torch 2.11, bf16, eager, a new process): ResNet-50's first training
step took 0.51 s against 0.06 s for the next, BERT's 0.33 s against 0.026 s. That set-up serves
every host thread: the same step run first in a helper thread, while the main thread ran Python,
brought the main thread's first step to 0.088 s (ResNet-50) and 0.064 s (BERT)
(benchmarks/scripts/library_first_call_probe.py).

So a program keeps a list of its library calls (its ``extern`` steps, schedule/rules.EXTERN_OPS,
on a CUDA device: the op, its tensor arguments' shapes, strides and dtypes, its other arguments)
and Ember replays them once on scratch tensors where the wait is free:

- a warm start (capture/warm_start.py): in a helper thread while the main thread loads the saved
  frame, joined before the program first runs;
- a compile (or a program-cache hit): in the same helper thread from the moment the graph's plan
  is known, while the main thread goes on compiling (the backward graph, Dynamo's wrap-up, the
  Triton kernels' wait); joined at the first run of any compiled graph and before any CUDA-graph
  capture.

Scratch tensors are zeros (no NaN, every index in range); a dropout probability becomes 0, so no
replayed call draws from the random generator; a call that fails is skipped and counted. Nothing
replayed is seen by the program: only the libraries' state (loaded code, handles, plans) stays.
torch keeps cuDNN's convolution plans and attention graphs per host thread, and autograd runs a
CUDA backward on a thread of its own per device, so gradient calls (``*_backward`` ops) are
replayed inside a backward pass (``run_in_backward``), where that thread makes them. Forward
depthwise convolutions, whose per-shape set-up is a kernel build that stays with the thread that
made it, are replayed once per op (``DEPTHWISE_PER_OP``): the model's forward runs on the thread
that is busy compiling or loading meanwhile. That thread makes them itself, with cuDNN's attention
forward, where it would wait (``replay_here``: before a compiled program's first run waits for its
kernels, after a warm start's load).
"""

from __future__ import annotations

import contextvars
import json
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ember.config import settings

_DROPOUT_ARGS = ("dropout_p", "dropout")  # set to 0: the replay must not move the generator
# Where the first calls cost: cuDNN/cuBLAS set-up. (oneDNN's first calls on the CPU cost too, but a
# helper thread there takes a core from the load it would overlap.)
RECORDED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
SWITCH_INTERVAL_S = 1e-4  # the GIL hand-over while a helper thread replays beside Python work


def library_calls(steps: Iterable[Any], device_types: tuple[str, ...] | None = None) -> list[str]:
    """The distinct library calls of a plan's ``extern`` steps on a device of ``device_types``
    (default ``RECORDED_DEVICE_TYPES``), each as JSON text (``replay`` reads it); calls with an
    argument the text cannot hold are left out."""
    types = device_types or RECORDED_DEVICE_TYPES
    out: dict[str, None] = {}
    for step in steps:
        if step.kind != "extern":
            continue
        for n in step.nodes:
            call = _encode_call(n, types)
            if call is not None:
                out[call] = None
    return list(out)


def _encode_call(n: fx.Node, device_types: tuple[str, ...]) -> str | None:
    if not isinstance(n.target, torch._ops.OpOverload):
        return None
    try:
        args = [_encode(a) for a in n.args]
        kwargs = {k: _encode(v) for k, v in n.kwargs.items()}
    except _Unencodable:
        return None
    if not any(torch.device(d).type in device_types for d in _devices([args, list(kwargs.values())])):
        return None
    op = n.target
    return json.dumps({"op": [op.namespace, op._schema.name.split("::")[-1], op._overloadname],
                       "args": args, "kwargs": kwargs})


class _Unencodable(Exception):
    pass


def _encode(a: object) -> object:
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
        if not isinstance(a, torch.Tensor):
            raise _Unencodable
    if isinstance(a, torch.Tensor):
        return {"tensor": [list(a.shape), list(a.stride()), a.storage_offset(), str(a.dtype).split(".")[-1],
                           str(a.device)]}
    if isinstance(a, (list, tuple)):
        return [_encode(x) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).split(".")[-1]}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).split(".")[-1]}
    if isinstance(a, torch.layout):
        return {"layout": str(a).split(".")[-1]}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise _Unencodable


def _decode(value: object) -> object:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        shape, stride, offset, dtype, device = value["tensor"]
        span = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
        base = torch.zeros(max(span, 1), dtype=getattr(torch, dtype), device=device)
        return base.as_strided(shape, stride, offset)
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "device" in value:
        return torch.device(value["device"])
    if "memory_format" in value:
        return getattr(torch, value["memory_format"])
    if "layout" in value:
        return getattr(torch, value["layout"])
    return value


def _call_once(call: dict) -> None:
    namespace, name, overload = call["op"]
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    args = _decode(call["args"])
    kwargs = {k: _decode(v) for k, v in call["kwargs"].items()}
    for i, arg in enumerate(op._schema.arguments):
        if arg.name in _DROPOUT_ARGS:
            if i < len(args) and isinstance(args[i], float):
                args[i] = 0.0
            if isinstance(kwargs.get(arg.name), float):
                kwargs[arg.name] = 0.0
    op(*args, **kwargs)


@dataclass
class Replay:
    """What one replay did: calls made, failed and left to the first run, seconds, the first failure."""

    calls: int = 0
    failed: int = 0
    seconds: float = 0.0
    first_error: str = ""
    left: int = 0  # depthwise convolutions not replayed (``replayed_calls``)
    in_backward: int = 0  # gradient calls replayed inside an autograd backward

    def describe(self) -> str:
        text = f"{self.calls} library call(s) set up in {self.seconds:.3f} s"
        if self.in_backward:
            text += f", {self.in_backward} of them inside a backward (autograd's device thread)"
        if self.left:
            text += f", {self.left} depthwise convolution(s) left to the first run"
        if self.failed:
            text += f" ({self.failed} failed, first: {self.first_error[:160]})"
        return text


# Forward depthwise convolutions replayed per op. cuDNN builds a kernel for each new
# NHWC depthwise shape (0.4-1 s each on an H100) into a plan torch keeps per host thread: on the
# H100, after a helper thread had replayed all of mobilenet_v3's 88 convolution calls (7.2 s), the
# main thread's first calls of them still took 7.0 s and a new thread's 6.7 s (12.6 and 7.9 s with
# no replay; benchmarks/scripts/gpu_conv_replay_probe.py). Replaying one loads the code they
# share; replaying the rest only delays the join by work the running thread does again. (Their
# gradients are all replayed, inside a backward: the thread that runs the model's backward.)
DEPTHWISE_PER_OP = 1


def replayed_calls(calls: Iterable[str]) -> tuple[list[str], list[str], int]:
    """The calls a replay makes in its own thread, the gradient calls it makes inside an autograd
    backward (``in_backward``), and how many forward depthwise convolutions it leaves out."""
    kept: list[str] = []
    backward: list[str] = []
    seen: dict[str, int] = {}
    left = 0
    for text in calls:
        if _is_gradient_call(text):
            backward.append(text)
            continue
        op = _depthwise_op(text)
        if op is not None:
            seen[op] = seen.get(op, 0) + 1
            if seen[op] > DEPTHWISE_PER_OP:
                left += 1
                continue
        kept.append(text)
    return kept, backward, left


def _is_gradient_call(text: str) -> bool:
    """Whether the call is a gradient op (``convolution_backward``, an attention backward): on a
    GPU, autograd's device thread makes it, not the thread that called ``backward()``."""
    try:
        return str(json.loads(text)["op"][1]).endswith("_backward")
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def _depthwise_op(text: str) -> str | None:
    """The op's name if the call is a depthwise convolution (groups > 1, one input channel per group)."""
    try:
        call = json.loads(text)
        name = call["op"][1]
        at = {"convolution": (1, 8), "convolution_backward": (2, 9)}.get(name)
        if at is None:
            return None
        weight, groups = call["args"][at[0]], call["args"][at[1]]
        return name if isinstance(groups, int) and groups > 1 and weight["tensor"][0][1] == 1 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def replay(calls: Iterable[str]) -> Replay:
    """Run each call once on scratch tensors (see the module docstring: gradient calls inside an
    autograd backward, forward depthwise convolutions beyond ``DEPTHWISE_PER_OP`` per op left out);
    never raises."""
    kept, backward, left = replayed_calls(calls)
    result = Replay(left=left, in_backward=len(backward))
    start = time.perf_counter()
    devices: set[torch.device] = set()
    with torch.no_grad():
        for text in kept:
            _replay_one(text, result, devices)
    if backward:
        run_in_backward(lambda: [_replay_one(text, result, devices) for text in backward], result, backward)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the scratch tensors' memory is free once the calls ran
    result.seconds = time.perf_counter() - start
    return result


def _replay_one(text: str, result: Replay, devices: set[torch.device]) -> None:
    result.calls += 1
    try:
        call = json.loads(text)
        _call_once(call)
        devices.update(torch.device(d) for d in _devices([call["args"], list(call["kwargs"].values())]))
    except Exception as err:  # noqa: BLE001 - a set-up the first run pays instead
        result.failed += 1
        result.first_error = result.first_error or f"{type(err).__name__}: {err}"


# Forward ops whose set-up torch keeps per host thread and that cost seconds to build: cuDNN's
# attention graphs (MHA.cpp's thread-local cache; bert's training shape 591 ms on an H200) and,
# by ``_depthwise_op``, depthwise convolutions. Only the thread that runs them profits from them.
_THREAD_LOCAL_FORWARD = frozenset({"_scaled_dot_product_cudnn_attention"})


def thread_local_calls(calls: Iterable[str]) -> list[str]:
    """The forward calls among ``calls`` whose costly set-up stays with the thread that makes them."""
    out = []
    for text in calls:
        try:
            name = json.loads(text)["op"][1]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if name in _THREAD_LOCAL_FORWARD or _depthwise_op(text) == "convolution":
            out.append(text)
    return out


def replay_here(calls: Iterable[str]) -> Replay:
    """Make ``thread_local_calls(calls)`` on this thread now: called by the thread that will run
    the program, where it would otherwise wait (for the Triton kernels of a cold compile, for the
    helper thread after a warm start's load), so the program's first run finds their plans. Not
    inside a CUDA-graph capture, not with the warm-up off; never raises."""
    local = thread_local_calls(calls)
    result = Replay()
    if not local or not settings().library_warmup or _capturing():
        return result
    start = time.perf_counter()
    devices: set[torch.device] = set()
    with torch.no_grad():
        for text in local:
            _replay_one(text, result, devices)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - start
    return result


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _RunInBackward(torch.autograd.Function):
    """An identity whose backward runs ``work``: where autograd runs a backward on that device."""

    @staticmethod
    def forward(ctx: Any, seed: torch.Tensor, work: Any) -> torch.Tensor:
        ctx.work = work
        return seed.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            ctx.work()
        return grad, None


def run_in_backward(work: Any, result: Replay, calls: list[str]) -> None:
    """Run ``work`` inside a backward pass on the calls' device. torch keeps cuDNN's convolution
    plans and attention graphs per host thread, and autograd runs a CUDA backward on its own
    thread per device (the caller of ``backward()`` only waits), so gradient calls replayed
    anywhere else leave that thread to build them again at the model's first backward."""
    devices = _devices([json.loads(text)["args"] for text in calls[:1]])
    try:
        seed = torch.zeros((), device=devices[0] if devices else "cpu", requires_grad=True)
        with torch.enable_grad():
            _RunInBackward.apply(seed, work).backward()
    except Exception as err:  # noqa: BLE001 - the first backward pays the set-up instead
        result.failed += 1
        result.first_error = result.first_error or f"{type(err).__name__}: {err}"


def _devices(value: object) -> list[str]:
    if isinstance(value, dict):
        spec = value.get("tensor")
        return [spec[4]] if spec is not None else [d for v in value.values() for d in _devices(v)]
    if isinstance(value, list):
        return [d for v in value for d in _devices(v)]
    return []


class BackgroundReplay:
    """``replay(calls)`` in the process's library helper thread. Replays queue there one after
    another (two at once would only share the GIL and the libraries' locks); while any is queued
    the GIL switch interval is short, so each call gets the interpreter back promptly from the busy
    main thread. ``join()`` waits for this one; ``join_all()`` for every one queued so far. Join
    before anything else uses the device in a way the helper's work must not meet (a CUDA-graph
    capture, a program's first run)."""

    def __init__(self, calls: list[str]) -> None:
        self.result: Replay | None = None
        self.calls = calls
        self._done = threading.Event()
        _HELPER.submit(self)

    def _finish(self, result: Replay | None) -> None:
        self.result = result
        self._done.set()

    def finished(self) -> bool:
        return self._done.is_set()

    def join(self) -> Replay | None:
        """The replay's result once it finished (None if it ended without one)."""
        self._done.wait()
        return self.result


class _Helper:
    """The one helper thread and its queue; it lives while the queue has work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[BackgroundReplay] = []  # not started yet
        self._pending: list[BackgroundReplay] = []  # queued or running
        self._thread: threading.Thread | None = None
        self._interval: float | None = None

    def submit(self, job: BackgroundReplay) -> None:
        with self._lock:
            self._queue.append(job)
            self._pending.append(job)
            if self._interval is None:
                self._interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ember-library-warmup", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                job = self._queue.pop(0)
            result = None
            try:
                result = replay(job.calls)
            finally:
                with self._lock:
                    self._pending.remove(job)
                    if not self._pending and self._interval is not None:  # restored before the last join returns
                        sys.setswitchinterval(self._interval)
                        self._interval = None
                job._finish(result)

    def pending(self) -> list[BackgroundReplay]:
        with self._lock:
            return list(self._pending)


_HELPER = _Helper()


def join_all() -> None:
    """Wait for every replay queued so far (cheap when none is)."""
    for job in _HELPER.pending():
        job.join()


def start_replay(calls: list[str]) -> BackgroundReplay | None:
    """A background replay of ``calls`` where one may run now: the setting is on, there are
    calls, and this thread is not capturing a CUDA graph (the helper's work would break the
    capture)."""
    if not calls or not settings().library_warmup or _capturing():
        return None
    return BackgroundReplay(calls)


_COLLECTED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("ember_library_calls", default=None)


@contextmanager
def collecting() -> Iterator[list[str]]:
    """The library calls of every program compiled or loaded inside the block (a warm start saves
    them with the frame, to replay them at the next process's load)."""
    calls: list[str] = []
    token = _COLLECTED.set(calls)
    try:
        yield calls
    finally:
        _COLLECTED.reset(token)


def collect(calls: Iterable[str]) -> None:
    """Add a program's library calls to the enclosing ``collecting()`` block's, if any."""
    sink = _COLLECTED.get()
    if sink is not None:
        sink.extend(c for c in calls if c not in sink)
