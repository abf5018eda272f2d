"""Batched matmuls of attention sizes with rows of 16-byte multiples and without.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_matmul_row_alignment.py --out $OUT/row_alignment.json

A window attention (Swin: 49 tokens, head dim 32) or a ViT's (197 tokens, head dim 64) multiplies
[tokens, tokens] matrices: stored densely their rows are 98 or 394 bytes long, not a multiple of
16, and cuBLAS falls back to kernels that load one element at a time. Stored with each row
padded to 8 elements (row stride 56 or 200) the same values are aligned. For each product of an
attention's forward and backward this times, in one CUDA graph of ``--reps`` launches (no launch
gaps), the dense form against the padded one: the [tokens, tokens] matrix as the product's result
(``bmm(..., out=padded view)``) or as its operand (a padded view, transposed where the backward
reads it so). Each padded result's largest difference from the dense one is reported, and the kernels each variant
ran are listed (torch.profiler), so a copy that ATen makes behind ``out=`` would show.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_rnn_graphs import captured_replay  # noqa: E402 - the script's sibling: one CUDA graph of fn, replayed

SHAPES = {  # name -> (batch x heads, tokens, head dim)
    "swin_t stage 1 bs64": (64 * 64 * 3, 49, 32),
    "swin_t stage 2 bs64": (64 * 16 * 6, 49, 32),
    "swin_t stage 3 bs64": (64 * 4 * 12, 49, 32),
    "vit_b16 bs64": (64 * 12, 197, 64),
}


def padded(batch: int, rows: int, cols: int, align: int = 8) -> torch.Tensor:
    """A [batch, rows, cols] view of a buffer whose rows are padded to ``align`` elements."""
    width = -(-cols // align) * align
    return torch.randn(batch, rows, width, device="cuda", dtype=torch.bfloat16)[..., :cols]


def graph_time(fn, reps: int) -> float:
    """Microseconds per call of ``fn`` replayed ``reps`` times inside one CUDA graph."""
    replay = captured_replay(lambda: [fn() for _ in range(reps)])
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def cases(batch: int, tokens: int, dim: int) -> dict:
    """name -> (dense fn, padded fn, dense result, padded result): one attention's products."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v, grad_out = (torch.randn(batch, tokens, dim, **bf) for _ in range(4))
    probs_dense = torch.randn(batch, tokens, tokens, **bf)
    probs_padded = padded(batch, tokens, tokens)
    probs_padded.copy_(probs_dense)
    out_dense = torch.empty(batch, tokens, tokens, **bf)
    out_padded = padded(batch, tokens, tokens)
    pv_dense, pv_padded = torch.empty(batch, tokens, dim, **bf), torch.empty(batch, tokens, dim, **bf)
    return {
        # scores = q @ k^T: the [tokens, tokens] result
        "q @ k^T (result)": (lambda: torch.bmm(q, k.transpose(1, 2), out=out_dense),
                             lambda: torch.bmm(q, k.transpose(1, 2), out=out_padded), out_dense, out_padded),
        # out = probs @ v: the [tokens, tokens] operand
        "probs @ v (operand)": (lambda: torch.bmm(probs_dense, v, out=pv_dense),
                                lambda: torch.bmm(probs_padded, v, out=pv_padded), pv_dense, pv_padded),
        # backward: grad_v = probs^T @ grad_out (the operand transposed)
        "probs^T @ grad (operand, transposed)": (
            lambda: torch.bmm(probs_dense.transpose(1, 2), grad_out, out=pv_dense),
            lambda: torch.bmm(probs_padded.transpose(1, 2), grad_out, out=pv_padded), pv_dense, pv_padded),
        # backward: grad_probs = grad_out @ v^T (the result)
        "grad @ v^T (result)": (lambda: torch.bmm(grad_out, v.transpose(1, 2), out=out_dense),
                                lambda: torch.bmm(grad_out, v.transpose(1, 2), out=out_padded), out_dense, out_padded),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="row_alignment.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':<22} {'product':<38} {'dense us':>9} {'padded us':>9} {'ratio':>6}  kernels (dense | padded)")
    for shape, (batch, tokens, dim) in SHAPES.items():
        for name, (dense, pad, want, got) in cases(batch, tokens, dim).items():
            dense()
            pad()
            torch.cuda.synchronize()
            diff = (want.float() - got.float()).abs().max().item()
            kd, kp = kernels(dense), kernels(pad)
            td, tp = graph_time(dense, args.reps), graph_time(pad, args.reps)
            rows.append({"shape": shape, "batch": batch, "tokens": tokens, "dim": dim, "product": name,
                         "dense_us": td, "padded_us": tp, "max_abs_diff": diff, "dense_kernels": kd, "padded_kernels": kp,
                         "padded_strides": list(got.stride())})
            print(f"{shape:<22} {name:<38} {td:9.1f} {tp:9.1f} {td / tp:6.2f}  "
                  f"{' + '.join(k[:40] for k in kd)} | {' + '.join(k[:40] for k in kp)}  diff {diff:.3g}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "reps": args.reps}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
