"""What a convolution's first call costs on the GPU (cuDNN picks and builds its plan then), by kind:
depthwise or not, forward and backward, for every convolution of a model, against the steady
per-call time; variants in new processes each (the first call of a shape is once per process).

    PYTHONPATH=src python benchmarks/scripts/conv_first_call.py mobilenet_v3 [--variant cudnn native benchmark nchw fp16 ember v7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
import torch.nn.functional as F
variant, convs, batch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if variant == "benchmark":
    torch.backends.cudnn.benchmark = True
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
rows = []
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    return out, time.perf_counter() - t
for c in convs:
    depthwise = c["groups"] > 1 and c["groups"] == c["in"]
    fmt = torch.contiguous_format if variant == "nchw" else torch.channels_last
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    x = torch.randn(batch, *c["x"][1:], device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    w = torch.randn(c["w"], device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    use_cudnn = not (variant == "native" and depthwise)
    if variant == "ember" and depthwise:
        from ember.ops import depthwise_conv as dc
        args = (c["stride"], c["padding"], c["dilation"])
        ref = F.conv2d(x, w, None, c["stride"], c["padding"], c["dilation"], c["groups"])
        def fwd():
            return dc.depthwise_conv2d(x, w, None, *args)
        def bwd():
            return (dc.depthwise_conv2d_backward_input(g, w, list(x.shape), *args),
                    dc.depthwise_conv2d_backward_weight(g, x, w, *args))
        y, f1 = timed(fwd)
        g = torch.randn_like(y)
        _, b1 = timed(bwd)
        want = torch.autograd.grad(ref, (x, w), g)
        got = bwd()
        err = [((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()] + [
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want)]
        for _ in range(3):
            fwd(); bwd()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(10):
            fwd(); bwd()
        torch.cuda.synchronize(); steady = (time.perf_counter() - t) / 10
        rows.append({"depthwise": depthwise, "fwd1": f1, "bwd1": b1, "steady": steady, "rel_err": err, **c})
        continue
    def fwd():
        with torch.backends.cudnn.flags(enabled=use_cudnn):
            return F.conv2d(x, w, None, c["stride"], c["padding"], c["dilation"], c["groups"])
    y, f1 = timed(fwd)
    g = torch.randn_like(y)
    def bwd():
        with torch.backends.cudnn.flags(enabled=use_cudnn):
            return torch.autograd.grad(y, (x, w), g, retain_graph=True)
    _, b1 = timed(bwd)
    for _ in range(3):
        fwd(); bwd()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        y = fwd(); torch.autograd.grad(y, (x, w), g)
    torch.cuda.synchronize(); steady = (time.perf_counter() - t) / 10
    rows.append({"depthwise": depthwise, "fwd1": f1, "bwd1": b1, "steady": steady, **c})
print("RESULT " + json.dumps(rows))
"""


def model_convs(name: str, batch: int) -> list[dict]:
    import torch

    from ember.bench import models
    case = models.get_case(name)
    model = case.build(False)
    seen, convs = set(), []
    def hook(mod, inp, out):
        c = {"x": list(inp[0].shape), "w": list(mod.weight.shape), "stride": list(mod.stride),
             "padding": list(mod.padding), "dilation": list(mod.dilation), "groups": mod.groups,
             "in": mod.in_channels}
        key = json.dumps(c)
        if key not in seen:
            seen.add(key)
            convs.append(c)
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    (inputs, _target), = models.make_batches(case, 2, torch.device("cpu"), count=1)
    with torch.no_grad():
        model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    return convs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variant", nargs="+", default=["cudnn", "native"])
    parser.add_argument("--json")
    args = parser.parse_args()
    convs = model_convs(args.model, args.batch)
    results = {}
    for variant in args.variant:
        env = dict(os.environ)
        if variant == "v7":  # PyTorch's cuDNN legacy (v7) API: heuristics pick a kernel, no plan to build
            env["TORCH_CUDNN_V8_API_DISABLED"] = "1"
        proc = subprocess.run([sys.executable, "-c", CHILD, variant, json.dumps(convs), str(args.batch)],
                              capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(variant, "ERROR", proc.stderr[-1500:])
            continue
        rows = json.loads(line[7:])
        results[variant] = rows
        errs = [r["rel_err"] for r in rows if "rel_err" in r]
        if errs:
            print(f"{variant}: worst relative error against cuDNN (forward, input grad, weight grad): "
                  + ", ".join(f"{max(e[i] for e in errs):.2e}" for i in range(3)))
        for kind in (True, False):
            sel = [r for r in rows if r["depthwise"] == kind]
            print(f"{variant:10s} {'depthwise' if kind else 'other':9s} shapes {len(sel):3d}: first fwd "
                  f"{sum(r['fwd1'] for r in sel):6.2f} s, first bwd {sum(r['bwd1'] for r in sel):6.2f} s, "
                  f"steady fwd+bwd {1e3 * sum(r['steady'] for r in sel):7.2f} ms")
    if args.json:
        json.dump({"model": args.model, "batch": args.batch, "convs": convs, "results": results},
                  open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
