"""Tuning one fused group's kernel: the default and the model's best candidates, each checked
against the default's output on fresh random inputs, then timed; everything recorded.

A deadline stops the candidates of one kernel too: what was measured is recorded with an
``incomplete`` marker row, and a later run measures only the candidates still missing."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember.codegen.kernel_source import KernelSource
from ember.schedule.plan import FusedGroup
from ember.targets import Target
from ember.tune.db import Result, TuningDB, config_text
from ember.tune.device import fingerprint
from ember.tune.measure import KernelRun, mismatch, time_interleaved_ms
from ember.tune.space import Candidate, cpu_candidates, triton_candidates


def generate(group: FusedGroup, target: Target, config: dict[str, int]) -> KernelSource:
    """``group``'s kernel for ``target`` with ``config`` overriding the generator's rules."""
    if target.language == "triton":
        from ember.codegen.triton_kernel import generate_triton
        return generate_triton(group, interpret=target.interpret, config=config or None)
    from ember.codegen.cpu_kernel import generate_cpu
    return generate_cpu(group, config or None)


def label(group: FusedGroup) -> str:
    """What a kernel computes, briefly: its ops and the group's shape."""
    ops = [getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in group.nodes]
    shown = ",".join(dict.fromkeys(ops))
    shown = shown if len(shown) <= 48 else shown[:45] + "..."
    val = group.outputs[0].meta.get("val") if group.outputs else None
    shape = "x".join(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else "?"
    return f"{shown} [{shape}]"


def candidates(group: FusedGroup, target: Target) -> list[Candidate]:
    if target.language == "triton":
        sms = int(fingerprint("cuda").get("sms", 132)) if target.runs_on_cuda else 132
        return triton_candidates(group, target.interpret, sms)
    return cpu_candidates(group, torch.get_num_threads())


@dataclass
class KernelTuning:
    """What tuning one kernel found."""

    kernel: str  # the default kernel's name: the database key
    label: str
    default_ms: float | None = None
    best_ms: float | None = None
    best_config: dict[str, int] = field(default_factory=dict)
    tried: int = 0
    failed: int = 0
    cached: bool = False  # answered by the database, nothing measured
    source: str = ""  # where a cached answer came from: "user" or "shared"
    incomplete: bool = False  # the budget ran out between this kernel's candidates
    kind: str = "kernel"  # "kernel" (a generated kernel's configuration) or "library" (an implementation choice)
    error: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def gain(self) -> float | None:
        return self.default_ms / self.best_ms if self.default_ms and self.best_ms else None

    def failed_check(self, key: str, device: str, config: dict, name: str, why: str, stamp: float) -> Result:
        """Count a candidate that failed its check against the reference; the row that records it."""
        self.failed += 1
        self.failures.append(f"{name}: {why}")
        return Result(key, device, config, None, "failed", why, self.label, stamp)


# The marker row of a kernel whose candidates the budget cut short (never a choice: not 'ok').
INCOMPLETE: dict = {"_incomplete": 1}


def incomplete_marker(kernel: str, device: str, label_text: str, stamp: float) -> Result:
    return Result(kernel, device, INCOMPLETE, None, "incomplete", "the tuning budget ran out", label_text, stamp)


def is_complete(known: list[Result]) -> bool:
    return bool(known) and not any(r.status == "incomplete" for r in known)


def measured_configs(db: TuningDB, kernel: str, device: str) -> set[str]:
    """The configurations of ``kernel`` already measured (checked or failed) in ``db``."""
    return {config_text(r.config) for r in db.results(kernel, device) if r.status != "incomplete"}


@dataclass
class Prepared:
    """One kernel's default and the candidates still to measure (generated, not yet run)."""

    default: KernelSource
    chosen: list[tuple[dict[str, int], KernelSource]]
    done: set[str]  # configurations an earlier run the budget cut short already measured
    failures: list[str] = field(default_factory=list)  # configurations the generator rejected


def prepare(group: FusedGroup, target: Target, db: TuningDB, device: str, top: int = 4,
            force: bool = False, default: KernelSource | None = None) -> Prepared | None:
    """The model's best ``top`` distinct candidates of ``group``'s kernel (configurations that
    generate the default kernel again, or the same kernel as an earlier one, are skipped); None
    when ``db`` already holds complete results (and ``force`` is off). ``default``: the group's
    default kernel, if the caller generated it already."""
    default = default if default is not None else generate(group, target, {})
    done: set[str] = set()
    if not force:
        known = db.results(default.name, device)
        if is_complete(known):
            return None
        done = {config_text(r.config) for r in known if r.status != "incomplete"}
    prepared = Prepared(default, [], done)
    seen = {default.name}
    for cand in candidates(group, target):
        try:
            ks = generate(group, target, cand.config)
        except Exception as err:  # noqa: BLE001 - a config the generator rejects is a failed candidate
            prepared.failures.append(f"{cand.config}: {type(err).__name__}: {err}")
            continue
        if ks.name in seen:
            continue
        seen.add(ks.name)
        if config_text(cand.config) in done:
            continue  # measured by an earlier run the budget cut short
        prepared.chosen.append((cand.config, ks))
        if len(prepared.chosen) >= top:
            break
    return prepared


def compile_ahead(prepared: list[Prepared], target: Target, kernel_dir: Path) -> object | None:
    """Hand the kernels of ``prepared`` to the compile workers (runtime/precompile.py) without
    waiting: Triton would compile each on its first launch, one at a time, while the tuner waits;
    the workers compile the next kernels' candidates while this one is measured. Returns the
    pending compile (None where the target does not precompile)."""
    if not target.precompiles() or not prepared:
        return None
    from ember.runtime import precompile
    from ember.runtime.kernels import kernel_file
    jobs = [precompile.job_for(kernel_file(k, kernel_dir), k.name, k.arg_dtypes(), k.meta)
            for p in prepared for ks in [p.default, *(c for _, c in p.chosen)] for k in ks.launch_order()]
    return precompile.submit(jobs)


def tune_group(group: FusedGroup, target: Target, kernel_dir: Path, db: TuningDB, device: str,
               top: int = 4, per_candidate_s: float = 0.2, force: bool = False,
               deadline: float | None = None, prepared: Prepared | None = None) -> KernelTuning:
    """Tune ``group``'s kernel unless ``db`` already has complete results for it on ``device``.
    Stops between candidates once ``deadline`` (a ``perf_counter`` time) has passed. ``prepared``:
    what ``prepare`` returned for this group earlier (generated again when None)."""
    default = prepared.default if prepared is not None else generate(group, target, {})
    if force:
        db.forget(default.name, device, INCOMPLETE)
    if prepared is None:
        prepared = prepare(group, target, db, device, top, force, default)
        if prepared is None:
            return from_db(KernelTuning(default.name, label(group)), db.results(default.name, device), "user")
    chosen = prepared.chosen
    out = KernelTuning(default.name, label(group), failures=list(prepared.failures))
    if target.language == "numba":
        from ember.runtime.kernels import compile_cpu_kernels
        failed = compile_cpu_kernels([default], kernel_dir)
        if failed:
            out.error = next(iter(failed.values()))
            return out
    run = KernelRun(default, target, kernel_dir, seed=int.from_bytes(os.urandom(4), "little"))
    reference = run.outputs_of(default, candidate=False)
    scratch = run.fresh_outputs()
    stamp = time.time()
    results: list[Result] = []
    # The default is always timed, beside the candidates that pass (measure.time_interleaved_ms):
    # they are compared with each other, so load from elsewhere must not fall on one of them only.
    passed: list[tuple[dict[str, int], KernelSource]] = [({}, default)]
    for config, ks in chosen:
        if deadline is not None and time.perf_counter() >= deadline:
            results.append(incomplete_marker(default.name, device, out.label, stamp))
            out.incomplete = True
            break
        out.tried += 1
        try:
            why = mismatch(reference, run.outputs_of(ks, candidate=True))
        except Exception as err:  # noqa: BLE001 - a candidate that cannot run is failed, not fatal
            why = f"{type(err).__name__}: {str(err)[:300]}"
        if why:
            results.append(out.failed_check(default.name, device, config, str(config), why, stamp))
            continue
        passed.append((config, ks))
    launches = [run.launcher(ks) for _, ks in passed]
    times = time_interleaved_ms([lambda launch=launch: launch(scratch) for launch in launches], run.device,
                                per_candidate_s * len(passed))
    for (config, _), ms in zip(passed, times):
        results.append(Result(default.name, device, config, ms, "ok", "", out.label, stamp))
    out.default_ms = times[0]
    if not out.incomplete:
        db.forget(default.name, device, INCOMPLETE)
    db.record(results, fingerprint(target.device_type))
    ok = [r for r in db.results(default.name, device) if r.usable]
    if ok:
        out.best_ms, out.best_config = ok[0].ms, ok[0].config
        out.default_ms = next((r.ms for r in ok if not r.config), out.default_ms)
    return out


def from_db(out: KernelTuning, known: list[Result], source: str) -> KernelTuning:
    """``out`` filled from a database's complete results (nothing measured)."""
    out.cached, out.source = True, source
    known = [r for r in known if r.status != "incomplete"]
    ok = [r for r in known if r.usable]
    out.tried = len(known) - 1
    out.failed = sum(r.failed for r in known)
    default = next((r for r in ok if not r.config), None)
    out.default_ms = default.ms if default else None
    if ok:
        out.best_ms, out.best_config = ok[0].ms, ok[0].config
    return out
