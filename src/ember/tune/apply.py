"""Compile-time use of the tuning database: after codegen, each kernel with a tuned answer for
this device is generated again with its best checked configuration; during the passes, each
library site with a tuned answer (a CPU convolution / linear layer; a GPU matmul or depthwise
convolution; an inference attention call) gets its measured-best implementation (``library_chooser``).

Cost without tuning: nothing when neither database file exists (a ``stat`` per file), else one
indexed query per graph for all of its kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ember import config
from ember.passes.library_sites import Choose, LibraryChoice, LibrarySite
from ember.report.records import GraphRecord
from ember.schedule.plan import KernelPlan
from ember.targets import GeneratedKernels, Target
from ember.tune.db import LayeredTuningDB

_OPEN: dict[tuple[str, str], LayeredTuningDB] = {}
# The whole-model check (tune/model_check.py) compiles with some tuned answers set aside: those
# kernels and library sites get the rule while one of these sets is active.
_SET_ASIDE: list[frozenset[str]] = []


@contextlib.contextmanager
def setting_aside(keys: frozenset[str]) -> Iterator[None]:
    """Compiles inside ignore the tuned answers of ``keys`` (kernel names and library site keys)."""
    _SET_ASIDE.append(keys)
    try:
        yield
    finally:
        _SET_ASIDE.remove(keys)


def _set_aside(key: str) -> bool:
    return any(key in keys for keys in _SET_ASIDE)


def tuning_db(cache_root: Path) -> LayeredTuningDB:
    """The layered database for ``cache_root`` (one per process and path pair)."""
    user, shared = config.tuning_db_path(cache_root), config.tuning_shared_path()
    key = (str(user), str(shared))
    if key not in _OPEN:
        _OPEN[key] = LayeredTuningDB(user, shared)
    return _OPEN[key]


def forget_open() -> None:
    for db in _OPEN.values():
        db.close()
    _OPEN.clear()


def tuning_stamp(cache_root: Path) -> str:
    """Part of the compiled-program cache key: a program compiled before tuning is not reused after."""
    if not config.tuning_enabled():
        return ""
    db = tuning_db(cache_root)
    return db.stamp() if db.exists() else ""


def apply_tuned(kernels: GeneratedKernels, plan: KernelPlan, target: Target, cache_root: Path,
                record: GraphRecord) -> GeneratedKernels:
    """``kernels`` with every tuned kernel replaced by its best checked configuration."""
    if not kernels.by_step or target.language is None or not config.tuning_enabled():
        return kernels
    db = tuning_db(cache_root)
    if not db.exists():
        return kernels
    from ember.tune.device import device_key
    from ember.tune.kernels import generate

    choices = db.choices([ks.name for ks in kernels.by_step.values()], device_key(target.device_type))
    if not choices:
        return kernels
    groups = {g.index: g for g in plan.fused()}
    for index, ks in list(kernels.by_step.items()):
        choice = choices.get(ks.name)
        if choice is None or _set_aside(ks.name):
            continue
        tuned = ks if not choice.config else generate(groups[index], target, choice.config)
        kernels.by_step[index] = tuned
        record.tuned[ks.name] = {"kernel": tuned.name, "config": choice.config, "ms": choice.ms,
                                 "default_ms": choice.default_ms, "gain": choice.gain, "source": choice.source}
    return kernels


# ``ember tune`` collects the library sites of the model it compiles through this seam.
_SITE_COLLECTORS: list[list[LibrarySite]] = []


@contextlib.contextmanager
def collecting_sites() -> Iterator[list[LibrarySite]]:
    """Every library site the passes meet while this is active (compiles must not hit the cache)."""
    found: list[LibrarySite] = []
    _SITE_COLLECTORS.append(found)
    try:
        yield found
    finally:
        _SITE_COLLECTORS.remove(found)


def library_chooser(target: Target, cache_root: Path, record: GraphRecord) -> Choose | None:
    """The chooser of library implementations for one graph's passes (CPU inference's library
    calls, passes/gpu_library_choices.py's sites), or None (the rules) when tuning is off or there
    is neither a database nor a collector."""
    if not (target.device_type == "cpu" or target.gpu_code_path) or not config.tuning_enabled():
        return None
    db = tuning_db(cache_root)
    if not db.exists() and not _SITE_COLLECTORS:
        return None
    from ember.tune.device import device_key
    device = device_key(target.device_type)

    def choose(site: LibrarySite) -> LibraryChoice | None:
        for found in _SITE_COLLECTORS:
            found.append(site)
        if not db.exists():
            return None
        choice = db.choices([site.key], device).get(site.key)
        if choice is None or _set_aside(site.key):
            return None
        impl = choice.config.get("impl", site.impls[0])
        if impl not in site.impls:
            return None  # an answer this Ember cannot emit here (another version's candidate)
        entry = record.tuned.setdefault(site.key, {
            "kernel": site.key, "label": site.label, "kind": "library", "rule": site.impls[0], "config": choice.config,
            "ms": choice.ms, "default_ms": choice.default_ms, "gain": choice.gain, "source": choice.source, "sites": 0})
        entry["sites"] += 1

        def declined() -> None:  # listed while at least one site of this key runs the answer
            entry["sites"] -= 1
            if entry["sites"] <= 0:
                record.tuned.pop(site.key, None)
        return LibraryChoice(impl, dict(choice.config), declined)
    return choose
