"""Whole-step training programs on a GPU: correctness against eager, then timing.

    PYTHONPATH=src python benchmarks/scripts/gpu_whole_step.py                 # everything
    PYTHONPATH=src python benchmarks/scripts/gpu_whole_step.py --part checks   # ~1-2 min
    PYTHONPATH=src python benchmarks/scripts/gpu_whole_step.py --part resnet50 # ~4 min (Inductor compiles)
    PYTHONPATH=src python benchmarks/scripts/gpu_whole_step.py --part bert     # ~4 min

checks: 20 steps (fp32, TF32 off) of a small conv net / MLP with ember.compile_step against the
eager loop from identical weights on the same batches: SGD (momentum, nesterov, weight decay),
Adam, AdamW, AdamW + StepLR (tensor lr), SGD + StepLR (float lr: recaptured), fused SGD +
OneCycleLR, fused Adam + GradScaler fp16 with inf batches (skipped steps), default SGD and default
AdamW + GradScaler, accumulate=3 with clipping. Prints max |param difference|, the step's status line and how many calls replayed.

timing: resnet50 bs128 and BERT-base bs64 seq128 (input_ids and labels only), bf16 autocast, SGD
momentum: eager; Ember per-graph (ember.compile(model), per-graph CUDA graphs); Ember whole-step
(ember.compile_step); torch.compile(mode="reduce-overhead") with the optimizer step compiled too
(PyTorch's compiled-optimizer recipe). 10 warm-up steps (the first is timed as compile), 30 timed,
host wall clock after torch.cuda.synchronize() each step, median and min ms, peak reserved MiB.
Each part in try/except: an error is printed and recorded, the rest goes on. JSON to
$OUT/whole_step.json (or --json).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
import ember  # noqa: E402

DEV = "cuda"
RESULTS: dict = {"checks": {}, "timing": {}, "errors": {}}


def log(msg: str) -> None:
    print(msg, flush=True)


# -- correctness ----------------------------------------------------------------------------------


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.c1(x)))
        return self.fc(F.relu(self.c2(x)).mean((2, 3)))


def run_check(name: str, make_opt, sched=None, scaler_fp16: bool = False, accumulate: int = 1,
              clip: float | None = None, steps: int = 20, inf_steps: tuple = (), tol: float = 1e-3) -> None:
    torch.manual_seed(0)
    model = ConvNet().to(DEV)
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    sch = sched(opt) if sched else None
    ref_sch = sched(ref_opt) if sched else None
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14, growth_interval=5) if scaler_fp16 else None
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14, growth_interval=5) if scaler_fp16 else None

    def loss_fn(m, x, y):
        if scaler_fp16:
            with torch.autocast("cuda", dtype=torch.float16):
                return F.cross_entropy(m(x), y)
        return F.cross_entropy(m(x), y)

    step = ember.compile_step(lambda x, y: loss_fn(model, x, y), opt, model=model, scaler=scaler,
                              clip_grad_norm=clip, accumulate=accumulate)
    worst, worst_loss, skipped_ok = 0.0, 0.0, True
    for i in range(steps):
        ref_opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(accumulate):
            x = torch.randn(8, 3, 16, 16, device=DEV)
            y = torch.randint(0, 10, (8,), device=DEV)
            if i in inf_steps:
                x[0, 0, 0, 0] = float("inf")
            loss = step(x, y)
            want = loss_fn(ref, x, y)
            scaled = want / accumulate if accumulate > 1 else want
            (ref_scaler.scale(scaled) if ref_scaler else scaled).backward()
            if torch.isfinite(want):
                worst_loss = max(worst_loss, abs(float(loss) - float(want)))
        if clip is not None:
            if ref_scaler:
                ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
        if ref_scaler:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        else:
            ref_opt.step()
        if sch:
            sch.step()
            ref_sch.step()
        if i in inf_steps:
            skipped_ok &= all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        worst = max(worst, max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())))
    torch.cuda.synchronize()
    backend = getattr(step.compiled_fn, "_ember_backend", None)
    warm = [line[:160] for line in backend.log.warm_start] if backend is not None else []
    ok = worst < tol and skipped_ok and (not scaler or scaler.get_scale() == ref_scaler.get_scale())
    RESULTS["checks"][name] = {"max_param_diff": worst, "max_loss_diff": worst_loss, "ok": ok,
                               "skipped_steps_ok": skipped_ok, "status": step.status,
                               "replayed_calls": step.captured_calls, "calls": step.calls,
                               "uncaptured": dict(step.uncaptured), "warm_start": warm}
    log(f"{'PASS' if ok else 'FAIL'} {name:34s} max|dp| {worst:.2e} max|dloss| {worst_loss:.2e} "
        f"replayed {step.captured_calls}/{step.calls}\n     {step.status}\n     warm start: {'; '.join(warm)}")


def checks() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = {
        "sgd_momentum_nesterov_wd": dict(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                                             nesterov=True, weight_decay=1e-3)),
        "adam": dict(make_opt=lambda ps: torch.optim.Adam(ps, lr=1e-3)),
        "adamw": dict(make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)),
        "adamw_steplr_tensor_lr": dict(make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                       sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5)),
        "sgd_steplr_recapture": dict(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                     sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 12, 0.5)),
        "sgd_fused_onecycle": dict(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
                                   sched=lambda o: torch.optim.lr_scheduler.OneCycleLR(
                                       o, max_lr=0.1, total_steps=40, cycle_momentum=False)),
        "adam_fused_gradscaler_fp16_inf": dict(make_opt=lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
                                               scaler_fp16=True, clip=1.0, inf_steps=(6, 7, 15),
                                               tol=5e-3),
        # A default (foreach) SGD or AdamW with GradScaler: captured as torch's fused optimizer
        # (setting fused_optimizers), uncaptured with EMBER_FUSED_OPTIMIZERS=0 (scaler.step checks
        # for inf on the host).
        "sgd_gradscaler": dict(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                               scaler_fp16=True, inf_steps=(6,), tol=5e-3),
        "adamw_gradscaler": dict(make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
                                 scaler_fp16=True, inf_steps=(6, 11), tol=5e-3),
        "adamw_accumulate3_clip": dict(make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3), accumulate=3, clip=0.5),
    }
    for name, kw in cases.items():
        try:
            torch._dynamo.reset()
            run_check(name, **kw)
        except Exception as err:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            RESULTS["errors"][f"check {name}"] = f"{type(err).__name__}: {err}"
            log(f"ERROR {name}: {type(err).__name__}: {err}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


# -- timing ---------------------------------------------------------------------------------------


def make_case(name: str):
    """(model factory, batches, loss(model, *batch))."""
    if name == "resnet50":
        import torchvision
        batches = [(torch.randn(128, 3, 224, 224, device=DEV), torch.randint(0, 1000, (128,), device=DEV))
                   for _ in range(3)]
        return (lambda: torchvision.models.resnet50().to(DEV), batches,
                lambda m, x, y: F.cross_entropy(m(x), y))
    from transformers import BertConfig, BertForSequenceClassification
    batches = [(torch.randint(0, 30522, (64, 128), device=DEV), torch.randint(0, 2, (64,), device=DEV))
               for _ in range(3)]
    return (lambda: BertForSequenceClassification(BertConfig()).to(DEV), batches,
            lambda m, ids, y: m(input_ids=ids, labels=y).loss)


def time_loop(step_fn, batches, warmup: int = 10, timed: int = 30) -> dict:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step_fn(*batches[0])
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for i in range(1, warmup):
        step_fn(*batches[i % len(batches)])
    torch.cuda.synchronize()
    times = []
    for i in range(timed):
        start = time.perf_counter()
        step_fn(*batches[i % len(batches)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"first_call_s": first, "median_ms": statistics.median(times), "min_ms": min(times)}


def timing(case: str) -> None:
    make_model, batches, loss_fn = make_case(case)
    out = RESULTS["timing"].setdefault(case, {})

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def configs():
        def eager():
            m = make_model()
            opt = sgd(m)

            def step(*b):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(m, *b)
                loss.backward()
                opt.step()
            return step, None

        def ember_per_graph():
            m = make_model()
            cm = ember.compile(m)
            opt = sgd(m)

            def step(*b):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(cm, *b)
                loss.backward()
                opt.step()
            return step, None

        def ember_whole_step():
            m = make_model()
            opt = sgd(m)

            def train_fn(*b):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return loss_fn(m, *b)
            s = ember.compile_step(train_fn, opt, model=m)
            return s, s

        def inductor_ro_compiled_opt():
            m = make_model()
            cm = torch.compile(m, mode="reduce-overhead")
            opt = sgd(m)

            @torch.compile(fullgraph=False)
            def opt_step():
                opt.step()

            def step(*b):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(cm, *b)
                loss.backward()
                opt_step()
            return step, None
        return {"eager": eager, "ember_per_graph": ember_per_graph, "ember_whole_step": ember_whole_step,
                "inductor_reduce_overhead+compiled_opt": inductor_ro_compiled_opt}

    for name, build in configs().items():
        try:
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step, whole = build()
            row = time_loop(step, batches)
            row["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2 ** 20
            if whole is not None:
                row["status"] = whole.status
                row["replayed_calls"] = whole.captured_calls
                row["uncaptured"] = dict(whole.uncaptured)
            out[name] = row
            log(f"{case:9s} {name:40s} median {row['median_ms']:8.2f} ms  min {row['min_ms']:8.2f}  "
                f"first {row['first_call_s']:6.1f} s  peak {row['peak_reserved_mib']:7.0f} MiB"
                + (f"\n          {row['status']}" if "status" in row else ""))
            del step, whole
        except Exception as err:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            RESULTS["errors"][f"{case} {name}"] = f"{type(err).__name__}: {err}"
            log(f"ERROR {case} {name}: {type(err).__name__}: {err}")
    base = out.get("inductor_reduce_overhead+compiled_opt", {}).get("median_ms")
    if base:
        for row in out.values():
            row["vs_inductor_ro"] = base / row["median_ms"]
        log(f"{case}: " + ", ".join(f"{n} {r['vs_inductor_ro']:.3f}x" for n, r in out.items())
            + " (vs Inductor reduce-overhead + compiled optimizer; >1 is faster)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="all", choices=["all", "checks", "resnet50", "bert"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    RESULTS["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S"), "part": args.part}
    try:
        import triton
        RESULTS["env"]["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    parts = ["checks", "resnet50", "bert"] if args.part == "all" else [args.part]
    for part in parts:
        try:
            checks() if part == "checks" else timing(part)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            RESULTS["errors"][part] = f"{type(err).__name__}: {err}"
        path = Path(args.json or os.path.join(os.environ.get("OUT", "."), "whole_step.json"))
        path.write_text(json.dumps(RESULTS, indent=1, default=str))
    log(f"wrote {path}; errors: {len(RESULTS['errors'])}")


if __name__ == "__main__":
    main()
