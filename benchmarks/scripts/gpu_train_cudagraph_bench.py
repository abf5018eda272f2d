"""Training with CUDA graphs (the default): correctness vs eager and peak memory, on the device.

    PYTHONPATH=src python benchmarks/scripts/gpu_train_cudagraph_bench.py --json $OUT/train_cudagraph.json > log 2>&1

Rows (same initial weights, batches and RNG seed for every arm; SGD with momentum; the loop of
``ember bench --mode train``: forward under autocast, backward, step, zero_grad(set_to_none)):

- resnet18 fp32 (bs 8, 64x64), eager vs Ember with graphs vs Ember without graphs;
- bert (bert-base, seq 32, bs 8) bf16 with every dropout at 0: compared with eager;
- bert bf16 with dropout 0.1 (attention dropout too): Ember with graphs must capture both
  graphs, give finite losses that fall over the steps, and agree with eager statistically
  (the first loss, drawn before any dropout difference can matter, within bf16 noise);
- cyclegan bs1 and style_transfer bs4 (256x256) bf16, eager vs Ember with graphs.

Memory: torch.cuda.max_memory_allocated and max_memory_reserved over each arm's whole run
(compile, warm-up, capture, steady state), after empty_cache and reset_peak_memory_stats.
max_memory_allocated does not count a graph's memory pool beyond what its capture allocated
and still held (tensors handed out after replays lie on views the allocator does not track), so
reserved is the number that says how much of the GPU the run took.

Writes JSON (device, versions, date, commit) to --json PATH. Exit status 1 when a row fails.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ember
from ember.bench import models

_HERE = Path(__file__).resolve().parent


def _check_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_cudagraph_check", _HERE / "gpu_cudagraph_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _check_module()
MIB = 2**20


def bert_model(dropout: float) -> nn.Module:
    import transformers
    cfg = transformers.BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertForSequenceClassification(cfg)


def workload(name: str, batch: int, small: bool, count: int, dropout: float | None = None) -> Any:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    case = models.get_case(name)
    model = bert_model(dropout) if dropout is not None else case.build(small)
    batches = models.make_batches(case, batch, dev, small=small, count=count, seed=0)
    return check.Workload(model.to(dev).train(), batches, case.loss)


def train(w: Any, model: nn.Module, fn: Any, steps: int, amp: torch.dtype | None, seed: int = 1234) -> Any:
    """``ember bench --mode train``'s step: forward and loss under autocast, backward, SGD step,
    zero_grad(set_to_none=True); losses read after the step (nothing else kept across steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=check.LR, momentum=0.9)
    run = check.Run()
    torch.manual_seed(seed)
    for step in range(steps):
        inputs, target = w.batches[step % len(w.batches)]
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = w.loss(fn(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        del loss
    run.state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    torch.cuda.synchronize()
    run.whole_alloc = torch.cuda.max_memory_allocated() / MIB
    run.whole_reserved = torch.cuda.max_memory_reserved() / MIB
    # Steady state: three more steps after the cache is emptied and the peaks reset.
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for step in range(3):
        inputs, target = w.batches[step % len(w.batches)]
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = w.loss(fn(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()
    run.steady_alloc = torch.cuda.max_memory_allocated() / MIB
    run.steady_reserved = torch.cuda.max_memory_reserved() / MIB
    run.pool_mib = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                       if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)) / MIB
    return run


def run_arms(w: Any, arms: list[str], precision: str, steps: int) -> dict[str, Any]:
    amp = torch.bfloat16 if precision == "bf16" else None
    runs = {}
    for arm in arms:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        model = copy.deepcopy(w.model)
        torch.cuda.reset_peak_memory_stats()
        fn = model if arm == "eager" else ember.compile(model, cudagraphs=arm == "graphs")
        t0 = time.perf_counter()
        with check._ReplayCounter() as counter:
            run = train(w, model, fn, steps, amp)
        torch.cuda.synchronize()
        run.replays = counter.count
        run.seconds = time.perf_counter() - t0
        run.peak_alloc, run.peak_reserved = run.whole_alloc, run.whole_reserved
        if arm != "eager":
            run.statuses = check.statuses_of(fn)
        runs[arm] = run
        del model, fn
    return runs


def row_of(label: str, w: Any, arms: list[str], precision: str, steps: int, compare: bool) -> dict[str, Any]:
    initial = {k: v.detach().float().clone() for k, v in w.model.state_dict().items()}
    params = {n for n, _ in w.model.named_parameters()}
    runs = run_arms(w, arms, precision, steps)
    g = runs["graphs"]
    problems = []
    errors = {}
    if compare:
        errors["eager"] = check.compare(g, runs["eager"], initial, params)
        problems += check.problems_of(errors["eager"], check.TOL[precision]["eager"], "eager")
        if "no graphs" in runs:
            errors["graphs"] = check.compare(g, runs["no graphs"], initial, params)
            problems += check.problems_of(errors["graphs"], check.TOL[precision]["graphs"], "no graphs")
    if not g.statuses or not all(s.split(": ", 1)[1].startswith("captured") for s in g.statuses):
        problems.append("not every graph captured")
    if g.replays == 0:
        problems.append("no replay happened")
    return {"row": label, "precision": precision, "steps": steps, "ok": not problems, "problems": problems,
            "replays": g.replays, "statuses": g.statuses,
            "errors": {k: {kind: list(v) for kind, v in e.items()} for k, e in errors.items()},
            "losses": {a: r.losses for a, r in runs.items()}, "probes": {a: r.probes for a, r in runs.items()},
            "peak_alloc_mib": {a: round(r.peak_alloc, 1) for a, r in runs.items()},
            "peak_reserved_mib": {a: round(r.peak_reserved, 1) for a, r in runs.items()},
            "steady_alloc_mib": {a: round(r.steady_alloc, 1) for a, r in runs.items()},
            "steady_reserved_mib": {a: round(r.steady_reserved, 1) for a, r in runs.items()},
            "graph_pool_mib": {a: round(r.pool_mib, 1) for a, r in runs.items()},
            "seconds": {a: round(r.seconds, 1) for a, r in runs.items()}}


def dropout_row(steps: int) -> dict[str, Any]:
    """BERT with dropout 0.1 everywhere: captured, finite, falling, first loss near eager's."""
    w = workload("bert", 8, True, count=1, dropout=0.1)  # one batch, repeated: the loss must fall
    row = row_of("bert bf16 dropout 0.1", w, ["eager", "graphs"], "bf16", steps, compare=False)
    g, e = row["losses"]["graphs"], row["losses"]["eager"]
    if not all(math.isfinite(x) for x in g):
        row["problems"].append("non-finite loss")
    if not (sum(g[-3:]) / 3 < sum(g[:3]) / 3):
        row["problems"].append(f"loss did not fall: {g}")
    # Same seed: the replays must draw eager's dropout masks (a seed baked into the graph would
    # repeat one mask and drift from eager's losses by several percent).
    worst = max(abs(a - b) / abs(b) for a, b in zip(g, e))
    row["dropout_loss_rel_vs_eager"] = worst
    if worst > 1e-2:
        row["problems"].append(f"losses differ from eager's by {worst:.2e} (dropout masks not eager's?)")
    row["ok"] = not row["problems"]
    return row


def rows_plan(steps: int) -> list[tuple[str, Any]]:
    return [
        ("resnet18 fp32 bs8", lambda: row_of("resnet18 fp32 bs8", workload("resnet18", 8, True, steps + 2),
                                             ["eager", "graphs", "no graphs"], "fp32", steps, True)),
        ("cyclegan bf16 bs1", lambda: row_of("cyclegan bf16 bs1", workload("cyclegan", 1, False, steps + 2),
                                             ["eager", "graphs"], "bf16", steps, True)),
        ("style_transfer bf16 bs4", lambda: row_of("style_transfer bf16 bs4",
                                                   workload("style_transfer", 4, False, steps + 2),
                                                   ["eager", "graphs"], "bf16", steps, True)),
        ("bert bf16 bs8 dropout 0", lambda: row_of("bert bf16 bs8 dropout 0", workload("bert", 8, True, steps + 2, 0.0),
                                                   ["eager", "graphs"], "bf16", steps, True)),
        ("bert bf16 dropout 0.1", lambda: dropout_row(max(steps, 8))),
    ]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'row':<26}{'ok':<4}{'loss/eager':>11}{'upd/eager':>10}{'replays':>8}"
             f"{'alloc MiB eager/ember':>24}{'reserved MiB eager/ember':>27}{'steady alloc/reserved e|m':>34}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['row']:<26}ERROR {r['error'][:150]}")
            continue
        e = r.get("errors", {}).get("eager", {})
        a, v = r["peak_alloc_mib"], r["peak_reserved_mib"]
        lines.append(f"{r['row']:<26}{'yes' if r['ok'] else 'NO':<4}"
                     f"{e['loss'][0] if 'loss' in e else float('nan'):>11.1e}{e['update'][0] if 'update' in e else float('nan'):>10.1e}"
                     f"{r['replays']:>8}{a['eager']:>12.1f}/{a['graphs']:<11.1f}{v['eager']:>14.1f}/{v['graphs']:<12.1f}"
                     f"  {r['steady_alloc_mib']['eager']:.1f}/{r['steady_reserved_mib']['eager']:.1f} | "
                     f"{r['steady_alloc_mib']['graphs']:.1f}/{r['steady_reserved_mib']['graphs']:.1f}"
                     f" (pool {r['graph_pool_mib']['graphs']:.1f})")
        lines += [f"    PROBLEM {p}" for p in r["problems"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", default=None, help="row labels to run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    rows = []
    for label, make in rows_plan(args.steps):
        if args.only and label not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            row = make()
        except Exception as err:  # noqa: BLE001 - one failure must not hide the other rows
            row = {"row": label, "ok": False, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()}
            print(row["traceback"], flush=True)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(table([row]).split("\n", 1)[1], flush=True)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        save(args.json, rows)  # after every row: a run cut short keeps what it measured
    print()
    print(table(rows))
    for r in rows:
        for s in r.get("statuses", []):
            print(f"  {r['row']}: {s}")
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows)} rows, {failed} failing")
    return 1 if failed else 0


def save(path: str | None, rows: list[dict[str, Any]]) -> None:
    if not path:
        return
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=_HERE).stdout.strip()
    except OSError:
        commit = ""
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": getattr(__import__("triton"), "__version__", None), "ember": ember.__version__,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "commit": commit or os.environ.get("BENCH_COMMIT"), "command": " ".join(sys.argv),
            "env": {k: v for k, v in os.environ.items() if k.startswith("EMBER_")}}
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
