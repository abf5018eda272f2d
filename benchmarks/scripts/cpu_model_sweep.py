"""Ember against eager on a broad sweep of small models, each in its own process (CPU).

Models (``sweep_models.py``): torchvision, timm, transformers (tiny configs) and hand-written
modules with unusual ops, random weights, small inputs; ``--set core`` (default), ``wider`` or ``all``. Per model, in a fresh process with an empty ``EMBER_CACHE_DIR``:
1. training: one forward + backward with a fixed random cotangent through ``ember.compile``,
   against eager float32 and a float64 eager reference (a ``.double()`` deep copy). Ember passes
   where its error vs float64 is within ``ember.bench.check.acceptable`` (at most 4x eager's,
   or under 1e-5 relative) for every output, parameter gradient and floating buffer;
2. inference (eval mode, ``torch.no_grad()``): the same on two calls with different inputs;
3. a record: status (ok | mismatch | error | timeout | skipped), the worst tensor with Ember's
   and eager's errors, the exception with the frame in ``src/ember`` that raised it, wall time,
   and Ember's compile log (graphs, graph breaks, ops left to ATen, graphs that fell back).
Integer and bool outputs count the fraction of elements that differ. Dropout and stochastic
depth are off. ``EMBER_CPU_ATEN_FIRST=0`` makes the first calls run the generated CPU kernels,
not ATen while they compile (``--aten-first`` keeps Ember's default).

Run from the repository root:
    python benchmarks/scripts/cpu_model_sweep.py --json /tmp/sweep/default.json
    python benchmarks/scripts/cpu_model_sweep.py --only custom_data_branch,hf_gpt2 --target triton-interpret
    python benchmarks/scripts/cpu_model_sweep.py --set wider --json /tmp/sweep/wider.json
    python benchmarks/scripts/cpu_model_sweep.py --list
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from sweep_models import REGISTRY, Inputs, _register_all
from torch import nn

REPO = Path(__file__).resolve().parents[2]
FLOOR = 1e-5
LIVE: set[subprocess.Popen] = set()  # running worker processes


def _leaves(out: Any, prefix: str = "out") -> dict[str, torch.Tensor]:
    """The tensors of a model's output by path; a transformers output gives its logits."""
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        for key in ("logits", "logits_per_image", "last_hidden_state"):
            if out.get(key) is not None:
                return {f"{prefix}.{key}": out[key]}
    items = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, list | tuple) else []
    return {k: v for key, value in items for k, v in _leaves(value, f"{prefix}.{key}").items()}


def _cast(inputs: Inputs, double: bool) -> Inputs:
    c = lambda t: t.double() if double and isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(c(a) for a in inputs[0]), {k: c(v) for k, v in inputs[1].items()}


def _err(a: torch.Tensor | None, ref: torch.Tensor, floor: float = 1e-12) -> float:
    if a is None or a.shape != ref.shape:
        return float("inf")
    if not ref.is_floating_point():
        return (a != ref).double().mean().item() if ref.numel() else 0.0
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


def _train_step(model: nn.Module, fn: Callable, inputs: Inputs, double: bool) -> dict[str, torch.Tensor]:
    """Outputs, parameter gradients and floating buffers after one forward + backward."""
    model.train().zero_grad(set_to_none=True)
    args, kwargs = _cast(inputs, double)
    out = _leaves(fn(*args, **kwargs))
    terms = [(t * torch.randn(t.shape, generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
              .to(t.dtype)).sum() for i, t in enumerate(out.values()) if t.is_floating_point() and t.requires_grad]
    if terms:
        sum(terms).backward()
    got = {k: t.detach().clone() for k, t in out.items()}
    got.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    got.update({f"buffer {n}": b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
    return got


def _infer(model: nn.Module, fn: Callable, inputs: Inputs, double: bool) -> dict[str, torch.Tensor]:
    model.eval()
    args, kwargs = _cast(inputs, double)
    with torch.no_grad():
        return {k: t.clone() for k, t in _leaves(fn(*args, **kwargs)).items()}


def _compare(errors: dict[str, tuple[float, float, float]], prefix: str, got: dict, eager: dict,
             ref: dict | None) -> None:
    """errors[name] = (Ember's error, eager's error, floor) against float64; without a float64
    reference, Ember's against eager (float32 against float32) with a floor of 1e-3. A gradient's
    error is measured against the model's gradient scale where it is near zero (a conv bias before
    a norm: rounding noise; check.py's rule, 1e-6 of the largest gradient, 1e-4 without float64);
    a buffer's likewise (a batch norm's running mean of values whose batch mean is exactly zero);
    at least 1e-12, so that all-zero buffers (bart's ``final_logits_bias``) compare as equal."""
    base, floor = (ref, FLOOR) if ref is not None else (eager, 1e-3)
    floors = {}
    for kind in ("grad", "buffer"):
        scale = [t.double().norm().item() for k, t in base.items() if k.startswith(kind + " ")]
        floors[kind] = max((1e-6 if ref is not None else 1e-4) * max(scale), 1e-12) if scale else 1e-12
    for key, r in base.items():
        f = floors.get(key.split()[0], 1e-12)
        e = _err(eager.get(key), r, f) if ref is not None else 0.0
        errors[f"{prefix} {key}"] = (_err(got.get(key), r, f), e, floor)
    errors.update({f"{prefix} {key} (extra)": (float("inf"), 0.0, FLOOR) for key in set(got) - set(base)})


def _ember_frame(err: BaseException | None) -> str | None:
    """``file:line (function)`` of the innermost frame in src/ember over the exception's chain."""
    found = None
    while err is not None:
        for fr in traceback.extract_tb(err.__traceback__):
            if f"{os.sep}src{os.sep}ember{os.sep}" in fr.filename:
                found = f"{os.path.relpath(fr.filename, REPO)}:{fr.lineno} ({fr.name})"
        err = err.__cause__ or err.__context__
    return found


def _log_summary(compiled: Any, breaks: Any) -> dict[str, Any]:
    log = compiled._ember_backend.log
    return {"graphs": [f"{g.kind}:{g.frame}:{g.kernels}k" for g in log.graphs],
            "graph_errors": [f"{g.kind} {g.frame}: {g.error[:300]}" for g in log.graphs if g.error],
            "unlowered_ops": sorted({r.split(":")[0] for g in log.graphs for r in g.fallback_reasons
                                     if "no Ember lowering" in r}),
            "recompiles": log.recompiles[:5], "gave_up": log.gave_up[:5],
            "graph_breaks": {k[:160]: v for k, v in breaks.counts.most_common(6)}}


def run_case(name: str, target: str | None, seed: int) -> dict[str, Any]:
    """Eager, float64 and Ember runs of one registry model; the record described in the docstring."""
    import ember
    from ember.bench.check import _no_dropout, acceptable
    from ember.report.graph_breaks import collect_graph_breaks

    case = REGISTRY[name]
    rec: dict[str, Any] = {"name": name, "family": case.family, "status": "ok", "stage": "build", "notes": []}
    try:
        torch.manual_seed(seed)
        model = _no_dropout(case.build())
        for m in model.modules():  # Dropout2d and AlphaDropout are no nn.Dropout; nor is torchvision's StochasticDepth
            if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
                m.p = 0.0
        inputs = [case.make(torch.Generator().manual_seed(seed + i)) for i in range(3)]
        eager, ours = copy.deepcopy(model), copy.deepcopy(model)
        rec["stage"] = "eager"
        e_runs = [_train_step(eager, eager, inputs[0], False) if case.train else {}]
        e_runs += [_infer(eager, eager, x, False) for x in inputs[1:]]
    except Exception as err:  # noqa: BLE001 - not Ember's failure: the model is skipped
        rec.update(status="skipped", error=f"{type(err).__name__}: {str(err)[:300]}")
        return rec
    try:
        rmodel = copy.deepcopy(model).double()
        torch.set_default_dtype(torch.float64)  # tensors a forward creates (RAFT's coordinate grid) too
        r_runs: list[dict | None] = [_train_step(rmodel, rmodel, inputs[0], True) if case.train else {}]
        r_runs += [_infer(rmodel, rmodel, x, True) for x in inputs[1:]]
    except Exception as err:  # noqa: BLE001
        r_runs = [None] * 3
        rec["notes"].append(f"no float64 reference ({type(err).__name__}: {str(err)[:120]}); compared with eager")
    torch.set_default_dtype(torch.float32)
    errors: dict[str, tuple[float, float, float]] = {}
    compiled = None
    with collect_graph_breaks() as breaks:
        try:
            rec["stage"] = "ember-compile"
            compiled = ember.compile(ours, **({"target": target} if target else {}))
            for i, x in enumerate(inputs):
                if i == 0 and not case.train:
                    continue
                rec["stage"] = "ember-train" if i == 0 else f"ember-infer{i}"
                got = _train_step(ours, compiled, x, False) if i == 0 else _infer(ours, compiled, x, False)
                _compare(errors, "train" if i == 0 else f"infer{i}", got, e_runs[i], r_runs[i])
            rec["stage"] = "done"
        except Exception as err:  # noqa: BLE001 - the record says what and where
            rec.update(status="error", error=f"{type(err).__name__}: {str(err)[:600]}", ember_frame=_ember_frame(err),
                       traceback="".join(traceback.format_exception(err))[-2500:])
    if compiled is not None:
        try:
            rec["ember"] = _log_summary(compiled, breaks)
        except Exception as err:  # noqa: BLE001 - the log is a bonus
            rec["notes"].append(f"no compile log: {err}")
    bad = {k: v for k, v in errors.items() if not acceptable(*v)}
    pool = bad or errors
    if pool:
        worst = max(pool, key=lambda k: pool[k][0] / max(4 * pool[k][1], pool[k][2]))
        rec["worst"] = {"name": worst, "ember": pool[worst][0], "eager": pool[worst][1]}
    rec.update(n_checked=len(errors), params=sum(p.numel() for p in model.parameters()), bad={k: v[:2] for k, v in sorted(bad.items(), key=lambda kv: -kv[1][0])[:8]})
    if bad and rec["status"] == "ok":
        rec["status"] = "mismatch"
    return rec


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one model in a fresh process with an empty Ember cache; never raises."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-sweep-") as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, EMBER_CACHE_DIR=str(Path(tmp) / "cache"), EMBER_PROGRESS="0",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p))
        env.update(({} if args.aten_first else {"EMBER_CPU_ATEN_FIRST": "0"}) | ({"EMBER_STRICT": "1"} if args.strict else {}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
               "--seed", str(args.seed)] + (["--target", args.target] if args.target else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, cwd=REPO)
        LIVE.add(proc)
        try:
            _, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and its compile workers
            proc.communicate()
            return {"name": name, "family": REGISTRY[name].family, "status": "timeout",
                    "error": f"over {args.timeout} s", "seconds": time.perf_counter() - start}
        finally:
            LIVE.discard(proc)
        rec = json.loads(result.read_text()) if result.exists() else {
            "name": name, "family": REGISTRY[name].family, "status": "error",
            "error": f"worker exited with {proc.returncode} and no result", "traceback": stderr[-2500:]}
    rec["seconds"] = time.perf_counter() - start
    return rec


def print_table(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Ember vs eager (errors relative to float64 eager)")
    for col in ("model", "status", "s", "worst", "ember", "eager", "graphs/breaks", "detail"):
        table.add_column(col, overflow="fold")
    style = {"ok": "green", "mismatch": "red", "error": "red", "timeout": "yellow", "skipped": "dim"}
    for r in records:
        w, em = r.get("worst") or {}, r.get("ember") or {}
        detail = r.get("error") or "; ".join(em.get("graph_errors", [])[:1]) or ""
        if r.get("ember_frame"):
            detail += f" @ {r['ember_frame']}"
        breaks = sum((em.get("graph_breaks") or {}).values())
        table.add_row(r["name"], f"[{style.get(r['status'], '')}]{r['status']}", f"{r.get('seconds', 0):.0f}",
                      w.get("name", "") if r["status"] != "ok" else "", *(f"{w[k]:.2e}" if k in w else "-" for k in ("ember", "eager")),
                      f"{len(em.get('graphs', []))}/{breaks}" if em else "", detail[:160])
    Console(width=200).print(table)
    print("  ".join(f"{k}: {v}" for k, v in sorted(Counter(r["status"] for r in records).items())))
    fell_back = [r["name"] for r in records if (r.get("ember") or {}).get("graph_errors")]
    print(f"graphs Ember could not compile (run through ATen as captured) in: {', '.join(fell_back) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run the sweep, or one model as the worker process."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated model names (see --list)")
    p.add_argument("--family", choices=("torchvision", "timm", "transformers", "custom"))
    p.add_argument("--set", choices=("core", "wider", "all"), default="core",
                   help="core: the first sweeps' 68 models; wider: further ones (default core)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model (default 300)")
    p.add_argument("--json", type=Path, help="write the records here (rewritten after each model)")
    p.add_argument("--jobs", type=int, default=1, help="models run at once (default 1)")
    p.add_argument("--target", help="ember.compile(target=...); default: Ember's default target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="EMBER_STRICT=1: internal compile errors raise")
    p.add_argument("--aten-first", action="store_true", help="keep EMBER_CPU_ATEN_FIRST at its default")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stopped sweep takes its running workers along
        signal.signal(sig, lambda *_: ([os.killpg(q.pid, signal.SIGKILL) for q in LIVE], os._exit(130)))
    _register_all()
    if args.worker:
        args.result.write_text(json.dumps(run_case(args.worker, args.target, args.seed), default=str))
        return 0
    names = [n for n, c in REGISTRY.items() if args.family in (None, c.family) and args.set in ("all", c.group)]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        if unknown := [n for n in wanted if n not in REGISTRY]:
            p.error(f"unknown model(s) {unknown}; see --list")
        names = [n for n in wanted if args.family in (None, REGISTRY[n].family)]
    if args.list:
        print("\n".join(f"{n}  ({REGISTRY[n].family})" for n in names))
        return 0
    records: list[dict[str, Any]] = []
    meta = {"target": args.target or "default", "seed": args.seed, "torch": torch.__version__, "set": args.set,
            "aten_first": args.aten_first, "strict": args.strict}
    for rec in ThreadPoolExecutor(max_workers=max(1, args.jobs)).map(lambda n: run_one(n, args), names):
        records.append(rec)
        print(f"[{len(records)}/{len(names)}] {rec['name']}: {rec['status']} ({rec.get('seconds', 0):.0f} s)"
              + (f" {rec.get('error', '')[:150]}" if rec["status"] != "ok" else ""), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "results": records}, indent=1, default=str))
    print_table(records)
    return 1 if any(r["status"] in ("mismatch", "error", "timeout") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
