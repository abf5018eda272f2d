"""Ember's depthwise convolution kernels (ops/depthwise_conv.py) against cuDNN, per kernel, on the
GPU: forward, input gradient and weight gradient of every depthwise convolution of a model, bf16
channels_last, timed after warm-up (first-call builds excluded) with CUDA events.

    PYTHONPATH=src python benchmarks/scripts/depthwise_kernel_bench.py mobilenet_v3 [--batch 128] \
        [--variant TILE=4096,WEIGHT_TILE=8192 ...] [--json out.json]

Each ``--variant`` sets module constants of ops/depthwise_conv.py (block sizes, programs).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from conv_first_call import model_convs


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _bench_shape(c: dict, batch: int, variants: list[str]) -> dict:
    from ember.ops import depthwise_conv as dc
    aten = torch.ops.aten
    x = torch.randn(batch, *c["x"][1:], device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(c["w"], device="cuda", dtype=torch.bfloat16)
    s, p, d, groups = c["stride"], c["padding"], c["dilation"], c["groups"]
    y = aten.convolution(x, w, None, s, p, d, False, [0, 0], groups)
    g = torch.randn_like(y)

    def cudnn_backward(mask: list[bool]) -> object:
        return aten.convolution_backward(g, x, w, None, s, p, d, False, [0, 0], groups, mask)

    row = {"shape": f"{list(x.shape)} k{c['w'][2]} s{s[0]}",
           "cudnn": [_time(lambda: aten.convolution(x, w, None, s, p, d, False, [0, 0], groups)),
                     _time(lambda: cudnn_backward([True, False, False])),
                     _time(lambda: cudnn_backward([False, True, False]))]}
    want_dw = cudnn_backward([False, True, False])[1]
    for variant in variants:
        saved = {}
        for item in filter(None, variant.split(",")):
            key, value = item.split("=")
            saved[key] = getattr(dc, key)
            setattr(dc, key, int(value))
        try:
            got_dw = dc.depthwise_conv2d_backward_weight(g, x, w, s, p, d)
            err = ((got_dw.float() - want_dw.float()).abs().max() / want_dw.float().abs().max()).item()
            row[variant or "ember"] = [_time(lambda: dc.depthwise_conv2d(x, w, None, s, p, d)),
                                       _time(lambda: dc.depthwise_conv2d_backward_input(g, w, list(x.shape), s, p, d)),
                                       _time(lambda: dc.depthwise_conv2d_backward_weight(g, x, w, s, p, d)), err]
        finally:
            for key, value in saved.items():
                setattr(dc, key, value)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--json")
    args = parser.parse_args()
    convs = [c for c in model_convs(args.model, args.batch) if c["groups"] > 1 and c["groups"] == c["in"]]
    variants = [""] + args.variant
    rows = []
    for c in convs:
        row = _bench_shape(c, args.batch, variants)
        rows.append(row)
        print(row["shape"], " ".join(f"{k}: " + "/".join(f"{v:.3f}" for v in vals[:3]) for k, vals in row.items()
                                     if k != "shape"), flush=True)
    for name in ["cudnn", *[v or "ember" for v in variants]]:
        tot = [sum(r[name][i] for r in rows) for i in range(3)]
        worst = max((r[name][3] for r in rows), default=0.0) if name != "cudnn" else 0.0
        print(f"TOTAL {name:40s} fwd {tot[0]:.3f} ms, input grad {tot[1]:.3f} ms, weight grad {tot[2]:.3f} ms, "
              f"sum {sum(tot):.3f} ms; worst weight-grad relative error {worst:.2e}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
