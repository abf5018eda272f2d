"""GPU check of the shared op lowerings (codegen/lowering.py) in compiled Triton: every pointwise op
family and the bool / narrow-integer / float reductions (persistent and looped), Ember
(target="triton") vs eager on CUDA tensors, exact for integers and bools.

Run on the device (from the repo root), about a minute, under 1 GiB of GPU memory:
    PYTHONPATH=src python benchmarks/scripts/gpu_lowering_check.py
Prints one row per case and exits 1 if any case differs from eager. ``--interpret`` runs the same
cases on CPU through Triton's interpreter (a few minutes on a small machine).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

import ember
from ember import config


def pointwise(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = torch.add(a, b, alpha=2) - torch.sub(a, c, alpha=0.5)
    y = torch.where(a > 0, x, 1.5) + torch.masked_fill(b, c < 0, -2.0) + (1 - a)
    z = torch.clamp(y, min=-1.0) + torch.clamp(y, -0.5, 0.5) + torch.clamp_max(y, 0.2)
    w = torch.maximum(z, a) * torch.minimum(z, b) / (a.abs() + 1)
    p = a ** 2 + a ** 3 + a.abs() ** 0.5 + (a.abs() + 1) ** -0.5 + (a + 5) ** -1 + (a + 5) ** -2
    m = (a.exp() + (a.abs() + 1).log() + a.sin() + a.cos() + torch.erf(a) + a.floor() + a.ceil() + a.tanh()
         + a.sigmoid() + a.sign() + a.relu() + (a.abs() + 1).rsqrt() + (a.abs() + 1).reciprocal())
    q = (a != b) & (a >= c) | (b <= c) ^ a.eq(0.5)
    r = a.to(torch.bfloat16).float() + a.to(torch.float16).float() + a.int().float()
    return x, y, z, w, p, m, q, r, torch.isnan(w)


def reductions(a: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (a.amax(1), a.amin(0), b.amax(1), b.amin(1), (b * 3).amax(0), f.amax(1), f.amin(1),
            f.sum(1), f.mean(0), torch.softmax(f, -1))


def check(name: str, fn, args: list[torch.Tensor], target: str, tol: float) -> bool:
    """``fn`` compiled vs eager: floats within ``tol`` of the largest value, the rest exact."""
    torch._dynamo.reset()
    compiled = ember.compile(fn, target=target, cache=False)
    ok, worst = True, 0.0
    for got, want in zip(compiled(*args), fn(*args)):
        if got.dtype != want.dtype or got.shape != want.shape:
            ok = False
        elif want.dtype.is_floating_point:
            nan = want.isnan()
            ok &= torch.equal(got.isnan(), nan)  # NaN where eager has NaN, nowhere else
            got, want = got.float()[~nan], want.float()[~nan]
            err = (got - want).abs().max().item() if want.numel() else 0.0
            worst = max(worst, err)
            ok &= err <= tol * (1 + want.abs().max().item())
        else:
            ok &= torch.equal(got, want)
    graphs = compiled._ember_backend.log.graphs
    kernels = sum(g.kernels for g in graphs)
    print(f"{name:<34}{kernels:>8}{worst:>12.2e}  {'ok' if ok else 'DIFFERS'}")
    return ok


def main() -> int:
    interpret = "--interpret" in sys.argv  # the same cases on CPU through Triton's interpreter
    if not interpret and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    os.environ["EMBER_STRICT"] = "1"
    target = "triton-interpret" if interpret else "triton"
    print(f"{'case':<34}{'kernels':>8}{'max err':>12}  result")
    dev = torch.device("cpu" if interpret else "cuda")
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        args = [torch.randn(64, 257, device=dev).to(dtype) for _ in range(3)]
        ok &= check(f"pointwise {dtype}", pointwise, args, target,
                    # half floats: eager rounds after every op, Ember once at the end
                    1e-5 if dtype == torch.float32 else 5e-2)
    for looped in (False, True):
        # tiny blocks: the looped path on small rows
        blocks = config.patch(persistent_rblock_max=16, loop_rblock=8) if looped else contextlib.nullcontext()
        a = torch.rand(33, 300, device=dev) > 0.7
        a[1], a[2] = False, True
        b = torch.randint(-100, 100, (33, 300), device=dev).to(torch.int8)
        f = torch.randn(33, 300, device=dev)
        f[3, 7] = float("nan")
        with blocks:
            ok &= check(f"reductions {'looped' if looped else 'persistent'}", reductions, [a, b, f], target, 1e-5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
