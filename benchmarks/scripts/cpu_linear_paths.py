"""A BERT-base linear layer's three CPU paths at batch 1, fp32: ATen's (MKL's sgemm), oneDNN with
the weight packed once (what Ember's CPU target calls) and MKL's packed GEMM.

    python benchmarks/scripts/cpu_linear_paths.py [--json PATH]

Median ms of 30 calls after 5, and GFLOP/s, for the shapes of one layer at sequence length 128
(query/key/value merged, attention output, the MLP's two). Tells how far a model whose time is in
these calls can get above eager on this CPU by choosing among them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable

import torch

SHAPES = [(128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768)]  # (M, K, N)


def median_ms(fn: Callable[[], object], calls: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[calls // 2] * 1e3


def paths(m: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    """The three calls of one [m, k] @ [k, n] + bias, on fresh random values."""
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    return {"aten linear": lambda: torch.nn.functional.linear(x, w, b),
            "oneDNN, packed weight": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
            "MKL, packed weight": lambda: torch.ops.mkl._mkl_linear(x, mkl_packed, w, b, m)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        for name, fn in paths(m, k, n).items():
            ms = median_ms(fn)
            rows.append({"m": m, "k": k, "n": n, "path": name, "ms": ms, "gflops": 2 * m * k * n / ms / 1e6})
            print(f"{m}x{k} @ {k}x{n}  {name:24s} {ms:7.3f} ms  {rows[-1]['gflops']:6.1f} GFLOP/s", flush=True)
    if args.json:
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
               "machine": platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
