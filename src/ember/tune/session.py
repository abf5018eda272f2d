"""``ember tune``: compile a model, collect its generated kernels and library choices, tune them
within a time budget.

The model is a bench registry name or a Python script that defines ``model`` and
``example_inputs`` (or ``make_model()`` and ``make_inputs()``). Compiling it once (training:
forward and backward) collects every fused group with the target it was generated for, and
every library call whose implementation may be chosen (CPU inference's convolutions, linear
layers and attention; the GPU code path's matmuls, depthwise convolutions and inference attention).
What the user's database or the shared read-only one already answers costs nothing; the rest is
tuned, library choices first, largest first, until the budget is spent (checked between the
candidates of one kernel too). Results go to the user's tuning database, which the next compile
uses.
"""

from __future__ import annotations

import contextlib
import runpy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember.passes.library_sites import LibrarySite
from ember.schedule.plan import FusedGroup
from ember.targets import BY_NAME, Target
from ember.tune.apply import collecting_sites
from ember.tune.db import TuningDB
from ember.tune.device import describe, device_key
from ember.tune.kernels import (
    KernelTuning,
    Prepared,
    compile_ahead,
    from_db,
    generate,
    is_complete,
    prepare,
    tune_group,
)
from ember.tune.kernels import label as kernel_label
from ember.tune.library import tune_site
from ember.tune.report import config_label
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
    return collect_work(model, inputs, train, target, loss)[0]


def collect_work(model: Callable, inputs: tuple, train: bool, target: str = "auto",
                 loss: Callable[[Any], torch.Tensor] | None = None, tuned: dict[str, dict] | None = None
                 ) -> tuple[list[tuple[FusedGroup, Target]], list[LibrarySite]]:
    """What compiling ``model`` on ``inputs`` leaves to tune: every fused group Ember generates a
    kernel for, and every convolution / linear layer with a choice of library implementations.
    ``tuned`` receives the tuned answers that compile used (model_check.tuned_choices)."""
    import ember
    from ember.instruments import instrument

    found: list[tuple[FusedGroup, Target]] = []

    def after(stage: str, record: Any, artifact: Any) -> None:
        if stage == "schedule":
            tgt = BY_NAME.get(record.target)
            if tgt is not None and tgt.language is not None:
                found.extend((g, tgt) for g in artifact.fused())

    compiled = ember.compile(model, target=target, cache=False)
    from ember.tune.model_check import run_step, tuned_choices

    with instrument(after=after), collecting_sites() as sites:
        run_step(compiled, inputs, train, loss)
    if tuned is not None:
        tuned.update(tuned_choices(compiled))
    distinct = list({site.key: site for site in sites if len(site.impls) > 1}.values())
    return found, distinct


def _answered(name: str, device: str, db: TuningDB, shared: TuningDB | None) -> tuple[str, list] | None:
    """("user" | "shared", results) when a database holds complete results for ``name``; the
    user's database decides alone once it has any entry (as compile does)."""
    known = db.results(name, device)
    if known:
        return ("user", known) if is_complete(known) else None
    if shared is not None:
        try:
            theirs = shared.results(name, device)
        except Exception:  # noqa: BLE001 - an unreadable shared file answers nothing
            return None
        if is_complete(theirs):
            return "shared", theirs
    return None


def tune_groups(groups: list[tuple[FusedGroup, Target]], db: TuningDB, kernel_dir: Path, budget_s: float,
                top: int = 4, force: bool = False, progress: bool = True, sites: Sequence[LibrarySite] = (),
                shared: TuningDB | None = None) -> TuneReport:
    """Tune the library choice of every site in ``sites`` (largest weight first), then every
    distinct kernel of ``groups`` (largest first), until ``budget_s`` is spent. What ``db`` or the
    read-only ``shared`` database already answers is reported, not measured (unless ``force``)."""
    start = time.perf_counter()
    deadline = start + budget_s
    dev_type = groups[0][1].device_type if groups else "cpu"
    report = TuneReport(describe(dev_type), budget_s)
    distinct: dict[str, tuple[FusedGroup, Target]] = {}
    for group, target in groups:
        try:
            name = generate(group, target, {}).name
        except Exception:  # noqa: BLE001 - a group the generator rejects ran through ATen: nothing to tune
            continue
        distinct.setdefault(name, (group, target))
    order = sorted(distinct.items(), key=lambda item: -_group_bytes(item[1][0]))
    site_order = sorted(sites, key=lambda s: -_site_work(s))
    bar = _progress(progress)
    with bar:
        task = bar.add_task("tuning", total=len(order) + len(site_order))
        work = [(site.key, site.label, site, None) for site in site_order] + \
            [(name, None, group, target) for name, (group, target) in order]
        ahead = _CompileAhead(work, db, shared, kernel_dir, top, force)
        for i, (name, site_label, what, target) in enumerate(work):
            device = device_key(target.device_type if target is not None else what.device_type)
            answer = None if force else _answered(name, device, db, shared)
            if target is not None and answer is None and time.perf_counter() < deadline:
                ahead.reach(i)
            if answer is not None:
                text = site_label if site_label is not None else kernel_label(what)
                result = from_db(KernelTuning(name, text, kind="library" if target is None else "kernel"),
                                 answer[1], answer[0])
            elif time.perf_counter() >= deadline:
                report.skipped += 1
                bar.advance(task)
                continue
            else:
                try:
                    if target is None:
                        result = tune_site(what, db, device, deadline=deadline)
                        result.kind = "library"
                    else:
                        result = tune_group(what, target, kernel_dir, db, device, top=top, force=force,
                                            deadline=deadline, prepared=ahead.take(name))
                except Exception as err:  # noqa: BLE001 - one kernel's trouble never stops the run
                    text = site_label if site_label is not None else kernel_label(what)
                    result = KernelTuning(name, text, error=f"{type(err).__name__}: {err}")
            report.kernels.append(result)
            bar.update(task, advance=1, description=f"tuning ({result.label[:40]})")
    report.seconds = time.perf_counter() - start
    return report


class _CompileAhead:
    """Candidates of the kernels about to be measured, generated and handed to the compile workers
    a few kernels ahead of the measuring (tune/kernels.compile_ahead): on the GPU the tuner then
    loads compiled binaries instead of compiling every candidate on its first launch."""

    LOOKAHEAD = 8  # kernels in flight: enough to keep every worker busy, little wasted at the deadline

    def __init__(self, work: list, db: TuningDB, shared: TuningDB | None, kernel_dir: Path, top: int,
                 force: bool) -> None:
        self.work, self.db, self.shared, self.kernel_dir = work, db, shared, kernel_dir
        self.top, self.force = top, force
        self.next = 0  # the first work item not looked at yet
        self.prepared: dict[str, Prepared | None] = {}

    def reach(self, i: int) -> None:
        """Prepare and submit work items up to ``i + LOOKAHEAD``."""
        batches: dict[Target, list[Prepared]] = {}
        while self.next < min(len(self.work), i + self.LOOKAHEAD + 1):
            name, _, group, tgt = self.work[self.next]
            self.next += 1
            if tgt is None or name in self.prepared:
                continue
            device = device_key(tgt.device_type)
            if not self.force and _answered(name, device, self.db, self.shared) is not None:
                continue
            try:
                self.prepared[name] = p = prepare(group, tgt, self.db, device, self.top, self.force)
            except Exception:  # noqa: BLE001 - tune_group meets the same trouble and reports it
                continue
            if p is not None:
                batches.setdefault(tgt, []).append(p)
        for tgt, batch in batches.items():
            try:
                compile_ahead(batch, tgt, self.kernel_dir)
            except Exception:  # noqa: BLE001 - compiling ahead only saves time: launches compile anyway
                pass

    def take(self, name: str) -> Prepared | None:
        return self.prepared.pop(name, None)


def _site_work(site: LibrarySite) -> int:
    """Roughly a site's multiply-adds (the order sites are tuned in: biggest first)."""
    import math
    if site.op == "matmul":
        return math.prod(site.x[0]) * site.weight[0][-1]
    out = math.prod(site.x[0]) if site.op == "linear" else math.prod(site.x[0][2:])
    return out * math.prod(site.weight[0][:1]) * (math.prod(site.weight[0][1:]) if site.op.startswith("conv") else 1)


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


def _best_text(k: KernelTuning) -> str:
    if k.best_ms is None:
        return "-"
    if not k.best_config:
        return "the rule" if k.kind == "library" else "default"
    return config_label(k.best_config)


def summary_table(report: TuneReport):
    """A rich table: kernel or library site, default ms, best ms, gain, best choice, candidates tried/failed."""
    from rich.table import Table
    table = Table(title=f"ember tune on {report.device}: {len(report.kernels)} kernel(s) and library choice(s) in "
                        f"{report.seconds:.1f} s (budget {report.budget_s:.0f} s)", title_justify="left")
    for col, justify in (("kernel / library site", "left"), ("default ms", "right"), ("best ms", "right"),
                         ("gain", "right"), ("best", "left"), ("tried/failed", "right"), ("", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for k in sorted(report.kernels, key=lambda k: -(k.default_ms or 0)):
        note = ("error: " + k.error[:60] if k.error else
                ("from the shared database" if k.source == "shared" else "from your database") if k.cached else "incomplete: the budget ran out" if k.incomplete else "")
        table.add_row(k.label, f"{k.default_ms:.4f}" if k.default_ms else "-", f"{k.best_ms:.4f}" if k.best_ms else "-",
                      f"{k.gain:.2f}x" if k.gain else "-", _best_text(k), f"{k.tried}/{k.failed}", note)
    return table


def answered_line(report: TuneReport) -> str:
    """What the databases answered and what the budget left, in one line ("" when nothing to say)."""
    shared = sum(k.cached and k.source == "shared" for k in report.kernels)
    mine = sum(k.cached and k.source != "shared" for k in report.kernels)
    parts = []
    if mine or shared:
        parts.append(f"{mine + shared} answered without measuring: {mine} by your database, {shared} by the shared "
                     "(read-only) database")
    incomplete = sum(k.incomplete for k in report.kernels)
    if report.skipped or incomplete:
        parts.append(f"{report.skipped} not tuned and {incomplete} cut short: the budget ran out "
                     "(run `ember tune` again to go on)")
    return "; ".join(parts)


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


# Whole-model checks in one ``ember tune``: a check that demotes choices changes the program, whose
# choices are then judged too (one more round is enough unless that round demotes again).
CHECK_ROUNDS = 3


def run_cli(args: Any) -> int:
    """``ember tune`` (see cli.py for the arguments)."""
    from rich.console import Console

    from ember import config
    from ember.bench.harness import resolve_device

    console = Console()
    options = config.Options.from_env()
    db_path = Path(args.db) if args.db else config.tuning_db_path(options.cache_root())
    db = TuningDB(db_path)
    shared_path = config.tuning_shared_path()
    shared = TuningDB(shared_path, read_only=True) if shared_path is not None and shared_path.exists() else None
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
    before: dict[str, dict] = {}
    # The compiles that collect the work use this database's choices (as a later compile will).
    with autocast, config.patch(tuning_db=str(db_path)):
        groups, sites = collect_work(model, inputs, args.mode == "train", args.target, loss, tuned=before)
    console.print(f"compiled {args.model} ({args.mode}) in {time.perf_counter() - t0:.1f} s: "
                  f"{len(groups)} generated kernel use(s), {len(sites)} library choice(s); tuning database "
                  f"{db_path}{f' over the shared {shared_path}' if shared is not None else ''} "
                  f"(device {device_key(device.type)})")
    if not groups and not sites:
        console.print("nothing to tune: no generated kernels and no library choices (see `ember explain`)")
        return 0

    def tune_program(groups: list, sites: list, spent_s: float) -> TuneReport:
        """The library sites, then the generated kernels of the program their choices make, within
        what is left of the budget. The compile that found ``groups`` used the database's choices;
        a library call newly taken off its rule leaves its epilogue to a generated kernel, so the
        kernels are collected again for the program that will really run."""
        def tune(groups: list, sites: list, spent_s: float) -> TuneReport:
            return tune_groups(groups, db, options.kernel_dir(), max(0.0, args.budget - spent_s), top=args.top,
                               force=args.force, progress=console.is_terminal, sites=sites, shared=shared)

        report = tune([], sites, spent_s)
        if any(k.best_config for k in report.measured):
            with autocast, config.patch(tuning_db=str(db_path)):
                groups = collect_groups(model, inputs, args.mode == "train", args.target, loss)
        rest = tune(groups, (), spent_s + report.seconds)
        report.kernels += rest.kernels
        report.skipped += rest.skipped
        report.seconds += rest.seconds
        return report

    report = tune_program(groups, sites, 0.0)
    report.device = describe(device.type)  # (the library sites alone would name the CPU)
    console.print(summary_table(report))
    measured = report.measured
    if measured:
        failed = sum(k.failed for k in measured)
        console.print(f"measured {len(measured)} kernel(s) and library choice(s), {sum(k.tried for k in measured)} "
                      f"candidate(s) checked, {failed} rejected (wrong result or error: recorded as failed, never used)")
    line = answered_line(report)
    if line:
        console.print(line)
    if args.model_check:
        from ember.tune.model_check import check_in_model
        # Nothing measured now: the choices are those the first compile used (no compile needed).
        known = before if not measured else None
        spent = report.seconds
        for round_ in range(1, CHECK_ROUNDS + 1):
            with config.patch(tuning_db=str(db_path)):
                check = check_in_model(model, inputs, args.mode == "train", args.target, db, device_key(device.type),
                                       known, loss, torch.bfloat16 if args.precision == "bf16" else torch.float32,
                                       budget_s=max(20.0, args.budget - spent), shared=shared)
            console.print(check.line())
            spent += check.seconds
            if not check.demoted or check.cached or round_ == CHECK_ROUNDS or spent >= args.budget:
                break
            # The demoted choices are back on their rules, so the program is another one (a library
            # call's epilogue fused again, its neighbours grouped otherwise): tune the kernels it has
            # now and judge the choices it makes, so that the next ``ember tune`` finds them judged.
            # Its library sites too: a convolution whose neighbour went back to its rule can take an
            # epilogue again (mobilenet_v3's squeeze-excite convolutions with their hardsigmoid).
            with autocast, config.patch(tuning_db=str(db_path)):
                groups, sites = collect_work(model, inputs, args.mode == "train", args.target, loss)
            more = tune_program(groups, sites, spent)
            spent += more.seconds
            known = None
            if more.measured:
                console.print(f"the program without the demoted choices: measured {len(more.measured)} more "
                              f"kernel(s) and library choice(s), {sum(k.failed for k in more.measured)} rejected")
    return 0
