"""Matmul padding on the GPU: does it pay, and is the rule right?

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_pad_matmul.py --out $OUT/pad_matmul
    PYTHONPATH=src python benchmarks/scripts/gpu_pad_matmul.py --micro-only        # ~20 s
    PYTHONPATH=src python benchmarks/scripts/gpu_pad_matmul.py --models gpt2 --skip-micro

1. Micro (bf16): for the matmuls of a GPT-2 / BERT-MLM / BART language-model head (forward,
   input gradient, weight gradient) and a few smaller or declined shapes, the unpadded ``torch.mm``
   against the padded version the pass emits (``ember::pad_zeros`` of the operands, the matmul,
   the slice, and the copy back when the caller sees the result), with the rule's decision beside
   the measured speed-up: a row where they disagree is a rule to fix.
2. Models (training, bf16 autocast, SGD momentum, each step synchronised as PyTorch's harness
   does): Ember with ``EMBER_PAD_MATMUL=auto`` and ``=off`` against ``inductor-cudagraphs``;
   median ms per step, GPU kernel ms per step (profiler), the ms of cuBLAS ``align1`` kernels,
   peak reserved memory; and what Ember padded. Models: ``gpt2`` (vocab 50257), ``bert`` (the
   seed's sequence classifier: nothing to pad, a no-regression row), ``bert_mlm``
   (BertForMaskedLM, vocab 30522, batch 32 x 128) and ``bart`` (vocab 50265).

Expected runtime: micro ~20 s; per model ~2-4 min (three compiles, Inductor's the longest);
memory: under 40 GB on an H100.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ember import config
from ember.bench import harness, models
from ember.bench.models import BenchCase
from ember.passes.matmul_padding_rule import MatmulDims, decide
from ember.passes.pad_matmul import padding_line

BF16 = torch.bfloat16


# -- micro ---------------------------------------------------------------------------------------

# name, M, K, N, A transposed, B transposed, result seen by the caller
MICRO = [
    ("gpt2 head fwd", 8192, 768, 50257, False, True, True),
    ("gpt2 head dgrad", 8192, 50257, 768, False, False, False),
    ("gpt2 head wgrad", 50257, 8192, 768, True, False, False),
    ("bert-mlm head fwd", 4096, 768, 30522, False, True, True),
    ("bert-mlm head dgrad", 4096, 30522, 768, False, False, False),
    ("bart head fwd", 2048, 768, 50265, False, True, True),
    ("gpt2 infer bs1 head", 512, 768, 50257, False, True, True),
    ("odd ffn 8192x1001x4096", 8192, 1001, 4096, False, True, False),
    ("small 512x1001x512", 512, 1001, 512, False, True, False),
    ("tiny 64x768x1001", 64, 768, 1001, False, True, True),
    ("classifier 64x768x2", 64, 768, 2, False, True, True),
]


def _operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
    if transposed:
        return torch.randn(cols, rows, device="cuda", dtype=BF16).t()
    return torch.randn(rows, cols, device="cuda", dtype=BF16)


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """As the pass pads: at the source of a transposing view, in the source's layout."""
    if (rows, cols) == tuple(x.shape):
        return x
    if x.stride(0) == 1 and x.stride(1) != 1:  # a transposed view
        return torch.ops.ember.pad_zeros(x.t(), [cols, rows]).t()
    return torch.ops.ember.pad_zeros(x, [rows, cols])


def micro() -> list[dict]:
    rows = []
    for name, m, k, n, a_t, b_t, visible in MICRO:
        a, b = _operand(m, k, a_t), _operand(k, n, b_t)
        dims = MatmulDims(1, m, k, n, BF16)

        def cost(pm: int, pk: int, pn: int, a=a, b=b, m=m, k=k, n=n, visible=visible) -> int:
            total = 0
            if (pm, pk) != (m, k):
                total += 2 * a.numel() * 2 + 2 * (pm * pk - m * k)
            if (pk, pn) != (k, n):
                total += 2 * b.numel() * 2 + 2 * (pk * pn - k * n)
            if visible and (pm, pn) != (m, n):
                total += 2 * m * n * 2
            return total

        d = decide(dims, cost, "auto", tf32=False)
        forced = decide(dims, cost, "always", tf32=False)
        pm, pk, pn = forced.m, forced.k, forced.n

        def padded(a=a, b=b, m=m, n=n, pm=pm, pk=pk, pn=pn, visible=visible) -> torch.Tensor:
            out = torch.mm(_pad(a, pm, pk), _pad(b, pk, pn))[:m, :n]
            return out.contiguous() if visible else out

        plain_ms = _time_ms(lambda a=a, b=b: torch.mm(a, b))
        padded_ms = _time_ms(padded) if (pm, pk, pn) != (m, k, n) else plain_ms
        err = (padded().float() - torch.mm(a, b).float()).abs().max().item()
        rows.append({"case": name, "m": m, "k": k, "n": n, "plain_ms": plain_ms, "padded_ms": padded_ms,
                     "speedup": plain_ms / padded_ms, "rule_pads": d.pads, "rule_says": d.declined or "pad",
                     "max_abs_diff": err})
        del a, b
    torch.cuda.empty_cache()
    print("\n== matmul: unpadded vs padded (bf16, CUDA events, median of 20)")
    print(f"{'case':<26}{'M':>7}{'K':>7}{'N':>7}{'plain ms':>10}{'padded ms':>10}{'speedup':>9}  rule")
    for r in rows:
        wrong = (r["rule_pads"] and r["speedup"] < 1.0) or (not r["rule_pads"] and r["speedup"] > 1.1)
        agree = "  <- the rule disagrees" if wrong else ""
        print(f"{r['case']:<26}{r['m']:>7}{r['k']:>7}{r['n']:>7}{r['plain_ms']:>10.3f}{r['padded_ms']:>10.3f}"
              f"{r['speedup']:>8.2f}x  {r['rule_says']}{agree}")
    return rows


# -- models --------------------------------------------------------------------------------------

def _bert_mlm_case() -> BenchCase:
    def build(small: bool):
        import transformers
        return transformers.BertForMaskedLM(transformers.BertConfig())

    def batch(size: int, device: torch.device, gen: torch.Generator, small: bool):
        ids = torch.randint(1000, 30522, (size, 128), generator=gen)
        return (ids.to(device),), torch.randint(1000, 30522, (size, 128), generator=gen).to(device)

    from ember.bench.zoo import _token_loss
    return BenchCase("bert_mlm", "BertForMaskedLM(BertConfig()), seq 128", build, batch, _token_loss,
                     batch_train=32, batch_infer=1)


def _case(name: str) -> BenchCase:
    return _bert_mlm_case() if name == "bert_mlm" else models.get_case(name)


VARIANTS = [("ember pad auto", "ember", "auto"), ("ember pad off", "ember", "off"),
            ("inductor-cudagraphs", "inductor-cudagraphs", None)]


def run_model(name: str, label: str, backend: str, pad: str | None, warmup: int, iters: int) -> dict:
    device = torch.device("cuda")
    case = _case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with config.patch(pad_matmul=pad or "auto"):
        fn = harness.BACKENDS[backend](model)
    step = harness._make_step(case, fn, "train", "bf16", device, opt)
    batches = models.make_batches(case, case.default_batch("train"), device, count=3)
    for i in range(warmup):
        step(*batches[i % 3])
    torch.cuda.synchronize()
    wall = []
    for i in range(iters):
        t0 = time.perf_counter()
        step(*batches[i % 3])
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[i % 3])
        torch.cuda.synchronize()
    gpu_us = align1_us = 0.0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        if not evt.name or evt.name.startswith(("Memcpy", "Optimizer.")):
            continue
        t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        gpu_us += t
        if "align1" in evt.name:
            align1_us += t
    backend_obj = getattr(fn, "_ember_backend", None)
    padding = []
    if backend_obj is not None:
        padding = [f"{g.title}: {padding_line(g.matmul_padding)}" for g in backend_obj.log.graphs
                   if g.matmul_padding.get("padded")]
    row = {"model": name, "variant": label, "ms": statistics.median(wall), "gpu_ms": gpu_us / 1e3 / steps,
           "align1_ms": align1_us / 1e3 / steps, "peak_gb": torch.cuda.max_memory_reserved() / 2**30,
           "padding": padding}
    del fn, step, model, opt, batches
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert,bert_mlm", help="comma list: gpt2, bert, bert_mlm, bart")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--micro-only", action="store_true")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--out", default=None, help="folder for pad_matmul.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_micro:
        result["micro"] = micro()
    rows = []
    if not args.micro_only:
        wanted = args.variants.split(",")
        for name in args.models.split(","):
            for label, backend, pad in VARIANTS:
                if label in wanted:
                    rows.append(run_model(name, label, backend, pad, args.warmup, args.iters))
                    r = rows[-1]
                    print(f"  done {name} / {label}: {r['ms']:.2f} ms", flush=True)
        print("\n== training step, bf16 autocast, synchronised per step (median)")
        print(f"{'model':<10}{'variant':<22}{'ms/step':>9}{'GPU ms':>9}{'align1 ms':>10}{'peak GB':>9}")
        for r in rows:
            print(f"{r['model']:<10}{r['variant']:<22}{r['ms']:>9.2f}{r['gpu_ms']:>9.2f}{r['align1_ms']:>10.2f}"
                  f"{r['peak_gb']:>9.1f}")
        for r in rows:
            for line in r["padding"]:
                print(f"  {r['model']} / {r['variant']}: {line}")
        result["models"] = rows
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pad_matmul.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
