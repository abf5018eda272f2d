"""CUDA-graph replay is correct, for inference and training: run on the device after any change
to runtime/cudagraphs/runner.py (from the repo root).

    PYTHONPATH=src python benchmarks/scripts/gpu_cudagraph_check.py                # everything (~5 min on an H100)
    PYTHONPATH=src python benchmarks/scripts/gpu_cudagraph_check.py --only train   # or: --only infer

Training: resnet18 (batch norm in train mode: running statistics written every step),
tiny_transformer (2-layer BERT in train mode, dropout 0.1 on), a small conv net (batch norm,
dropout) and six blocks with a graph break after each (``layer_breaks``: one frame's graphs run
six times a step, one CUDA graph per call). The same initial weights and batches go through eager, Ember with CUDA graphs and
Ember without them (same programs, uncaptured), SGD with momentum, from the same RNG seed:

- plain: each step a forward/backward and an optimizer step, then a forward whose backward never
  runs; fp32 (TF32 off) and bf16 autocast;
- accumulate: two forward/backward per optimizer step (gradients accumulate into .grad);
- together: two forwards, then one backward through both (saved activations of the first
  forward must survive the second).

Each Ember run must match eager (loss every step, every parameter's value and update and every
buffer at the end, within the precision's tolerance) and Ember without graphs (tighter), every
graph's status must say "captured" and replays must have happened. A last row forces a capture
to fail and checks the process still runs (uncaptured, random ops working). Inference (resnet18,
tiny_transformer, bert): five calls under bf16 autocast vs eager, an early output unchanged by
later replays, an in-place parameter update seen.

Prints a table; writes JSON to --json PATH, or to $OUT/cudagraph_check.json when OUT is set.
Exit status 1 when any check fails. Send the output to a file (``> log 2>&1``), not a pipe: the
compiler's worker processes keep a pipe open, so a run killed by a timeout shows nothing.

State on the H100 (torch 2.11), before the shared memory pool: convnet and resnet18 rows captured
forward and backward and agreed with Ember without graphs bit for bit; tiny_transformer rows
failed "not every graph captured" while attention with dropout was refused. Attention dropout
is now allowed; benchmarks/scripts/gpu_train_cudagraph_bench.py checks it (BERT with dropout 0.1).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import ember
from ember import config
from ember.bench import models
from ember.runtime.cudagraphs import runner as cudagraph

TRAIN_MODELS = ["resnet18", "tiny_transformer", "convnet", "layer_breaks"]
LR = 1e-3
INFER_MODELS = ["resnet18", "tiny_transformer", "bert"]
# Relative errors (norm of the difference / norm of the reference), param_abs absolute. "eager":
# Ember vs eager; "graphs": Ember with graphs vs without (the same programs: on the H100 they
# agree bit for bit, 0.0, in every plain row).
TOL = {
    # vs eager: the brief's "losses and parameter values match"; updates are reported only (a
    # bias in front of batch norm has a gradient of pure rounding noise, so its update differs
    # in relative terms between any two correct implementations).
    "fp32": {"eager": {"loss": 1e-4, "param_abs": 5e-5, "buffer": 1e-3},
             "graphs": {"loss": 1e-5, "param_abs": 1e-6, "update": 1e-4, "buffer": 1e-5}},
    "bf16": {"eager": {"loss": 3e-2, "param_abs": 1e-3, "buffer": 5e-2},
             "graphs": {"loss": 1e-3, "param_abs": 1e-5, "update": 1e-2, "buffer": 1e-3}},
}



def small_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.norm, self.drop = nn.Linear(d, d), nn.LayerNorm(d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(nn.functional.gelu(self.fc(x))))


class LayerBreaks(nn.Module):
    """Six blocks, a graph break after each: one compiled frame serves every block, so its
    forward and backward graphs run six times a step (one CUDA graph per call of a step)."""

    def __init__(self, d: int = 64, layers: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return self.head(x.mean(1))


@dataclass
class Workload:
    model: nn.Module  # fp32, on the device, train mode
    batches: list[tuple[tuple, torch.Tensor]]  # (inputs, target), on the device
    loss: Callable[[Any, torch.Tensor], torch.Tensor]


def workload(name: str, device: str, count: int, batch: int = 8, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    dev = torch.device(device)
    if name == "convnet":
        gen = torch.Generator().manual_seed(seed)
        batches = [((torch.randn(batch, 3, 32, 32, generator=gen).to(dev),),
                    torch.randint(0, 10, (batch,), generator=gen).to(dev)) for _ in range(count)]
        return Workload(small_convnet().to(dev).train(), batches,
                        lambda out, y: nn.functional.cross_entropy(out, y))
    if name == "layer_breaks":
        gen = torch.Generator().manual_seed(seed)
        batches = [((torch.randn(batch, 16, 64, generator=gen).to(dev),),
                    torch.randint(0, 10, (batch,), generator=gen).to(dev)) for _ in range(count)]
        return Workload(LayerBreaks().to(dev).train(), batches, lambda out, y: nn.functional.cross_entropy(out, y))
    case = models.get_case(name)
    model = case.build(True).to(dev).train()  # BERT: dropout 0.1 stays on
    return Workload(model, models.make_batches(case, batch, dev, small=True, count=count, seed=seed), case.loss)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    probes: list[float] = field(default_factory=list)  # forwards whose backward never runs
    step_ms: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    statuses: list[str] = field(default_factory=list)
    replays: int = 0
    peak_mib: float = 0.0


def train(w: Workload, model: nn.Module, fn: Callable, mode: str, steps: int, amp: torch.dtype | None,
          device: str, timed: int = 0, seed: int = 1234) -> Run:
    """``steps`` optimizer steps of ``mode`` (plain | accumulate | together), then ``timed`` more
    plain steps that are only timed."""
    # A small step: a random-label model trained hard diverges, and divergence amplifies
    # rounding differences until they say nothing about correctness.
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    run = Run()
    dev_type = torch.device(device).type
    per_step = 2 if mode in ("accumulate", "together") else 1
    torch.manual_seed(seed)  # dropout draws the same numbers in every run

    def loss_of(inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev_type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            return w.loss(fn(*inputs), target)

    for step in range(steps + timed):
        start = time.perf_counter()
        chunk = [w.batches[(step * per_step + k) % len(w.batches)] for k in range(per_step)]
        losses = []
        if step >= steps or mode == "plain":
            losses.append(loss_of(*chunk[0]))
            losses[-1].backward()
        elif mode == "accumulate":
            for inputs, target in chunk:
                losses.append(loss_of(inputs, target) / per_step)
                losses[-1].backward()  # the second backward adds into .grad
        else:  # together
            losses.append(sum(loss_of(inputs, target) for inputs, target in chunk))
            losses[-1].backward()
        opt.step()
        opt.zero_grad()
        if step < steps:
            run.losses += [loss.item() for loss in losses]
            if mode == "plain":  # a forward with grad whose backward never runs
                run.probes.append(loss_of(*w.batches[(step + 1) % len(w.batches)]).item())
        else:
            if device != "cpu":
                torch.cuda.synchronize()
            run.step_ms.append((time.perf_counter() - start) * 1e3)
        if step == steps - 1:
            run.state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def compare(run: Run, ref: Run, initial: dict[str, torch.Tensor], params: set[str]) -> dict[str, tuple[float, str]]:
    """Worst relative error of each kind, with where it is: loss (every step and probe), param
    (parameter values at the end; param_abs: the largest absolute difference of one value,
    meaningful for biases that start at zero), update (each parameter's change from ``initial``: what
    training did, not the weights it started from; far more sensitive) and buffer (running
    statistics and other state)."""
    out: dict[str, tuple[float, str]] = {}
    got, want = run.losses + run.probes, ref.losses + ref.probes
    out["loss"] = max(((rel(torch.tensor(g), torch.tensor(x)), f"loss {i}") for i, (g, x) in enumerate(zip(got, want))),
                      default=(float("nan"), "no losses"))
    if len(got) != len(want):
        out["loss"] = (float("inf"), f"{len(got)} losses vs {len(want)}")
    updates, values, buffers, biggest = [], [], [], []
    for name, value in ref.state.items():
        mine = run.state.get(name)
        if mine is None or mine.shape != value.shape:
            updates.append((float("inf"), f"{name} missing"))
        elif name in params:
            values.append((rel(mine, value), name))
            biggest.append(((mine.double() - value.double()).abs().max().item(), name))
            # A bias in front of batch norm gets only rounding noise as its gradient: measure
            # updates against at least 1e-4 of the weight they were applied to.
            ref_update, start = (value - initial[name]).double(), initial[name].double()
            scale = max(ref_update.norm().item(), 1e-4 * start.norm().item(), 1e-12)
            updates.append((((mine - initial[name]).double() - ref_update).norm().item() / scale, name))
        elif value.is_floating_point():
            buffers.append((rel(mine, value), name))
        elif not torch.equal(mine, value):  # e.g. num_batches_tracked
            buffers.append((float("inf"), name))
    out["param"] = max(values, default=(0.0, ""))
    out["param_abs"] = max(biggest, default=(0.0, ""))
    out["update"] = max(updates, default=(0.0, ""))
    out["buffer"] = max(buffers, default=(0.0, ""))
    return out


def problems_of(errors: dict[str, tuple[float, str]], tol: dict[str, float], against: str) -> list[str]:
    bad = []
    for kind, limit in tol.items():
        err, where = errors.get(kind, (float("inf"), "not compared"))
        if not err <= limit:  # NaN fails too
            bad.append(f"{kind} vs {against}: {err:.2e} > {limit:.0e} ({where})")
    return bad


def statuses_of(compiled: nn.Module) -> list[str]:
    return [f"{g.title}: {g.cudagraph}" for g in compiled._ember_backend.log.graphs]


class _ReplayCounter:
    """Counts the graph replays of every CudaGraphRunner while active."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = cudagraph.CudaGraphRunner._replay

    def __enter__(self) -> _ReplayCounter:
        orig = self._orig

        def replay(runner: cudagraph.CudaGraphRunner, args: list) -> object:
            self.count += 1
            return orig(runner, args)
        cudagraph.CudaGraphRunner._replay = replay  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        cudagraph.CudaGraphRunner._replay = self._orig  # type: ignore[method-assign]


def check_training(name: str, precision: str, mode: str, device: str = "cuda", steps: int = 4,
                   timed: int = 0, graphs_off: bool = True,
                   compile_fn: Callable[..., nn.Module] = ember.compile) -> dict:
    """One row: eager vs Ember with graphs (vs Ember without, when ``graphs_off``)."""
    amp = torch.bfloat16 if precision == "bf16" else None
    per_step = 2 if mode != "plain" else 1
    w = workload(name, device, count=max(3, (steps + timed) * per_step + 1))
    initial = {k: v.detach().float().clone() for k, v in w.model.state_dict().items()}
    params = {n for n, _ in w.model.named_parameters()}
    runs: dict[str, Run] = {}
    arms = ["eager", "graphs"] + (["no graphs"] if graphs_off else [])
    for arm in arms:
        torch._dynamo.reset()
        model = copy.deepcopy(w.model)
        fn = model if arm == "eager" else compile_fn(model, cudagraphs=arm == "graphs")
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        with _ReplayCounter() as counter:
            run = train(w, model, fn, mode, steps, amp, device, timed=timed)
        run.replays = counter.count
        if arm != "eager":
            run.statuses = statuses_of(fn)
        if device != "cpu":
            run.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        runs[arm] = run
    row: dict[str, Any] = {"model": name, "precision": precision, "mode": mode, "steps": steps}
    errors = {"eager": compare(runs["graphs"], runs["eager"], initial, params)}
    problems = problems_of(errors["eager"], TOL[precision]["eager"], "eager")
    if graphs_off:
        errors["graphs"] = compare(runs["graphs"], runs["no graphs"], initial, params)
        problems += problems_of(errors["graphs"], TOL[precision]["graphs"], "no graphs")
    statuses = runs["graphs"].statuses
    if not statuses or not all(s.split(": ", 1)[1].startswith("captured") for s in statuses):
        problems.append("not every graph captured")
    if runs["graphs"].replays == 0:
        problems.append("no replay happened")
    row.update(ok=not problems, problems=problems, replays=runs["graphs"].replays, statuses=statuses,
               errors={k: {kind: list(v) for kind, v in e.items()} for k, e in errors.items()},
               losses={arm: r.losses for arm, r in runs.items()},
               peak_mib={arm: round(r.peak_mib, 1) for arm, r in runs.items()},
               step_ms={arm: statistics.median(r.step_ms) for arm, r in runs.items() if r.step_ms})
    return row


def check_inference(name: str) -> dict:
    problems = []
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(True).cuda().eval()
    compiled = ember.compile(model)
    batches = models.make_batches(case, 2, torch.device("cuda"), small=True, count=5)
    kept, kept_value = None, None
    with _ReplayCounter() as counter:
        for i, (inputs, _t) in enumerate(batches):
            if i == 3:  # parameters change in place: the graph must read the new values
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.9)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                want = models.primary_tensor(model(*inputs))
                got = models.primary_tensor(compiled(*inputs))
            err = rel(got, want)
            if not err < 2e-2:
                problems.append(f"call {i}: relative error {err:.2e}")
            if i == 1:
                kept, kept_value = got, got.clone()
    if not torch.equal(kept, kept_value):
        problems.append("an output kept from the second call changed after later replays")
    statuses = statuses_of(compiled)
    if not any(s.split(": ", 1)[1].startswith("captured") for s in statuses):
        problems.append("no graph captured")
    if counter.count == 0:
        problems.append("no replay happened")
    return {"model": name, "precision": "bf16", "mode": "infer", "ok": not problems, "problems": problems,
            "replays": counter.count, "statuses": statuses}


def check_recovery() -> dict:
    """A capture that fails (a host sync inside) must leave the process working: the program
    runs uncaptured with the reason, and random ops outside a capture still work after it."""
    x = torch.randn(64, device="cuda")

    def program(args: list) -> tuple:
        (a,) = args
        args.clear()
        return (a * float(a.sum().item()),)  # .item() cannot be captured

    runner = cudagraph.CudaGraphRunner(program, "recovery")
    problems = []
    for _ in range(3):
        got = runner([x])[0]
        if not torch.allclose(got, x * x.sum()):
            problems.append("wrong result after the failed capture")
    if not runner.status.startswith("not captured: capture failed"):
        problems.append(f"status: {runner.status}")
    try:
        nn.functional.dropout(x, 0.5, True)
    except RuntimeError as err:
        problems.append(f"dropout after a failed capture: {err}")
    return {"model": "recovery", "precision": "fp32", "mode": "failure", "ok": not problems, "problems": problems,
            "statuses": [runner.status]}


def plan(only: str | None, train_models: list[str], infer_models: list[str]) -> list[tuple[str, str, str]]:
    """(model, precision, mode) of every row, in order."""
    rows = []
    if only in (None, "train"):
        for name in train_models:
            rows += [(name, "fp32", "plain"), (name, "bf16", "plain"), (name, "fp32", "accumulate"),
                     (name, "fp32", "together")]
    if only in (None, "infer"):
        rows += [(name, "bf16", "infer") for name in infer_models]
    return rows + [("recovery", "fp32", "failure")]


def table(rows: list[dict]) -> str:
    head = (f"{'model':<17}{'prec':<6}{'mode':<11}{'ok':<4}{'loss/eager':>11}{'|dp|eager':>10}{'upd/eager':>10}"
            f"{'loss/nog':>10}{'upd/nog':>10}{'replays':>8}{'ms eager/nog/graphs':>22}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<17}{r['precision']:<6}{r['mode']:<11}ERROR {r['error'][:120]}")
            continue
        e = r.get("errors", {})
        ms = r.get("step_ms", {})
        times = "/".join(f"{ms[a]:.1f}" for a in ("eager", "no graphs", "graphs") if a in ms) or "-"
        lines.append(f"{r['model']:<17}{r['precision']:<6}{r['mode']:<11}{'yes' if r['ok'] else 'NO':<4}"
                     f"{_cell(e, 'eager', 'loss', 11)}{_cell(e, 'eager', 'param_abs', 10)}{_cell(e, 'eager', 'update', 10)}"
                     f"{_cell(e, 'graphs', 'loss', 10)}{_cell(e, 'graphs', 'update', 10)}"
                     f"{r.get('replays', 0):>8}{times:>22}")
        lines += [f"    PROBLEM {p}" for p in r.get("problems", [])]
    return "\n".join(lines)


def _cell(errors: dict, against: str, kind: str, width: int) -> str:
    v = errors.get(against, {}).get(kind)
    return f"{v[0]:>{width}.1e}" if v else f"{'-':>{width}}"


def output_path(arg: str | None) -> str | None:
    if arg:
        return arg
    out = os.environ.get("OUT")
    return os.path.join(out, "cudagraph_check.json") if out else None


# Training capture is the default (EMBER_CUDAGRAPHS_TRAINING=0 turns it off); this script checks it.
@config.patch(cudagraphs_training=True)
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["train", "infer"], default=None)
    parser.add_argument("--train-models", nargs="*", default=TRAIN_MODELS)
    parser.add_argument("--infer-models", nargs="*", default=INFER_MODELS)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps compared (graphs from the 2nd call)")
    parser.add_argument("--timed", type=int, default=10, help="extra plain steps timed after the compared ones")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    # fp32 means fp32: no TF32, deterministic cuDNN, so eager and Ember can agree tightly.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    rows = []
    for name, precision, mode in plan(args.only, args.train_models, args.infer_models):
        t0 = time.perf_counter()
        try:
            if mode == "failure":
                row = check_recovery()
            elif mode == "infer":
                row = check_inference(name)
            else:
                row = check_training(name, precision, mode, steps=args.steps,
                                     timed=args.timed if mode == "plain" else 0, graphs_off=mode == "plain")
        except Exception as err:  # noqa: BLE001 - one failure must not hide the other rows
            row = {"model": name, "precision": precision, "mode": mode, "ok": False,
                   "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print("\n".join(table([row]).splitlines()[1:]), flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print()
    print(table(rows))
    for r in rows:
        for s in r.get("statuses", [])[:4]:
            print(f"  {r['model']} {r['precision']} {r['mode']}: {s}")
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows)} rows, {failed} failing")
    path = output_path(args.json)
    if path:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ember": ember.__version__,
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                "tolerances": TOL}
        with open(path, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1, default=str)
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
