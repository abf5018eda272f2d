"""Ember's overlapping max-pool kernels (capture/max_pool.py) against ATen's on the GPU.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/gpu_max_pool.py --json $OUT/max_pool.json

ResNet-50's stem pooling at batch 128 (bf16, channels_last, 3x3 windows, stride 2, padding 1):
forward and backward results against ATen's (maxima and flat indices equal, gradients equal
after ATen's float32 sum), and each kernel's time by ``triton.testing.do_bench`` (median ms) with
the GB/s its unavoidable traffic makes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from ember.capture import max_pool, pooling

aten = torch.ops.aten


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    k, s, p = [3, 3], [2, 2], [1, 1]
    x = torch.randn(128, 64, 112, 112, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    want, idx = aten.max_pool2d_with_indices(x, k, s, p)
    got, got_idx = pooling._overlapping(x, k, s, p, [1, 1], False)
    _, pos = max_pool.max_pool2d(x, k, s, p)
    grad = torch.randn_like(want)
    want_dx = aten.max_pool2d_with_indices_backward(grad, x, k, s, p, [1, 1], False, idx)
    got_dx = max_pool.max_pool2d_backward(grad, pos, list(x.shape), k, s, p)
    checks = {"maxima_equal": bool(torch.equal(want, got)), "indices_equal": bool(torch.equal(idx, got_idx)),
              "grad_max_abs_diff": float((want_dx.float() - got_dx.float()).abs().max())}
    rows = {
        "aten_forward_ms": do_bench(lambda: aten.max_pool2d_with_indices(x, k, s, p)),
        "ember_forward_ms": do_bench(lambda: max_pool.max_pool2d(x, k, s, p)),
        "aten_backward_ms": do_bench(lambda: aten.max_pool2d_with_indices_backward(grad, x, k, s, p, [1, 1], False,
                                                                                   idx)),
        "ember_backward_ms": do_bench(lambda: max_pool.max_pool2d_backward(grad, pos, list(x.shape), k, s, p)),
    }
    # Traffic either kernel needs at least: forward reads x, writes maxima and int8 positions;
    # backward reads the gradient and positions, writes the input gradient.
    fw_bytes = x.numel() * 2 + want.numel() * 3
    bw_bytes = want.numel() * 3 + x.numel() * 2
    rows["ember_forward_gb_s"] = fw_bytes / rows["ember_forward_ms"] / 1e6
    rows["ember_backward_gb_s"] = bw_bytes / rows["ember_backward_ms"] / 1e6
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **checks, **rows}
    for key, value in result.items():
        print(f"{key:<22} {value:.4f}" if isinstance(value, float) else f"{key:<22} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = checks["maxima_equal"] and checks["indices_equal"] and checks["grad_max_abs_diff"] < 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
