"""The whole model with and without its tuned choices, the last step of ``ember tune``.

Every choice was measured on its own (one kernel or one library call on random inputs), and a
choice faster on its own can lose inside the model: on a 2-core Xeon, mobilenet_v3's convolutions
tuned to ATen were 1.17-2.87x faster alone and the model 0.88-0.96x untuned Ember's, because a
standalone timing misses what the choice changes around it (an epilogue that becomes an ATen op
of its own, the cache state of a real network). So ``ember tune`` compiles the model with the
database's choices and with the fixed rules, and with subsets of the choices (library choices
only, generated-kernel configurations only, the better and the worse half by standalone gain);
compares each program's outputs (and gradients when training) with the rules' program; times
them all in turn (``measure.time_interleaved_ms``), and keeps the fastest correct variant if it
beats the rules by at least ``MIN_GAIN``. The choices it leaves out are demoted in the user's
database (status ``slower_in_model``): compile falls back to the rule for them and later tunes
do not measure them again. The verdict is noted in the database under the set of choices it
judged, so a second ``ember tune`` of the same model skips the check.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import config
from ember.tune.apply import setting_aside
from ember.tune.db import Result, TuningDB

MIN_GAIN = 1.01  # a tuned program must beat the rules' by 1% to be kept: a difference from the rule must pay
# Relative norm error of a variant's outputs / gradients against the rules' program.
_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 5e-2), torch.float16: (1e-2, 3e-2)}


@dataclass
class Variant:
    name: str
    keys: frozenset[str]  # the tuned choices it uses
    ms: float | None = None
    error: str = ""  # why its outputs were not accepted


@dataclass
class ModelCheck:
    """What the whole-model check found."""

    choices: dict[str, dict]  # key -> the tuned record (kind, label, config, ms, default_ms, gain)
    variants: list[Variant] = field(default_factory=list)
    kept: str = "rules"  # name of the variant kept
    demoted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False  # the database had a verdict for this set of choices
    not_timed: list[str] = field(default_factory=list)  # subsets left out: the budget

    @property
    def rules_ms(self) -> float | None:
        return next((v.ms for v in self.variants if v.name == "rules"), None)

    def line(self) -> str:
        if not self.choices:
            return "whole-model check: no tuned choice differs from the rules here"
        if self.cached:
            return (f"whole-model check: judged earlier for these {len(self.choices)} choice(s): kept "
                    f"{self.kept}, {len(self.demoted)} demoted")
        timed = ", ".join(f"{v.name} {v.ms:.3f} ms" if v.ms is not None else f"{v.name} ({v.error})"
                          for v in self.variants)
        left = f" (not timed, the budget: {', '.join(self.not_timed)})" if self.not_timed else ""
        return (f"whole-model check ({self.seconds:.1f} s): {timed}{left}; kept {self.kept}, "
                f"{len(self.demoted)} of {len(self.choices)} choice(s) demoted as slower in the model")


def tuned_choices(compiled: Any) -> dict[str, dict]:
    """Every tuned answer a compiled model uses that is not the rule (from its graph records)."""
    out: dict[str, dict] = {}
    backend = getattr(compiled, "_ember_backend", None)
    for g in backend.log.graphs if backend is not None else []:
        for key, rec in g.tuned.items():
            if rec.get("config"):
                out[key] = rec
    return out


def _check_key(choices: dict[str, dict], device: str) -> str:
    text = json.dumps(sorted((k, v.get("config")) for k, v in choices.items()), sort_keys=True)
    return "model_check:" + hashlib.sha256(f"{device}|{text}".encode()).hexdigest()[:24]


def _variants(choices: dict[str, dict]) -> list[Variant]:
    """The subsets of the tuned choices worth timing (no duplicates, never empty)."""
    keys = frozenset(choices)
    library = frozenset(k for k, v in choices.items() if v.get("kind") == "library")
    by_gain = sorted(choices, key=lambda k: -(choices[k].get("gain") or 0.0))
    half = frozenset(by_gain[:max(1, len(by_gain) // 2)])
    wanted = [("all", keys), ("library choices", library), ("kernel configurations", keys - library),
              ("better half", half), ("worse half", keys - half)]
    seen: set[frozenset[str]] = set()
    out = [Variant("rules", frozenset())]
    for name, subset in wanted:
        if subset and subset not in seen:
            seen.add(subset)
            out.append(Variant(name, subset))
    return out


def run_step(fn: Callable, inputs: tuple, train: bool, loss: Callable[[Any], torch.Tensor] | None = None
             ) -> torch.Tensor:
    """One call of ``fn`` as ``ember tune`` makes it: inference under no_grad, or forward, the loss
    (else the sum of the primary output) and backward. Returns the primary output, detached."""
    from ember.bench.models import primary_tensor

    with torch.enable_grad() if train else torch.no_grad():
        out = fn(*inputs)
        value = primary_tensor(out)
        if train:
            (loss(out) if loss is not None else value.float().sum()).backward()
    return value.detach()


def check_in_model(model: Callable, inputs: tuple, train: bool, target: str, db: TuningDB, device: str,
                   choices: dict[str, dict] | None = None, loss: Callable[[Any], torch.Tensor] | None = None,
                   precision: torch.dtype = torch.float32, budget_s: float = 60.0,
                   shared: TuningDB | None = None) -> ModelCheck:
    """Time ``model`` compiled with subsets of ``choices`` against the rules' program; demote in
    ``db`` (the user's) the choices the fastest correct variant does not use (all of them when no
    variant beats the rules by ``MIN_GAIN``), also those answered by the read-only ``shared``.
    ``choices`` (the tuned answers the model uses, as ``tuned_choices`` reads them) saves a compile
    when the caller has them; else the model is compiled once with tuning on to find them."""
    import ember
    from ember.bench.check import _rel
    from ember.tune.measure import time_interleaved_ms

    start = time.perf_counter()
    dev = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    autocast = (torch.autocast(dev.type, dtype=precision) if precision != torch.float32
                else contextlib.nullcontext())

    def call(fn: Callable) -> torch.Tensor:
        with autocast:
            return run_step(fn, inputs, train, loss)

    # Every variant is a compile of the same frames: start from a clean Dynamo state so that they
    # all fit its recompile limit (this runs in ``ember tune``'s own process).
    torch._dynamo.reset()
    if choices is None:
        fn = ember.compile(copy.deepcopy(model), target=target, cache=False)
        call(fn)
        choices = tuned_choices(fn)
    result = ModelCheck(choices)
    if not choices:
        return result
    key = _check_key(choices, device)
    noted = db.note(key)
    if noted is None and shared is not None:
        try:
            noted = shared.note(key)  # a team's database carries its verdicts with its answers
        except Exception:  # noqa: BLE001 - an unreadable shared file answers nothing
            noted = None
    if noted is not None:
        result.kept, result.demoted, result.cached = noted["kept"], noted["demoted"], True
        return result
    all_keys = frozenset(choices)
    variants = _variants(choices)

    runs: list[Callable[[], Any]] = []
    outputs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for variant in list(variants):
        # The rules and all the choices are always compared; the subsets while half the budget lasts
        # (compiles are most of the check's time), the rest of it is for timing.
        if variant.name not in ("rules", "all") and time.perf_counter() - start > budget_s / 2:
            variants.remove(variant)
            result.not_timed.append(variant.name)
            continue
        m = copy.deepcopy(model)
        # The first call compiles: the variant's set-aside answers must be in force then.
        with config.patch(tuning=bool(variant.keys)), setting_aside(all_keys - variant.keys):
            fn = ember.compile(m, target=target, cache=False)
            got = call(fn)
        grads = [p.grad.detach().clone() for p in m.parameters() if p.grad is not None] if train else []
        outputs.append((got, grads))

        def run(fn=fn, m=m) -> None:
            for p in m.parameters() if train else ():
                p.grad = None
            call(fn)
        runs.append(run)
    ref_out, ref_grads = outputs[0]
    # The looser of the run's precision and the outputs' dtype (a model in bf16 weights, no autocast).
    out_tol, grad_tol = max(_TOLERANCE.get(precision, _TOLERANCE[torch.float32]),
                            _TOLERANCE.get(getattr(ref_out, "dtype", None), _TOLERANCE[torch.float32]))
    for variant, (got, grads) in zip(variants, outputs):
        worst_out = _rel(got, ref_out)
        worst_grad = max((_rel(a, b) for a, b in zip(grads, ref_grads)), default=0.0)
        if not worst_out <= out_tol or not worst_grad <= grad_tol:
            variant.error = f"differs from the rules' program (outputs {worst_out:.2e}, gradients {worst_grad:.2e})"
    correct = [i for i, v in enumerate(variants) if not v.error]
    per_variant = max(1.0, (budget_s - (time.perf_counter() - start)) / len(correct))
    # Uncaptured: each variant replays CUDA graphs of its own (measure._event_times says why).
    times = time_interleaved_ms([runs[i] for i in correct], dev, per_variant, rounds=7, capture=False)
    for i, ms in zip(correct, times):
        variants[i].ms = ms
    rules_ms = variants[0].ms
    assert rules_ms is not None
    best = min((v for v in variants if v.ms is not None), key=lambda v: v.ms)
    if best.ms * MIN_GAIN > rules_ms:
        best = variants[0]
    result.variants, result.kept = variants, best.name
    result.demoted = sorted(all_keys - best.keys)
    if result.demoted:
        detail = (f"whole model {', '.join(f'{v.name} {v.ms:.4f} ms' for v in variants if v.ms is not None)}; "
                  f"kept {best.name}")
        rows: list[Result] = []
        for k in result.demoted:
            known = db.results(k, device)
            if not any(r.usable and r.config for r in known) and shared is not None:
                known = shared.results(k, device)  # the shared answer is set aside in the user's database
            rows += [r for r in known if r.usable and r.config]
        db.demote(rows, detail)
    result.seconds = time.perf_counter() - start
    verdict = {"kept": result.kept, "demoted": result.demoted, "variants": {v.name: v.ms for v in variants},
               "at": time.time()}
    db.note(key, verdict)
    if result.demoted and best.keys:
        # What compile uses from now on is the kept subset: the next tune finds that set judged too.
        db.note(_check_key({k: choices[k] for k in best.keys}, device), {**verdict, "demoted": []})
    return result
