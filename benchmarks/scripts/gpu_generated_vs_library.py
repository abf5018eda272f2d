"""Ember's generated alternatives against the libraries at bert's batch-1 inference shapes: the
tiled matmul (ops/tiled_matmul.py, its cost model's six best tile and split-K configurations)
against cuBLAS, and Ember's attention kernel (ops/attention.py, each tile configuration) against
the SDPA backends. What ``ember tune`` would measure at these sites, all in one table.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_generated_vs_library.py --json $OUT/generated_vs_library.json
Smoke test on the CPU (Triton's interpreter, tiny shapes, times meaningless):
    PYTHONPATH=src python benchmarks/scripts/gpu_generated_vs_library.py --device cpu --tiny

bf16; time per call from CUDA-graph replay (``triton.testing.do_bench_cudagraph``; on the CPU a
few plain calls); each result's largest difference from a float64 computation, beside the
library's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ember.bench.report import git_commit
from ember.ops import attention as att
from ember.ops import tiled_matmul as tm

# bert-base at batch 1, 128 tokens: (name, m, k, n) of its projections and (batch, heads, tokens, dim).
MATMULS = (("qkv (merged)", 128, 768, 2304), ("attention out", 128, 768, 768), ("ffn up", 128, 768, 3072),
           ("ffn down", 128, 3072, 768))
ATTENTION = (1, 12, 128, 64)
TINY_MATMULS = (("tiny", 16, 40, 24),)
TINY_ATTENTION = (1, 2, 10, 16)


def _time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench_cudagraph(fn, rep=50))
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def _row(kind: str, case: str, impl: str, fn: Callable[[], torch.Tensor], exact: torch.Tensor, device: str) -> dict:
    out = fn()
    err = (out.double() - exact).abs().max().item()
    return {"kind": kind, "case": case, "impl": impl, "ms": _time_ms(fn, device), "max_abs_err": err}


def matmul_rows(device: str, shapes: tuple) -> list[dict]:
    rows = []
    for name, m, k, n in shapes:
        a = torch.randn(m, k, device=device).bfloat16()
        w = torch.randn(n, k, device=device).bfloat16() / k ** 0.5  # a Linear's weight, used transposed
        bias = torch.randn(n, device=device).bfloat16()
        exact = a.double() @ w.double().t() + bias.double()
        case = f"{name} {m}x{k}x{n}"
        rows.append(_row("matmul", case, "cublas (addmm)", lambda a=a, w=w, b=bias: torch.addmm(b, a, w.t()), exact,
                         device))
        for tiles in tm.candidates(1, m, n, k, 2):
            label = tm.tiles_of(tiles)
            rows.append(_row("matmul", case, f"tiled {label}",
                             lambda a=a, w=w, b=bias, t=label: tm.tiled_matmul(a, w.t(), b, t), exact, device))
    return rows


def attention_rows(device: str, shape: tuple) -> list[dict]:
    rows = []
    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device=device).bfloat16().transpose(1, 2) for _ in range(3))
    pad = torch.zeros(b, 1, 1, s, device=device).bfloat16()
    pad[..., -s // 8:] = -1e4  # bert's padding mask: the last eighth of the tokens
    for masked in (False, True):
        mask = pad if masked else None
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                               attn_mask=mask.double() if masked else None)
        case = f"{b}x{h}x{s}x{d}" + (" padding mask" if masked else "")
        backends = (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)) if device == "cuda" else \
            (("math", SDPBackend.MATH),)
        for name, backend in backends:
            def sdpa(backend: SDPBackend = backend, mask: torch.Tensor | None = mask) -> torch.Tensor:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                rows.append(_row("attention", case, f"sdpa {name}", sdpa, exact, device))
            except RuntimeError as err:  # a backend that refuses these inputs (flash with a mask)
                rows.append({"kind": "attention", "case": case, "impl": f"sdpa {name}", "skipped": str(err)[:120]})
        for tiles in att.candidates(s, s, top=len(att._CONFIGS)):
            label = att.tiles_of(tiles)
            rows.append(_row("attention", case, f"ember {label}",
                             lambda t=label, mask=mask: att.attention(q, k, v, mask, False, None, t)[0], exact, device))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test on the interpreter)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = matmul_rows(args.device, TINY_MATMULS if args.tiny else MATMULS)
    rows += attention_rows(args.device, TINY_ATTENTION if args.tiny else ATTENTION)
    best: dict[str, float] = {}
    for r in rows:
        if "ms" in r and not r["impl"].startswith(("tiled", "ember")):
            best[r["case"]] = min(best.get(r["case"], float("inf")), r["ms"])
    for r in rows:
        if "ms" in r:
            r["library_best_over_this"] = best[r["case"]] / r["ms"]
        line = f"{r['kind']:9} {r['case']:34} {r['impl']:34} "
        print(line + (f"{r['ms']:8.4f} ms  x{r['library_best_over_this']:.3f}  err {r['max_abs_err']:.2e}"
                      if "ms" in r else f"skipped: {r['skipped']}"), flush=True)
    if args.json:
        env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
               "torch": torch.__version__, "git_commit": git_commit(), "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
