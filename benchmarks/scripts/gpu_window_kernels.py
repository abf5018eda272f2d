"""Ember's window kernels (ops/window_kernels.py) against ATen's on the GPU: overlapping max
pooling and reflection padding, forward and backward.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_window_kernels.py --json $OUT/window_kernels.json

Cases: ResNet-50's stem pooling at batch 128 (3x3 windows, stride 2, padding 1) and the
reflection paddings of CycleGAN (bs1) and the style-transfer net (bs4), bf16, channels_last, as
the seed models run them. Each result is checked against ATen's (gradients against ATen's
float32 sum), each kernel timed by CUDA-graph replay (``triton.testing.do_bench_cudagraph``,
median ms: these kernels run inside Ember's graphs, and host overhead would swamp the small
ones), with the GB/s of the traffic each must make against a plain copy's GB/s of the same
bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from triton.testing import do_bench_cudagraph

from ember.capture import pooling
from ember.ops import max_pool, reflection_pad

aten = torch.ops.aten


def _time(fn: Callable[[], object]) -> float:
    return do_bench_cudagraph(fn, rep=100)


def _copy_gb_s(nbytes: int) -> float:
    """GB/s of a device copy reading and writing nbytes / 2 each."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / _time(lambda: dst.copy_(src)) / 1e6


def max_pool_case() -> dict:
    k, s, p = [3, 3], [2, 2], [1, 1]
    x = torch.randn(128, 64, 112, 112, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    want, idx = aten.max_pool2d_with_indices(x, k, s, p)
    got, got_idx = pooling._overlapping(x, k, s, p, [1, 1], False)
    _, pos = max_pool.max_pool2d(x, k, s, p)
    grad = torch.randn_like(want)
    want_dx = aten.max_pool2d_with_indices_backward(grad, x, k, s, p, [1, 1], False, idx)
    got_dx = max_pool.max_pool2d_backward(grad, pos, list(x.shape), k, s, p)
    # Traffic either kernel needs at least: forward reads x, writes maxima and int8 positions;
    # backward reads the gradient and positions, writes the input gradient.
    nbytes = x.numel() * 2 + want.numel() * 3
    return _row("max_pool2d 128x64x112x112 k3 s2 p1", nbytes,
                ok=bool(torch.equal(want, got)) and bool(torch.equal(idx, got_idx)),
                grad_diff=float((want_dx.float() - got_dx.float()).abs().max()),
                aten=(lambda: aten.max_pool2d_with_indices(x, k, s, p),
                      lambda: aten.max_pool2d_with_indices_backward(grad, x, k, s, p, [1, 1], False, idx)),
                ember=(lambda: max_pool.max_pool2d(x, k, s, p),
                       lambda: max_pool.max_pool2d_backward(grad, pos, list(x.shape), k, s, p)))


def reflection_pad_case(shape: tuple[int, ...], pad: int) -> dict:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    pads = [pad] * 4
    want = aten.reflection_pad2d(x, pads)
    got = reflection_pad.reflection_pad2d(x, pads)
    grad = torch.randn_like(got)
    want_dx = aten.reflection_pad2d_backward(grad.float(), x.float(), pads).to(x.dtype)
    got_dx = reflection_pad.reflection_pad2d_backward(grad, list(x.shape), pads)
    nbytes = (x.numel() + want.numel()) * 2  # read one, write the other
    return _row(f"reflection_pad2d {'x'.join(map(str, shape))} p{pad}", nbytes, ok=bool(torch.equal(want, got)),
                grad_diff=float((want_dx.float() - got_dx.float()).abs().max()),
                aten=(lambda: aten.reflection_pad2d(x, pads), lambda: aten.reflection_pad2d_backward(grad, x, pads)),
                ember=(lambda: reflection_pad.reflection_pad2d(x, pads),
                       lambda: reflection_pad.reflection_pad2d_backward(grad, list(x.shape), pads)))


def _row(case: str, nbytes: int, ok: bool, grad_diff: float, aten: tuple, ember: tuple) -> dict:
    row = {"case": case, "forward_equal": ok, "grad_max_abs_diff": grad_diff, "bytes": nbytes,
           "copy_gb_s": _copy_gb_s(nbytes)}
    for who, (fw, bw) in (("aten", aten), ("ember", ember)):
        row[f"{who}_forward_ms"], row[f"{who}_backward_ms"] = _time(fw), _time(bw)
        row[f"{who}_forward_gb_s"] = nbytes / row[f"{who}_forward_ms"] / 1e6
        row[f"{who}_backward_gb_s"] = nbytes / row[f"{who}_backward_ms"] / 1e6
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [max_pool_case()]
    for shape, pad in (((1, 3, 256, 256), 3), ((1, 256, 64, 64), 1), ((1, 64, 256, 256), 3),
                       ((4, 32, 256, 256), 4), ((4, 128, 64, 64), 1)):
        rows.append(reflection_pad_case(shape, pad))
    print(f"{'case':<38} {'ok':>3} {'grad diff':>9} {'copy GB/s':>9}  {'ATen fw / bw ms':>17}  "
          f"{'Ember fw / bw ms':>17}  {'Ember fw / bw GB/s':>18}")
    for r in rows:
        print(f"{r['case']:<38} {'yes' if r['forward_equal'] else 'NO':>3} {r['grad_max_abs_diff']:9.2e} "
              f"{r['copy_gb_s']:9.0f}  {r['aten_forward_ms']:8.4f} {r['aten_backward_ms']:8.4f}  "
              f"{r['ember_forward_ms']:8.4f} {r['ember_backward_ms']:8.4f}  "
              f"{r['ember_forward_gb_s']:9.0f} {r['ember_backward_gb_s']:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if all(r["forward_equal"] and r["grad_max_abs_diff"] < 1e-1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
