"""Attention's library kernels at a model's shape: the first call's cost in a new process and the
steady-state time of forward + backward, per SDPA backend (flash, memory-efficient, cuDNN).

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_attention_backends.py --shape 64,12,128,64 \\
        --json $OUT/attention_backends.json

cuDNN's attention builds an execution graph per shape on its first forward and first backward
(kept in a thread-local cache, so another thread cannot build it ahead); flash and
memory-efficient attention launch precompiled kernels. A new process per backend measures what a
program's first run pays for the choice; the steady state is 20 forward + backward calls between
two CUDA events, median of 7 (launches included: at small shapes the host's pace shows).
"""

from __future__ import annotations

import argparse
import os
import sys

from fresh_process import child_result, write_rows

CHILD = r"""
import json, sys, time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
backend = getattr(SDPBackend, sys.argv[1])
shape, _, p = sys.argv[2].partition(":")
b, h, s, d = (int(x) for x in shape.split(","))
p = float(p or 0.0)
dev = torch.device("cuda")
torch.ones(1, device=dev).sum().item()  # the context, outside the measurement
q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)

def fwd_bwd():
    out = sdpa(q, k, v, dropout_p=p)
    out.backward(g)

with sdpa_kernel([backend]):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = sdpa(q, k, v, dropout_p=p); torch.cuda.synchronize(); first_fwd = time.perf_counter() - t
    t = time.perf_counter(); out.backward(g); torch.cuda.synchronize(); first_bwd = time.perf_counter() - t
    t = time.perf_counter(); fwd_bwd(); torch.cuda.synchronize(); second = time.perf_counter() - t
    for _ in range(3):
        fwd_bwd()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fwd_bwd()
        end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20)
    # Another shape in the same process: what a shape's first call costs once the library is loaded.
    q2, k2, v2 = (torch.randn(b, h, s // 2, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize(); t = time.perf_counter()
    out = sdpa(q2, k2, v2, dropout_p=p); torch.cuda.synchronize(); shape_fwd = time.perf_counter() - t
    t = time.perf_counter(); out.sum().backward(); torch.cuda.synchronize(); shape_bwd = time.perf_counter() - t
times.sort()
print("RESULT " + json.dumps({"first_forward_s": first_fwd, "first_backward_s": first_bwd, "second_call_s": second,
                              "new_shape_forward_s": shape_fwd, "new_shape_backward_s": shape_bwd,
                              "fwd_bwd_ms": times[len(times) // 2], "fwd_bwd_ms_min": times[0]}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None,
                        help="batch,heads,sequence,head_dim[:dropout] (bf16); repeat for more (default: BERT-base training)")
    parser.add_argument("--backends", default="FLASH_ATTENTION,EFFICIENT_ATTENTION,CUDNN_ATTENTION")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'shape':<22}{'backend':<22}{'first fwd ms':>13}{'first bwd ms':>13}{'2nd call ms':>12}{'fwd+bwd ms':>11}{'new shape fwd/bwd ms':>22}")
    for shape in args.shape or ["64,12,128,64"]:
        for backend in args.backends.split(","):
            r, stderr = child_result(CHILD, [backend, shape], dict(os.environ))
            if r is None:
                rows.append({"shape": shape, "backend": backend, "error": stderr[-2000:]})
                print(f"{shape:<22}{backend:<22}ERROR {stderr.strip().splitlines()[-1][:200] if stderr.strip() else ''}")
                continue
            rows.append({"shape": shape, "backend": backend, **r})
            print(f"{shape:<22}{backend:<22}{r['first_forward_s'] * 1e3:>13.1f}{r['first_backward_s'] * 1e3:>13.1f}"
                  f"{r['second_call_s'] * 1e3:>12.2f}{r['fwd_bwd_ms']:>11.3f}"
                  f"{r['new_shape_forward_s'] * 1e3:>13.1f} / {r['new_shape_backward_s'] * 1e3:.1f}", flush=True)
    return write_rows(args.json, rows)


if __name__ == "__main__":
    sys.exit(main())
