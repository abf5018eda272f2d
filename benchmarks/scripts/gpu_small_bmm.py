"""Small unaligned batched products: ``ember::small_bmm`` (ops/small_bmm.py) against cuBLAS's bmm.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_small_bmm.py --json $OUT/small_bmm.json

Cases: the six products of Swin-T's window attention (49 tokens, heads of 32) at batch 64, per
stage (12,288 / 6,144 / 3,072 / 1,536 windows x heads), with the operand layouts its training graph
has (the backward's transposed views); then sizes at the rule's edges. Time per call from
CUDA-graph replay (``triton.testing.do_bench_cudagraph``); the largest difference from a float32
product, for both.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

from ember.bench.report import git_commit
from ember.ops import small_bmm

STAGES = (12288, 6144, 3072, 1536)


def _t(batch: int, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    if transposed:
        return torch.randn(batch, cols, rows, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(batch, rows, cols, device="cuda", dtype=torch.bfloat16)


def cases() -> list[tuple[str, int, int, int, int, bool, bool]]:
    """(name, batch, m, k, n, a transposed, b transposed)."""
    out = []
    for batch in STAGES:
        out += [("scores q @ k^T", batch, 49, 32, 49, False, True),
                ("output p @ v", batch, 49, 49, 32, False, False),
                ("grad p: dout @ v^T", batch, 49, 32, 49, False, True),
                ("grad v: p^T @ dout", batch, 49, 49, 32, True, False),
                ("grad q: ds @ k", batch, 49, 49, 32, False, False),
                ("grad k: ds^T @ q", batch, 49, 49, 32, True, False)]
    out += [("edge", 4096, 100, 64, 100, False, True), ("edge", 4096, 128, 32, 128, False, True),
            ("edge", 2048, 120, 256, 120, False, False), ("edge", 8192, 16, 16, 9, False, False),
            ("aligned (not taken)", 12288, 48, 32, 48, False, True)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<22} {'batch':>6} {'m':>4} {'k':>4} {'n':>4} {'cuBLAS us':>10} {'Ember us':>9} {'speed-up':>8} "
          f"{'err cuBLAS':>10} {'err Ember':>9}")
    for name, batch, m, k, n, ta, tb in cases():
        a, b = _t(batch, m, k, ta), _t(batch, k, n, tb)
        exact = torch.bmm(a.float(), b.float())
        lib = triton.testing.do_bench_cudagraph(lambda: torch.bmm(a, b)) * 1e3  # noqa: B023
        ours = triton.testing.do_bench_cudagraph(lambda: small_bmm.small_bmm(a, b)) * 1e3  # noqa: B023
        r = {"case": name, "batch": batch, "m": m, "k": k, "n": n, "a_transposed": ta, "b_transposed": tb,
             "taken": small_bmm.takes(a, b), "cublas_us": lib, "ember_us": ours,
             "err_cublas": (torch.bmm(a, b).float() - exact).abs().max().item(),
             "err_ember": (small_bmm.small_bmm(a, b).float() - exact).abs().max().item()}
        rows.append(r)
        print(f"{name:<22} {batch:>6} {m:>4} {k:>4} {n:>4} {lib:>10.1f} {ours:>9.1f} {lib / ours:>7.2f}x "
              f"{r['err_cublas']:>10.3g} {r['err_ember']:>9.3g}", flush=True)
    swin = [r for r in rows if r["batch"] in STAGES and r["m"] == 49]
    # Swin-T's 12 blocks per step: two in stages 1, 2 and 4, six in stage 3.
    per_step = {12288: 2, 6144: 2, 3072: 6, 1536: 2}
    lib_ms = sum(r["cublas_us"] * per_step[r["batch"]] for r in swin) / 1e3
    ours_ms = sum(r["ember_us"] * per_step[r["batch"]] for r in swin) / 1e3
    print(f"swin_t step (batch 64, 12 blocks): cuBLAS {lib_ms:.3f} ms, Ember {ours_ms:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_commit": git_commit(),
                       "rows": rows, "swin_t_step_ms": {"cublas": lib_ms, "ember": ours_ms}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
