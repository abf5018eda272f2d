"""Tuned against untuned Ember on the GPU: ``ember tune`` within a budget, then training steps.

    PYTHONPATH=src python benchmarks/scripts/gpu_tune.py --models resnet50,bert --budget 240 \
        --json $OUT/gpu_tune.json

Per model (training, bf16 autocast, the registry's default batch, SGD with momentum):
  1. untuned Ember (EMBER_TUNING=0): compile, warm up, time ``--steps`` steps, each synchronised;
  2. tune: compile once collecting every generated kernel and every library call whose
     implementation may be chosen (matmuls: cuBLAS, Ember's small products, Ember's tiled kernel
     per tile configuration; depthwise convolutions: cuDNN or Ember's kernels), then measure the
     candidates of each (every one checked on fresh random inputs, library calls first) within
     ``--budget`` seconds, into a fresh tuning database (``--library-only``: the library calls alone);
  3. the whole-model check ``ember tune`` ends with (tune/model_check.py): the model compiled with
     the rules and with subsets of the tuned choices, timed in turn, the choices that do not pay
     in the model demoted (``--no-model-check`` skips it: the standalone choices alone);
  4. tuned Ember: compile again (the database now answers), time the same steps;
  5. a second tune of the same model: must finish in seconds when the first one finished
     (everything in the database); a kernel the first tune's budget cut short (the budget is
     checked between one kernel's candidates) is finished by the second, so then it takes longer:
     the ``cut`` column counts those kernels and the ones never reached.
Both arms start from the same weights and batches; the first losses must agree (bf16 tolerance).
Prints a table (untuned ms, tuned ms, speedup, tuning seconds, kernels measured / tuned-in-use,
candidates rejected) and writes JSON with the device and versions. Expected runtime: about
2 x budget + 3 minutes per model; memory: one model's training state twice (< 20 GiB on H100).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ember
from ember import config
from ember.bench import models
from ember.instruments import instrument
from ember.tune.apply import forget_open
from ember.tune.db import TuningDB
from ember.tune.device import describe, device_key
from ember.tune.model_check import check_in_model
from ember.tune.report import config_label
from ember.tune.session import collect_work, tune_groups


def _steps(model: torch.nn.Module, batches: list, loss_fn: Any, steps: int, warmup: int) -> tuple[list[float], float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    compiled = ember.compile(model, cache=False)
    times, first_loss = [], float("nan")
    for i in range(warmup + steps):
        inputs, target = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(*inputs)
            loss = loss_fn(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 0:
            first_loss = float(loss)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times, first_loss


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_model(name: str, budget: float, steps: int, warmup: int, cache: Path, top: int,
              library_only: bool, model_check: bool = True) -> dict[str, Any]:
    case = models.get_case(name)
    device = torch.device("cuda")
    torch.manual_seed(0)
    base = case.build(False).to(device).train()
    batches = models.make_batches(case, case.default_batch("train"), device, count=3)
    row: dict[str, Any] = {"model": name, "batch": case.default_batch("train")}
    with _env(EMBER_CACHE_DIR=str(cache), EMBER_TUNING="0"):
        torch._dynamo.reset()
        untuned, loss_u = _steps(copy.deepcopy(base), batches, case.loss, steps, warmup)
    db = TuningDB(cache / "tuning.sqlite")
    with _env(EMBER_CACHE_DIR=str(cache)):
        torch._dynamo.reset()
        inputs, target = batches[0]
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            groups, sites = collect_work(copy.deepcopy(base), tuple(inputs), True,
                                         loss=lambda out: case.loss(out, target))
        collect_s = time.perf_counter() - t0
        report = tune_groups([] if library_only else groups, db, cache / "kernels", budget, top=top,
                             progress=False, sites=sites)
        forget_open()
        check = None
        if model_check:
            with config.patch(tuning_db=str(db.path)):
                check = check_in_model(copy.deepcopy(base), tuple(inputs), True, "auto", db, device_key("cuda"),
                                       loss=lambda out: case.loss(out, target), precision=torch.bfloat16,
                                       budget_s=max(20.0, budget - report.seconds))
            print(check.line(), flush=True)
            forget_open()
        torch._dynamo.reset()
        tuned_in_use: list[int] = []
        with instrument(after=lambda stage, rec, art: tuned_in_use.append(len(rec.tuned)) if stage == "codegen" else None):
            tuned, loss_t = _steps(copy.deepcopy(base), batches, case.loss, steps, warmup)
        torch._dynamo.reset()
        t1 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            groups2, sites2 = collect_work(copy.deepcopy(base), tuple(inputs), True,
                                           loss=lambda out: case.loss(out, target))
        again = tune_groups([] if library_only else groups2, db, cache / "kernels", budget, top=top,
                            progress=False, sites=sites2)
        second_s = time.perf_counter() - t1
    gains = sorted((k for k in report.measured if k.gain), key=lambda k: -(k.gain or 0))
    library = [k for k in report.measured if k.kind == "library"]
    row.update({
        "untuned_ms": statistics.median(untuned), "tuned_ms": statistics.median(tuned),
        "speedup": statistics.median(untuned) / statistics.median(tuned),
        "first_loss_untuned": loss_u, "first_loss_tuned": loss_t,
        "loss_agrees": abs(loss_u - loss_t) <= 2e-2 * max(1.0, abs(loss_u)),
        "collect_s": collect_s, "tune_s": report.seconds, "kernels": len(report.kernels),
        "measured": len(report.measured), "skipped_budget": report.skipped,
        "incomplete": sum(k.incomplete for k in report.kernels),
        "candidates": sum(k.tried for k in report.measured), "rejected": sum(k.failed for k in report.measured),
        "errors": [k.error for k in report.kernels if k.error][:5],
        "rejected_why": [f"{r.kernel} {r.config}: {r.detail}" for k in report.measured
                         for r in db.results(k.kernel, device_key("cuda")) if r.failed][:10],
        "tuned_in_use": sum(tuned_in_use), "second_tune_s": second_s,
        "second_tune_measured": len(again.measured),
        "top_gains": [{"kernel": k.label, "default_ms": k.default_ms, "best_ms": k.best_ms, "config": k.best_config}
                      for k in gains[:8]],
        "model_check": None if check is None else {
            "line": check.line(), "kept": check.kept, "demoted": len(check.demoted), "seconds": check.seconds,
            "variants": {v.name: v.ms if v.ms is not None else v.error for v in check.variants}},
        "library_sites": len(sites), "library_measured": len(library),
        "library_not_rule": sum(bool(k.best_config) for k in library),
        "library": [{"site": k.label, "rule_ms": k.default_ms, "best_ms": k.best_ms,
                     "best": config_label(k.best_config) if k.best_config else "the rule", "tried": k.tried, "failed": k.failed}
                    for k in library],
    })
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet50,bert")
    parser.add_argument("--budget", type=float, default=240.0, help="tuning seconds per model")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=4, help="candidates timed per kernel")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--library-only", action="store_true", help="tune the library calls' implementations only")
    parser.add_argument("--no-model-check", action="store_true",
                        help="skip the whole-model check (the standalone choices are used as measured)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tune.py needs a CUDA device")
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        with tempfile.TemporaryDirectory(prefix=f"ember-tune-{name}-") as tmp:
            try:
                rows.append(run_model(name, args.budget, args.steps, args.warmup, Path(tmp), args.top,
                                      args.library_only, not args.no_model_check))
            except Exception as err:  # noqa: BLE001 - one model's failure is a row, not the end
                import traceback
                traceback.print_exc()
                rows.append({"model": name, "error": f"{type(err).__name__}: {err}"})
        print(json.dumps(rows[-1], default=str), flush=True)
    print(f"\n{describe('cuda')}")
    print(f"{'model':10s} {'untuned ms':>10s} {'tuned ms':>9s} {'speedup':>8s} {'tune s':>7s} "
          f"{'measured':>8s} {'in use':>6s} {'rejected':>8s} {'cut':>4s} {'2nd tune s':>10s} loss ok")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:10s} ERROR {r['error']}")
            continue
        print(f"{r['model']:10s} {r['untuned_ms']:10.2f} {r['tuned_ms']:9.2f} {r['speedup']:8.3f} {r['tune_s']:7.1f} "
              f"{r['measured']:8d} {r['tuned_in_use']:6d} {r['rejected']:8d} {r['incomplete'] + r['skipped_budget']:4d} "
              f"{r['second_tune_s']:10.1f} {r['loss_agrees']}")
    for r in rows:
        for site in r.get("library", []):
            print(f"  {r['model']:10s} {site['site'][:70]:70s} rule {site['rule_ms'] or 0:.4f} best "
                  f"{site['best_ms'] or 0:.4f} ms: {site['best']} ({site['failed']} of {site['tried']} rejected)")
    ok = [r["speedup"] for r in rows if "speedup" in r]
    if ok:
        print(f"geomean speedup tuned/untuned: {statistics.geometric_mean(ok):.3f}")
    if args.json:
        doc = {"date": dt.datetime.now().isoformat(), "device": describe("cuda"), "torch": torch.__version__,
               "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0 if all("error" not in r and r["loss_agrees"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
