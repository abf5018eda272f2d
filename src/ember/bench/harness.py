"""Benchmark harness: eager vs ``torch.compile`` (Inductor, in its modes) vs Ember in one process.

Method (BENCHMARKS.md): every backend gets a fresh deep copy of one built model (identical
initial weights) and the same rotating input batches. The first call is timed as the
compile time, then warm-up steps, then timed steps: synchronised after every step (the
headline, ``timing.time_sync_each_step``), then the same number pipelined between CUDA events
(a second column). A failure in one backend is recorded in its row and the run goes on.
Backends, and the hook through which a backend supplies its own training step, are in
``backends.py``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ember.bench import launch_compiles, timing
from ember.bench.backends import (
    BACKENDS,
    BackendUnavailable,
    default_backends,
    default_train_step,
    infer_only,
    peer_mode,
    register_backend,
    train_only,
    train_step_factory,
)
from ember.bench.gc_time import timed_collections
from ember.bench.memory import measure_cpu_peak
from ember.bench.models import BenchCase, get_case, make_batches, primary_tensor
from ember.bench.report import row_provenance
from ember.runtime import cpu_compile

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "default_backends",
    "register_backend",
    "resolve_device",
    "resolve_precision",
    "run_benchmark",
]

MODES = ("train", "infer")
PRECISIONS = ("bf16", "fp32")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:  # torch's message for "tpu" and the like
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda ({err})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return dev


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` means bf16 autocast on GPU (the headline numbers) and fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of auto, {', '.join(PRECISIONS)}; got {precision!r}")
    return precision


# ---------------------------------------------------------------------------------------
# Progress display
# ---------------------------------------------------------------------------------------


class _Progress:
    """A rich live display on a terminal, one plain line per finished row otherwise
    (so long runs in a pipe still show where they are), or nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def phase(self, label: str, phase: str, total: int | None = None) -> None:
        if self._progress is None:
            return
        desc = f"{label}: {phase}"
        if self._task is None:
            self._task = self._progress.add_task(desc, total=total)
        else:
            self._progress.reset(self._task, total=total, description=desc)

    def advance(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def done(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        label = f"{row['model']} {row['mode']} bs{row['batch']} {row['backend']}"
        if row.get("error"):
            line = f"{label}: ERROR {row['error']}"
        else:
            line = f"{label}: {row['ms_median']:.2f} ms (compile {row['compile_s']:.1f} s)"
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(f"[ember bench] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# One measurement
# ---------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The training rows' optimizers, as a user constructs them (torch picks foreach on CUDA).
OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01),
}


def make_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _autocast(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    def autocast() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    return autocast


def _make_step(
    case: BenchCase, fn: Callable[..., Any], mode: str, precision: str, device: torch.device,
    optimizer: torch.optim.Optimizer | None,
) -> Callable[[tuple[torch.Tensor, ...], torch.Tensor], Any]:
    """The default step around a compiled model ``fn`` (device scripts build steps with it)."""
    autocast = _autocast(precision, device)
    if mode == "train":
        assert optimizer is not None
        return default_train_step(fn, optimizer, case.loss, autocast)

    def infer_step(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> Any:
        with torch.no_grad(), autocast():
            return fn(*inputs)

    return infer_step


def _backend_step(
    case: BenchCase, name: str, model: nn.Module, mode: str, precision: str, device: torch.device,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[Callable[[tuple[torch.Tensor, ...], torch.Tensor], Any], Callable[..., Any] | None]:
    """The callable the harness times, and the compiled model (for the compile split): in
    training the backend's own step if it has one, else the default step around its model."""
    if mode == "train":
        own_step = train_step_factory(name)
        if own_step is not None:
            assert optimizer is not None
            return own_step(model, optimizer, case.loss, _autocast(precision, device)), None
    fn = BACKENDS[name](model)
    return _make_step(case, fn, mode, precision, device, optimizer), fn


def _fresh_copies(batches: list) -> list:
    """New tensors with the batches' values for one backend. AOTAutograd stamps tensors that a
    dynamic-shape graph saved for backward (``_dynamo_propagated_dynamic_indices``) and Dynamo
    traces a stamped dim as dynamic in every later compile, whatever the backend's shape policy;
    shared batches carried one backend's dynamic-shape recompile (Inductor's automatic dynamic
    shapes on an embedding called at two lengths) into the backends measured after it."""
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, batches)


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def ember_backend_of(fn: Callable[..., Any]) -> Any:
    """The Ember backend behind a compiled model or a bench step (None for other backends): a whole-step
    program's is its compiled ``train_fn``'s."""
    backend = getattr(fn, "_ember_backend", None)
    whole = getattr(fn, "whole_step", None)
    if backend is None and whole is not None:
        backend = getattr(getattr(whole, "compiled_fn", None), "_ember_backend", None)
    return backend


def _compile_split(fn: Callable[..., Any], total_s: float) -> dict[str, Any] | None:
    """Where an Ember first call went: Ember's stages summed over its graphs, the compiled graphs'
    first run, and the rest (Dynamo and AOTAutograd capture, eager code between and after the
    graphs, such as the optimizer's first step). None for other backends."""
    backend = ember_backend_of(fn)
    if backend is None:
        return None
    graphs = backend.log.graphs
    stages = backend.log.stage_totals()
    ember_s = sum(stages.values())
    first_run = sum(g.first_call_s or 0.0 for g in graphs)
    return {"ember_s": ember_s, "ember_stages_s": stages, "first_run_s": first_run,
            "capture_and_rest_s": max(0.0, total_s - ember_s - first_run), "graphs": len(graphs),
            "kernels": sum(g.kernels for g in graphs), "unique_kernels": sum(g.unique_kernels for g in graphs),
            "frame_cache": list(getattr(backend.log, "frame_cache", [])),  # each frame: loaded, stored or why not
            # where each graph's kernel_compile stage went (workers, their start, the slowest kernel)
            "compile_notes": {g.title: g.compile_note for g in graphs if g.compile_note},
            "warm_start": list(backend.log.warm_start)}


def _measure(
    case: BenchCase, base: nn.Module, name: str, batches: list, mode: str, precision: str,
    device: torch.device, warmup: int, iters: int, row: dict[str, Any], progress: _Progress, label: str,
    optimizer_name: str = "sgd",
) -> torch.Tensor | None:
    """Fill ``row`` with the measurements; returns the first output (CPU float) for checks."""
    torch._dynamo.reset()  # each backend compiles from a clean Dynamo state
    if device.type == "cuda":
        # Hand back what earlier cases left cached, so each backend's reserved peak is its own;
        # what stays reserved (pools an earlier backend still holds) is recorded with the row.
        gc.collect()
        torch.cuda.empty_cache()
        row["reserved_at_start_bytes"] = torch.cuda.memory_reserved(device)
    model = copy.deepcopy(base).to(device)
    model.train(mode == "train")
    optimizer = make_optimizer(optimizer_name, model.parameters()) if mode == "train" else None
    progress.phase(label, "compiling")
    step, fn = _backend_step(case, name, model, mode, precision, device, optimizer)

    # First call: compilation (and, for train, the lazily compiled backward) plus one step.
    torch.manual_seed(0)
    _sync(device)
    t0 = time.perf_counter()
    with launch_compiles.counting() as launched, timed_collections() as collected:
        first = step(*batches[0])
        _sync(device)
    row["compile_s"] = time.perf_counter() - t0
    row["first_call_collections"] = collected
    if launched.get("hit") or launched.get("miss"):
        row["launch_compiles"] = launched
    # A backend with its own training step may hang Ember's log on the step itself.
    split = _compile_split(fn if fn is not None else step, row["compile_s"])
    if split:
        row["compile_split"] = split
    first_out = primary_tensor(first).detach().float().cpu()
    if mode == "train":
        row["first_loss"] = float(first_out)
    del first

    progress.phase(label, "warm-up", total=warmup)
    for i in range(warmup):
        step(*batches[(i + 1) % len(batches)])
        progress.advance()
    if name.startswith("ember") and device.type == "cpu":
        # Kernels compiling behind the first calls (runtime/aten_first.py): time the steady state,
        # after the step that switches to them.
        t1 = time.perf_counter()
        if not cpu_compile.wait_behind(timeout=1800):
            row["note"] = "CPU kernels still compiling after 30 min: timed steps ran fused groups through ATen"
        row["kernels_behind_wait_s"] = time.perf_counter() - t1
        step(*batches[0])
    _sync(device)

    # Peak memory of the steady state: reset after warm-up so compile-time scratch
    # (e.g. autotuning buffers) does not count; weights and inputs are live and do.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress.phase(label, "timing", total=iters)
    times_ms, host_ms = timing.time_sync_each_step(step, batches, iters, device, progress.advance)
    row["timer"] = timing.SYNC_EACH_STEP
    row["host_ms_median"] = _median(host_ms)
    if device.type == "cuda":
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_mem_source"] = "cuda_max_memory_allocated"
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        progress.phase(label, "timing pipelined", total=iters)
        pipelined = timing.time_pipelined(step, batches, iters, device, progress.advance)
        row["pipelined_timer"] = timing.PIPELINED
        row["pipelined_ms_median"] = _median(pipelined)
        row["pipelined_ms_min"] = min(pipelined) if pipelined else None
    else:
        # Max RSS only grows and counts everything the process holds: it read 0 B for rows below an
        # earlier row's high-water mark. One more step under the profiler gives the tensor bytes
        # that step allocated at its peak, on top of weights, optimizer state and inputs.
        row["peak_mem_bytes"] = measure_cpu_peak(step, *batches[iters % len(batches)])[1].peak
        row["peak_mem_source"] = "cpu_profiler_step_peak"

    whole = getattr(step, "whole_step", None)
    if whole is not None:  # how the whole-step program ran, and why any call ran uncaptured
        report = whole.explain()
        row["whole_step"] = {"status": report.mode, "captured_calls": report.captured_calls,
                             "calls": report.calls, "uncaptured": dict(report.uncaptured_calls)}
    whole_call = getattr(getattr(fn, "_ember_backend", None), "whole_call", None)
    if whole_call is not None:  # how the whole-call program ran, and why any call took the normal path
        row["whole_call"] = {"status": whole_call.describe(), "replays": whole_call.replays,
                             "calls": whole_call.calls, "uncaptured": dict(whole_call.uncaptured)}
    median = statistics.median(times_ms)
    row["ms_median"] = median
    row["ms_min"] = min(times_ms)
    row["ms_max"] = max(times_ms)
    row["samples_per_s"] = row["batch"] / (median / 1e3) if median > 0 else math.inf
    return first_out


def _is_ember(backend: str) -> bool:
    return backend == "ember" or backend.startswith("ember-")


def _fill_comparisons(group: list[dict[str, Any]], outputs: dict[str, torch.Tensor]) -> None:
    """Speedup over the eager row of the same model/mode/batch; for Ember rows, the speedup over
    every other backend measured (``vs_peers``: peer median / Ember median); and the largest
    output difference from eager in inference (a fast but wrong backend must show up)."""
    eager = next((r for r in group if r["backend"] == "eager" and not r.get("error")), None)
    measured = [r for r in group if not r.get("error") and r.get("ms_median")]
    for row in group:
        if row.get("error"):
            continue
        if _is_ember(row["backend"]) and row.get("ms_median"):
            row["vs_peers"] = {p["backend"]: p["ms_median"] / row["ms_median"] for p in measured
                               if not _is_ember(p["backend"])}
        if eager is None:
            continue
        row["speedup_vs_eager"] = eager["ms_median"] / row["ms_median"] if row["ms_median"] else None
        ref, out = outputs.get("eager"), outputs.get(row["backend"])
        if row["mode"] == "infer" and ref is not None and out is not None:
            row["max_abs_diff_vs_eager"] = (
                float((out - ref).abs().max()) if out.shape == ref.shape else f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
            )


def _new_row(case: str, mode: str, backend: str, precision: str, batch: int | None, device: torch.device,
             small: bool, warmup: int, iters: int, provenance: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": case, "mode": mode, "backend": backend, "peer_mode": peer_mode(backend), "precision": precision,
        "batch": batch, "device": str(device), "small": small, "warmup": warmup, "iters": iters,
        "timer": timing.SYNC_EACH_STEP, "ms_median": None, "ms_min": None, "ms_max": None, "host_ms_median": None,
        "pipelined_ms_median": None, "pipelined_ms_min": None, "samples_per_s": None, "compile_s": None,
        "peak_mem_bytes": None, "peak_mem_source": None, "peak_reserved_bytes": None, "speedup_vs_eager": None,
        "error": None, **provenance, "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _record_error(row: dict[str, Any], err: BaseException) -> None:
    row["error"] = f"{type(err).__name__}: {err}".strip()
    # The tail of the traceback says where a compiler failed; the head is harness frames.
    row["traceback"] = "".join(traceback.format_exception(err))[-4000:]


@contextlib.contextmanager
def _tf32(device: torch.device) -> Iterator[None]:
    # fp32 on GPU is measured with TF32 matmuls allowed (BENCHMARKS.md); cuDNN convs allow
    # TF32 by default. Restored afterwards so the caller's process is unchanged.
    if device.type != "cuda":
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def run_benchmark(
    cases: Sequence[str | BenchCase],
    modes: Sequence[str] = ("train",),
    backends: Sequence[str] | None = None,
    precision: str = "auto",
    device: str | torch.device = "auto",
    batch: int | Sequence[int] | None = None,
    warmup: int | None = None,
    iters: int = 30,
    progress: bool = True,
    small: bool = False,
    n_batches: int = 3,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
    optimizer: str = "sgd",
) -> list[dict[str, Any]]:
    """Measure every case x mode x batch x backend; returns one dict per measurement.

    ``backends`` None means ``default_backends(device)``; ``batch`` None uses each case's
    default for the mode; ``warmup`` None means 10 steps on GPU and 3 on CPU. ``on_result`` is called with all rows so far after each row (the CLI
    uses it to keep the JSON file current during long runs). ``optimizer``: the training rows'
    optimizer (``OPTIMIZERS``), recorded in each training row.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    prec = resolve_precision(precision, dev)
    if warmup is None:
        warmup = 10 if dev.type == "cuda" else 3
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    backends = list(backends) if backends is not None else default_backends(dev)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    resolved = [c if isinstance(c, BenchCase) else get_case(c) for c in cases]
    batch_list = [batch] if isinstance(batch, int) else list(batch) if batch else None

    provenance = row_provenance(dev)
    results: list[dict[str, Any]] = []
    with _Progress(progress) as prog, _tf32(dev):
        for case in resolved:
            base: nn.Module | None = None
            build_error: BaseException | None = None
            try:
                torch.manual_seed(0)  # same initial weights in every run
                base = case.build(small)
            except Exception as err:  # e.g. a missing optional package: fail this case only
                build_error = err
            for mode in modes:
                for bs in batch_list or [case.default_batch(mode)]:
                    group: list[dict[str, Any]] = []
                    outputs: dict[str, torch.Tensor] = {}
                    batches: list = []
                    if base is not None:
                        batches = make_batches(case, bs, dev, small=small, count=n_batches)
                    for name in backends:
                        if mode != "train" and train_only(name) or mode == "train" and infer_only(name):
                            continue
                        row = _new_row(case.name, mode, name, prec, bs, dev, small, warmup, iters, provenance)
                        if mode == "train":
                            row["optimizer"] = optimizer
                        label = f"{case.name} {mode} bs{bs} [{name}]"
                        if build_error is not None:
                            _record_error(row, build_error)
                        else:
                            assert base is not None
                            try:
                                out = _measure(case, base, name, _fresh_copies(batches), mode, prec, dev, warmup,
                                               iters, row, prog, label, optimizer)
                                if out is not None:
                                    outputs[name] = out
                            except Exception as err:
                                _record_error(row, err)
                        _free(dev)  # the model copy, optimizer and compiled code are gone now
                        group.append(row)
                        results.append(row)
                        _fill_comparisons(group, outputs)
                        prog.done(row)
                        if on_result is not None:
                            on_result(results)
                    del batches
                    _free(dev)
            del base
            torch._dynamo.reset()
            _free(dev)
    return results
