"""``ember tune``: compile a model, collect its generated kernels, tune them within a time budget.

The model is a bench registry name or a Python script that defines ``model`` and
``example_inputs`` (or ``make_model()`` and ``make_inputs()``). Compiling it once (training:
forward and backward) collects every fused group with the target it was generated for; kernels
the database already has results for cost nothing, the rest are tuned largest first (bytes
moved) until the budget is spent. Results go to the user's tuning database, which the next
compile uses.
"""

from __future__ import annotations

import contextlib
import runpy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember.schedule.plan import FusedGroup
from ember.targets import BY_NAME, Target
from ember.tune.db import TuningDB
from ember.tune.device import describe, device_key
from ember.tune.kernels import KernelTuning, generate, tune_group
from ember.tune.space import _group_bytes


@dataclass
class TuneReport:
    device: str
    budget_s: float
    seconds: float = 0.0
    kernels: list[KernelTuning] = field(default_factory=list)
    skipped: int = 0  # left for a later run: the budget ran out

    @property
    def measured(self) -> list[KernelTuning]:
        return [k for k in self.kernels if not k.cached and not k.error]


def collect_groups(model: Callable, inputs: tuple, train: bool, target: str = "auto",
                   loss: Callable[[Any], torch.Tensor] | None = None) -> list[tuple[FusedGroup, Target]]:
    """Every fused group Ember generates a kernel for when compiling ``model`` on ``inputs``."""
    import ember
    from ember.instruments import instrument

    found: list[tuple[FusedGroup, Target]] = []

    def after(stage: str, record: Any, artifact: Any) -> None:
        if stage == "schedule":
            tgt = BY_NAME.get(record.target)
            if tgt is not None and tgt.language is not None:
                found.extend((g, tgt) for g in artifact.fused())

    compiled = ember.compile(model, target=target, cache=False)
    with instrument(after=after):
        grad = torch.enable_grad() if train else torch.no_grad()
        with grad:
            out = compiled(*inputs)
            if train:
                from ember.bench.models import primary_tensor
                value = loss(out) if loss is not None else primary_tensor(out).float().sum()
                value.backward()
    return found


def tune_groups(groups: list[tuple[FusedGroup, Target]], db: TuningDB, kernel_dir: Path, budget_s: float,
                top: int = 4, force: bool = False, progress: bool = True) -> TuneReport:
    """Tune every distinct kernel of ``groups`` (largest first) until ``budget_s`` is spent."""
    start = time.perf_counter()
    dev_type = groups[0][1].device_type if groups else "cpu"
    report = TuneReport(describe(dev_type), budget_s)
    distinct: dict[str, tuple[FusedGroup, Target]] = {}
    for group, target in groups:
        try:
            name = generate(group, target, {}).name
        except Exception:  # noqa: BLE001 - a group the generator rejects ran through ATen: nothing to tune
            continue
        distinct.setdefault(name, (group, target))
    order = sorted(distinct.values(), key=lambda gt: -_group_bytes(gt[0]))
    bar = _progress(progress)
    with bar:
        task = bar.add_task("tuning kernels", total=len(order))
        for group, target in order:
            spent = time.perf_counter() - start
            device = device_key(target.device_type)
            if spent >= budget_s and (force or not db.results(generate(group, target, {}).name, device)):
                report.skipped += 1
                bar.advance(task)
                continue
            try:
                result = tune_group(group, target, kernel_dir, db, device, top=top, force=force)
            except Exception as err:  # noqa: BLE001 - one kernel's trouble never stops the run
                from ember.tune.kernels import label
                result = KernelTuning(generate(group, target, {}).name, label(group), error=f"{type(err).__name__}: {err}")
            report.kernels.append(result)
            bar.update(task, advance=1, description=f"tuning kernels ({result.label[:40]})")
    report.seconds = time.perf_counter() - start
    return report


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=True)


class _NoProgress(contextlib.nullcontext):
    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


def summary_table(report: TuneReport):
    """A rich table: kernel, default ms, best ms, gain, candidates tried/failed."""
    from rich.table import Table
    table = Table(title=f"ember tune on {report.device}: {len(report.kernels)} kernel(s) in {report.seconds:.1f} s "
                        f"(budget {report.budget_s:.0f} s)", title_justify="left")
    for col, justify in (("kernel", "left"), ("default ms", "right"), ("best ms", "right"), ("gain", "right"),
                         ("tried/failed", "right"), ("", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for k in sorted(report.kernels, key=lambda k: -(k.default_ms or 0)):
        note = "error: " + k.error[:60] if k.error else "from database" if k.cached else ""
        table.add_row(k.label, f"{k.default_ms:.4f}" if k.default_ms else "-", f"{k.best_ms:.4f}" if k.best_ms else "-",
                      f"{k.gain:.2f}x" if k.gain else "-", f"{k.tried}/{k.failed}", note)
    if report.skipped:
        table.caption = f"{report.skipped} kernel(s) not tuned: the budget ran out (run `ember tune` again to go on)"
    return table


def load_model(spec: str, device: torch.device, mode: str, batch: int | None, small: bool
               ) -> tuple[Callable, tuple, Callable | None]:
    """(model, example inputs, loss) for a bench registry name or a script path."""
    if spec.endswith(".py") or Path(spec).is_file():
        ns = runpy.run_path(spec, run_name="__ember_tune__")
        model = ns["make_model"]() if "make_model" in ns else ns.get("model")
        inputs = ns["make_inputs"]() if "make_inputs" in ns else ns.get("example_inputs")
        if model is None or inputs is None:
            raise ValueError(f"{spec} must define `model` and `example_inputs` (or make_model() and make_inputs())")
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if isinstance(model, torch.nn.Module):
            model = model.to(device).train(mode == "train")
        inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
        return model, inputs, ns.get("loss")
    from ember.bench import models
    case = models.get_case(spec)
    torch.manual_seed(0)
    model = case.build(small).to(device).train(mode == "train")
    (inputs, target), *_ = models.make_batches(case, batch or case.default_batch(mode), device, small=small, count=1)
    return model, tuple(inputs), (lambda out: case.loss(out, target))


def run_cli(args: Any) -> int:
    """``ember tune`` (see cli.py for the arguments)."""
    from rich.console import Console

    from ember import config
    from ember.bench.harness import resolve_device

    console = Console()
    options = config.Options.from_env()
    db_path = Path(args.db) if args.db else config.tuning_db_path(options.cache_root())
    db = TuningDB(db_path)
    if args.export_path or args.import_path:
        if args.import_path:
            n = db.import_from(args.import_path)
            console.print(f"imported {n} result(s) from {args.import_path} into {db_path}")
        if args.export_path:
            n = db.export(args.export_path)
            console.print(f"exported {n} result(s) from {db_path} to {args.export_path}")
        if not args.model:
            return 0
    if not args.model:
        console.print("ember tune: give a MODEL (registry name or script.py), or --export/--import PATH")
        return 2
    device = resolve_device(args.device)
    model, inputs, loss = load_model(args.model, device, args.mode, args.batch, args.small)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    t0 = time.perf_counter()
    with autocast:
        groups = collect_groups(model, inputs, args.mode == "train", args.target, loss)
    console.print(f"compiled {args.model} ({args.mode}) in {time.perf_counter() - t0:.1f} s: "
                  f"{len(groups)} generated kernel use(s); tuning database {db_path} "
                  f"(device {device_key(device.type)})")
    if not groups:
        console.print("nothing to tune: no generated kernels (see `ember explain`)")
        return 0
    report = tune_groups(groups, db, options.kernel_dir(), args.budget, top=args.top, force=args.force,
                         progress=console.is_terminal)
    console.print(summary_table(report))
    measured = report.measured
    if measured:
        failed = sum(k.failed for k in measured)
        console.print(f"measured {len(measured)} kernel(s), {sum(k.tried for k in measured)} candidate(s) checked, "
                      f"{failed} rejected (wrong result or error: recorded as failed, never used)")
    return 0
