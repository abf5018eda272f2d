"""The starvation doctor: does the step wait for data, and what would fix it.

    doctor = ember.data.doctor(loader)       # wraps the loop's iterable, yields the same batches
    for x, y in doctor:
        step(x, y)
    print(doctor.report())                   # "input-bound: 63% of step time waiting for data" + advice
    doctor.report().to_dict()

Per step it measures the time spent in the loader's ``next()`` (waiting for data) and the time
from receiving the batch to asking for the next one (compute). On a CUDA device it synchronises
the loop's current stream before and after each ``next()`` (``sync=False`` turns that off), so
asynchronous kernels count as the step's and a prefetcher's pending copy as waiting;
BENCHMARKS.md times steps the same way.
The first step of each pass (worker start-up, a first batch) is reported apart, not averaged in.
``StepTimer`` does the same for a loop written by hand (``with timer.waiting(): ...``).

Verdict. A loader that makes batches while the step runs (DataLoader workers, ember.data.prefetch)
is *input-bound* when at least ``INPUT_BOUND_SHARE`` of step time is spent waiting: its producers
do not keep up. A loader that makes each batch on demand in the loop's thread is input-bound when
waiting takes longer than compute (it is slower than the step, so overlapping alone cannot hide
it); otherwise its waiting is *compute-bound* time that prefetching would hide, and the advice
says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ember.data.prefetch import DevicePrefetcher

__all__ = ["INPUT_BOUND_SHARE", "StarvationDoctor", "StarvationReport", "StepTimer", "doctor", "loader_facts"]

INPUT_BOUND_SHARE = 0.10  # of step time spent waiting, for a loader that works ahead
HIDEABLE_SHARE = 0.03  # waiting worth hiding with a prefetcher in a compute-bound loop


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loader_facts(loader: Iterable) -> dict[str, Any]:
    """What the advice depends on: the loader's kind and DataLoader settings, the cores, the device."""
    facts: dict[str, Any] = {"cores": _cores(), "prefetcher": None, "kind": type(loader).__name__}
    inner = loader
    if isinstance(loader, DevicePrefetcher):
        facts["prefetcher"] = {"depth": loader.depth, "device": str(loader.device)}
        facts["device"] = loader.device.type
        inner = loader.loader
        facts["kind"] = f"DevicePrefetcher over {type(inner).__name__}"
    if isinstance(inner, torch.utils.data.DataLoader):
        facts.update(dataloader=True, num_workers=inner.num_workers, pin_memory=inner.pin_memory,
                     persistent_workers=inner.persistent_workers, prefetch_factor=inner.prefetch_factor,
                     batch_size=inner.batch_size)
    else:
        facts["dataloader"] = False
    facts.setdefault("device", "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu")
    # Batches made while the step runs (workers, a prefetch thread) or on demand in this thread.
    facts["works_ahead"] = facts["prefetcher"] is not None or bool(facts.get("num_workers"))
    return facts


@dataclasses.dataclass
class StarvationReport:
    """The doctor's finding. ``print()`` it (a rich table) or take ``to_dict()``."""

    verdict: str  # "input-bound", "compute-bound" or "no steps"
    steps: int  # steps measured (first step of each pass left out)
    wait_share: float  # of all measured step time, the part spent waiting for the next batch
    step_ms: float  # medians over the measured steps
    wait_ms: float
    compute_ms: float
    data_ms: float | None  # a batch's cost to make where known (a prefetcher's loader calls)
    first_batch_ms: list[float]  # per pass: iter() plus the first next() (worker start-up)
    facts: dict[str, Any]
    advice: list[str]

    @property
    def headline(self) -> str:
        if self.verdict == "no steps":
            return "no steps measured: run the loop through the doctor first"
        return f"{self.verdict}: {100 * self.wait_share:.0f}% of step time waiting for data"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["headline"] = self.headline
        return out

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title="input starvation", show_header=True, header_style="bold")
        table.add_column("measure")
        table.add_column("value", justify="right")
        rows = [("steps measured", str(self.steps)), ("step ms (median)", f"{self.step_ms:.2f}"),
                ("waiting for data ms", f"{self.wait_ms:.2f}"), ("compute ms", f"{self.compute_ms:.2f}"),
                ("share of step time waiting", f"{100 * self.wait_share:.1f}%")]
        if self.data_ms is not None:
            rows.append(("loader ms per batch", f"{self.data_ms:.2f}"))
        if self.first_batch_ms:
            rows.append(("first batch ms (per pass)", ", ".join(f"{v:.1f}" for v in self.first_batch_ms)))
        rows += [("loader", str(self.facts.get("kind"))), ("cores", str(self.facts.get("cores")))]
        if self.facts.get("dataloader"):
            rows.append(("DataLoader", f"num_workers={self.facts['num_workers']} pin_memory={self.facts['pin_memory']} "
                         f"persistent_workers={self.facts['persistent_workers']} "
                         f"prefetch_factor={self.facts['prefetch_factor']}"))
        for name, value in rows:
            table.add_row(name, value)
        style = "bold red" if self.verdict == "input-bound" else "bold green"
        lines = [Text(self.headline, style=style), table]
        lines += [Text(f"- {a}") for a in self.advice]
        return Group(*lines)

    def __str__(self) -> str:
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=110, force_terminal=False, color_system=None).print(self)
        return buf.getvalue().rstrip()


def _advice(verdict: str, facts: dict[str, Any], wait_ms: float, compute_ms: float, wait_share: float,
            data_ms: float | None, first_ms: list[float], step_ms: float) -> list[str]:
    cores = facts["cores"]
    workers = facts.get("num_workers")
    cuda = facts.get("device") == "cuda"
    prefetcher = facts.get("prefetcher")
    out: list[str] = []
    if verdict == "input-bound":
        if facts.get("dataloader"):
            if workers == 0:
                out.append(f"decode in worker processes: DataLoader(num_workers={max(1, cores - 1)}) "
                           f"(this machine has {cores} cores; now every batch is made in the training process)")
            elif workers < cores:
                out.append(f"raise num_workers from {workers} toward {cores} (the cores this process may use)")
            else:
                out.append(f"num_workers={workers} already uses all {cores} cores: the CPU cannot make batches "
                           "faster; decode on the GPU, or store smaller or pre-decoded images")
            if workers and (facts.get("prefetch_factor") or 2) <= 2:
                out.append("prefetch_factor=4 keeps more batches ready per worker (default 2), for uneven batches")
            if workers and not facts.get("persistent_workers") and first_ms and max(first_ms) > 2 * step_ms:
                out.append(f"persistent_workers=True: every pass starts its workers again "
                           f"(a first batch took {max(first_ms):.0f} ms against {step_ms:.0f} ms a step)")
            if cuda and not facts.get("pin_memory") and prefetcher is None:
                out.append("pin_memory=True (or ember.data.prefetch, which pins and copies on a side stream)")
        else:
            out.append("make batches in parallel: torch.utils.data.DataLoader(dataset, num_workers=N, "
                       f"persistent_workers=True) (this machine has {cores} cores)")
        if cuda:
            out.append("if the loader decodes JPEG: torchvision.io.decode_jpeg(data, device='cuda') decodes on the GPU "
                       "(nvjpeg); workers then only read files")
        if prefetcher is None:
            out.append("ember.data.prefetch(loader, device) overlaps the next batch with the step "
                       "(it cannot help while the loader is slower than the step)")
        elif data_ms is not None and data_ms < compute_ms:
            out.append(f"raise the prefetch depth (now {prefetcher['depth']}): the loader is faster than the step "
                       "on average but not every batch")
    elif verdict == "compute-bound":
        if wait_share >= HIDEABLE_SHARE and prefetcher is None:
            out.append(f"ember.data.prefetch(loader, device) would hide the {100 * wait_share:.0f}% spent waiting: "
                       f"the loader ({wait_ms:.1f} ms a batch) is faster than the step ({compute_ms:.1f} ms)"
                       + (" - on a CPU device only where a core is spare: the loader and the step's threads "
                          "share the cores" if facts.get("device") == "cpu" else ""))
        elif wait_share >= HIDEABLE_SHARE and prefetcher is not None:
            out.append(f"raise the prefetch depth (now {prefetcher['depth']}) to absorb uneven batches")
        headroom = compute_ms - (data_ms if data_ms is not None else wait_ms)
        out.append(f"the step sets the pace: ember.compile(model) makes it faster; the loader has about "
                   f"{max(headroom, 0.0):.1f} ms of headroom per batch")
        if workers and workers > 2 and facts.get("device") == "cpu":
            out.append(f"on a CPU-trained model, {workers} workers compete with the step for {cores} cores: "
                       "fewer may train faster")
    return out


class StepTimer:
    """Per step: seconds waiting for the batch and seconds of compute, for any loop.

        timer = StepTimer()
        with timer.waiting():
            batch = next(it)
        with timer.computing():
            step(batch)
        print(timer.report(loader))
    """

    def __init__(self, sync: bool | None = None, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        if sync is None:
            sync = (self.device.type == "cuda" if self.device is not None
                    else torch.cuda.is_available() and torch.cuda.is_initialized())
        self.sync = sync
        self.waits: list[float] = []
        self.computes: list[float] = []
        self.first: list[float] = []  # first batch of each pass, left out of the steps
        self.data: list[float] = []  # a batch's cost where a prefetcher measured it

    def _now(self) -> float:
        if self.sync:
            # The loop's stream only: a prefetcher's copies ahead on its side stream are not the
            # step's; the copy of the batch being taken is waited for by this stream after next().
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = self._now()
        yield
        self.waits.append(self._now() - t0)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        t0 = self._now()
        yield
        self.computes.append(self._now() - t0)

    def add(self, wait_s: float, compute_s: float) -> None:
        self.waits.append(wait_s)
        self.computes.append(compute_s)

    def report(self, loader: Iterable | None = None, facts: dict[str, Any] | None = None) -> StarvationReport:
        facts = facts if facts is not None else (loader_facts(loader) if loader is not None else
                                                 {"cores": _cores(), "prefetcher": None, "kind": "unknown",
                                                  "dataloader": False, "works_ahead": False,
                                                  "device": "cuda" if self.sync else "cpu"})
        n = min(len(self.waits), len(self.computes))
        first_ms = [1e3 * v for v in self.first]
        data_ms = 1e3 * statistics.median(self.data) if self.data else None
        if n == 0:
            return StarvationReport("no steps", 0, 0.0, 0.0, 0.0, 0.0, data_ms, first_ms, facts, [])
        waits, computes = self.waits[:n], self.computes[:n]
        total = sum(waits) + sum(computes)
        share = sum(waits) / total if total > 0 else 0.0
        wait_ms, compute_ms = 1e3 * statistics.median(waits), 1e3 * statistics.median(computes)
        step_ms = 1e3 * statistics.median(w + c for w, c in zip(waits, computes))
        if facts.get("works_ahead"):
            input_bound = share >= INPUT_BOUND_SHARE
        else:  # batches made on demand: the loader sets the pace only where it is slower than the step
            input_bound = share >= INPUT_BOUND_SHARE and sum(waits) > sum(computes)
        verdict = "input-bound" if input_bound else "compute-bound"
        advice = _advice(verdict, facts, wait_ms, compute_ms, share, data_ms, first_ms, step_ms)
        return StarvationReport(verdict, n, share, step_ms, wait_ms, compute_ms, data_ms, first_ms, facts, advice)


class StarvationDoctor:
    """Iterate it instead of the loader; every pass adds to one ``StepTimer``."""

    def __init__(self, loader: Iterable, sync: bool | None = None, warmup: int = 0) -> None:
        self.loader = loader
        self.warmup = warmup  # steps after the first of each pass left out (a compile, a warm-up)
        device = loader.device if isinstance(loader, DevicePrefetcher) else None
        self.timer = StepTimer(sync=sync, device=device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        timer = self.timer
        began = timer._now()
        it = iter(self.loader)
        first = True
        skip = self.warmup
        wait: float | None = None  # the step in flight: its wait, its compute still running
        handed_at = 0.0  # when its batch was handed to the loop
        try:
            while True:
                start = timer._now()
                if wait is not None:
                    timer.add(wait, start - handed_at)
                    wait = None
                try:
                    batch = next(it)
                except StopIteration:
                    return
                handed_at = timer._now()
                if first:  # iter() and the first batch (worker start-up): reported apart
                    timer.first.append(handed_at - began)
                    first = False
                elif skip > 0:
                    skip -= 1
                else:
                    wait = handed_at - start
                yield batch
        finally:
            if wait is not None:  # the loop left during a step (break, an error)
                timer.add(wait, timer._now() - handed_at)
            stats = getattr(it, "stats", None)
            if stats is not None:
                timer.data.extend(stats.fetch[1:])
            close = getattr(it, "close", None)
            if close is not None and isinstance(self.loader, DevicePrefetcher):
                close()

    def report(self) -> StarvationReport:
        return self.timer.report(self.loader)


def doctor(loader: Iterable, sync: bool | None = None, warmup: int = 0) -> StarvationDoctor:
    """Wrap a training loop's iterable; ``.report()`` says whether the step waits for data.
    ``loader`` may be a DataLoader, an ``ember.data.prefetch(...)`` or any iterable; ``warmup``
    steps after the first of each pass are not measured."""
    return StarvationDoctor(loader, sync=sync, warmup=warmup)
