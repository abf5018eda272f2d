"""Random numbers inside Ember's CUDA graphs, and BERT trained fully captured with and without a mask.

    PYTHONPATH=src python benchmarks/scripts/gpu_rng_capture.py > rng.log 2>&1      # ~5 min on an H100
    PYTHONPATH=src python benchmarks/scripts/gpu_rng_capture.py --skip-bert         # the RNG checks only (~1 min)

1. Dropout (p=0.3) in a compiled training step: every graph captured and replayed, each replay
   draws a new mask (all masks distinct), the fraction of zeros is p within 5 sigma, as eager's
   over as many draws, and the gradient is zero where the forward dropped and g/(1-p) elsewhere
   (the backward reuses the forward's mask).
2. Attention with dropout (p=0.5, bf16) with each SDPA backend forced (flash, memory-efficient,
   cuDNN), forward and backward: captured and replayed, new masks per replay, and the output's
   mean and spread match eager's (uniform attention over ones: mean 1).
3. BERT (transformers BertForSequenceClassification(BertConfig()), seq 128, batch 64, bf16
   autocast, dropout 0.1, SGD) called with input_ids only and with an all-ones attention_mask:
   ember.explain's CUDA-graph status per graph, the attention op the graphs hold, explain's host
   time per step and what ran outside the graphs; then median ms per training step, the host
   synchronised after every step, for eager and Ember.

Prints a short table; JSON to $OUT/rng_capture.json (or --json PATH). Exit status 1 when a check fails.
Memory: about 12 GiB of GPU memory for BERT at batch 64.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import ember
from ember.report.explain import explain_with
from ember.runtime.cudagraphs.runner import CudaGraphRunner

P = 0.3
ROWS: list[dict[str, Any]] = []


def _graphs(compiled: Callable) -> list[dict[str, Any]]:
    """Each compiled graph: its CUDA-graph status and its runner's replays."""
    out = []
    for record, graph in compiled._ember_backend.programs:
        runner = graph.run if isinstance(graph.run, CudaGraphRunner) else None
        out.append({"title": record.title, "cudagraph": record.cudagraph,
                    "replays": runner.replays if runner else 0, "calls": runner.calls if runner else graph.calls,
                    "attention": sorted(op for counts in record.placement.values() for op in counts
                                        if "attention" in op or "dropout" in op or "attention_seeds" in op)})
    return out


def _all_replayed(graphs: list[dict[str, Any]]) -> bool:
    return bool(graphs) and all(g["cudagraph"].startswith("captured") and g["replays"] > 0 for g in graphs)


def check(name: str, ok: bool, detail: str, **extra: Any) -> None:
    ROWS.append({"check": name, "ok": bool(ok), "detail": detail, **extra})
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


class DropoutNet(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.w)


def dropout_check(steps: int = 8, n: int = 1 << 20) -> None:
    torch.manual_seed(0)
    model = DropoutNet(n).cuda()
    compiled = ember.compile(model)
    x = torch.rand(n, device="cuda") + 0.5
    masks, bad_grads = [], 0
    for _ in range(steps):
        xi = x.clone().requires_grad_(True)
        out = compiled(xi)
        g = torch.randn(n, device="cuda")
        out.backward(g)
        kept = out.detach() != 0
        masks.append(kept)
        want = torch.where(kept, g * model.w.detach() / (1 - P), torch.zeros_like(g))
        bad_grads += int(not torch.allclose(xi.grad, want, rtol=1e-5, atol=1e-6))
    graphs = _graphs(compiled)
    fractions = [1 - m.float().mean().item() for m in masks]
    sigma = (P * (1 - P) / n) ** 0.5
    distinct = all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])
    eager = torch.cat([nn.functional.dropout(x, P) for _ in range(steps)])
    eager_fraction = (eager == 0).float().mean().item()
    ours = statistics.fmean(fractions)
    ok = (_all_replayed(graphs) and distinct and bad_grads == 0 and all(abs(f - P) < 5 * sigma for f in fractions)
          and abs(ours - eager_fraction) < 5 * (2 * P * (1 - P) / (n * steps)) ** 0.5)
    check("dropout in replayed graphs", ok,
          f"zero fraction {ours:.5f} (eager {eager_fraction:.5f}, p={P}), masks distinct: {distinct}, "
          f"steps with wrong gradients: {bad_grads}/{steps}, graphs: "
          + "; ".join(f"{g['title']}: {g['replays']} replays of {g['calls']} calls" for g in graphs),
          graphs=graphs, fractions=fractions, eager_fraction=eager_fraction)


class UniformAttention(nn.Module):
    """q = k = 0: every query attends uniformly; v = ones * s, so out = s * kept/(L (1-p)) per row."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))

    def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, q, v * self.s, dropout_p=0.5)


def attention_check(backend: SDPBackend, steps: int = 6) -> None:
    name = f"attention dropout, {backend.name}"
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = UniformAttention().cuda()
        q = torch.zeros(8, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.ones(8, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel([backend]):
            compiled = ember.compile(model)
            outs, grads = [], []
            for _ in range(steps):
                out = compiled(q, v)
                out.float().sum().backward()
                outs.append(out.detach().float())
                grads.append(model.s.grad.item())
                model.s.grad = None
            eager = [model(q, v).detach().float() for _ in range(steps)]
        graphs = _graphs(compiled)
        distinct = all(not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
        mean, std = statistics.fmean(o.mean().item() for o in outs), statistics.fmean(o.std().item() for o in outs)
        emean, estd = statistics.fmean(o.mean().item() for o in eager), statistics.fmean(o.std().item() for o in eager)
        # d(sum out)/ds = sum(out)/s: the backward saw the forward's mask.
        grad_ok = all(abs(g - o.sum().item()) <= 2e-2 * abs(o.sum().item()) for g, o in zip(grads, outs))
        ok = (_all_replayed(graphs) and distinct and abs(mean - emean) < 0.02 and 0.8 < std / estd < 1.25
              and grad_ok)
        check(name, ok, f"mean {mean:.4f} (eager {emean:.4f}), spread {std:.4f} (eager {estd:.4f}), new masks "
              f"each replay: {distinct}, gradient = sum of the output: {grad_ok}, ops "
              f"{sorted({op for g in graphs for op in g['attention']})}, graphs: "
              + "; ".join(f"{g['title']}: {g['replays']} replays, {g['cudagraph'][:60]}" for g in graphs),
              graphs=graphs)
    except Exception as err:  # noqa: BLE001 - a backend this device lacks is a row, not the end
        check(name, False, f"{type(err).__name__}: {str(err)[:300]}")
        traceback.print_exc()


def _bert(batch: int, with_mask: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig()).cuda().train()
    ids = torch.randint(1000, 30522, (batch, 128), device="cuda")
    labels = torch.randint(0, 2, (batch,), device="cuda")
    kwargs = {"attention_mask": torch.ones_like(ids)} if with_mask else {}
    return model, ids, labels, kwargs


def _time_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bert_case(with_mask: bool, batch: int, warmup: int, steps: int) -> None:
    name = f"bert train bs{batch} {'with attention_mask' if with_mask else 'input_ids only'}"
    try:
        torch._dynamo.reset()
        model, ids, labels, kwargs = _bert(batch, with_mask)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            report = explain_with(model, (ids,), kwargs, steps=5)
        statuses = [f"{g.title}: {g.cudagraph}" for g in report.graphs]
        ops = sorted({op for g in report.graphs for c in g.placement.values() for op in c
                      if "attention" in op or "dropout" in op})
        host = report.host.as_dict() if report.host is not None else {}
        print(f"--- explain, {name}:\n" + str(report).split("Compile time")[0], flush=True)

        def run(forward: Callable) -> Callable[[], None]:
            opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(forward(ids, **kwargs).logits, labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        eager_ms = _time_steps(run(model), warmup, steps)
        torch._dynamo.reset()
        compiled = ember.compile(model)
        ember_ms = _time_steps(run(compiled), warmup, steps)
        graphs = _graphs(compiled)
        ok = report.dynamo_graphs == 1 and all(g.cudagraph.startswith("captured") for g in report.graphs) \
            and _all_replayed(graphs) and not host.get("outside_graphs")
        check(name, ok, f"eager {eager_ms:.2f} ms, Ember {ember_ms:.2f} ms per step (synchronised, median of "
              f"{steps}); explain: {report.dynamo_graphs} Dynamo graph(s), host {host.get('step_host_ms', 0):.2f} "
              f"ms/step, outside the graphs: {host.get('outside_graphs')}; ops {ops}",
              eager_ms=eager_ms, ember_ms=ember_ms, explain_status=statuses, explain_host_time=host,
              graphs=graphs, attention_ops=ops)
    except Exception as err:  # noqa: BLE001
        check(name, False, f"{type(err).__name__}: {str(err)[:300]}")
        traceback.print_exc()
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-bert", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dropout_check()
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        attention_check(backend)
    if not args.skip_bert:
        for with_mask in (False, True):
            bert_case(with_mask, args.batch, args.warmup, args.steps)
    print("\n| check | ok | detail |\n|---|---|---|")
    for r in ROWS:
        print(f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['detail'][:160]} |")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ember": ember.__version__,
            "cudnn": torch.backends.cudnn.version(), "date": dt.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "timer": "sync_each_step", "rows": ROWS}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    path = args.json or (os.path.join(os.environ["OUT"], "rng_capture.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(meta, indent=1, default=str))
        print(f"wrote {path}")
    return 0 if all(r["ok"] for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
