"""Where the time goes: torch.profiler over a few steps of a model under one backend.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/gpu_profile.py resnet50 --backend ember,inductor --out $OUT/profile

For each model and backend: GPU time per step, kernel launches per step, the share of GPU
time in library kernels (cuBLAS/cuDNN/flash), generated Triton kernels and other ATen
kernels, and the top kernels. Writes a table per run and a Chrome trace under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ember.bench import harness, models

LIBRARY_MARKS = ("gemm", "cutlass", "cudnn", "sm90", "sm80", "flash", "xmma", "cublas", "nchwtonhwc",
                 "nhwctonchw", "implicit_convolve", "conv", "wgrad", "dgrad", "fmha")


def kernel_family(name: str) -> str:
    low = name.lower()
    if low.startswith(("triton", "ember_", "k_")) or "triton" in low:
        return "generated"
    if any(m in low for m in LIBRARY_MARKS):
        return "library"
    return "aten"


def profile_case(name: str, backend: str, mode: str, steps: int, out: Path, trace: bool = True) -> dict:
    device = torch.device("cuda")
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).train(mode == "train")
    fn = harness.BACKENDS[backend](model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if mode == "train" else None
    step = harness._make_step(case, fn, mode, "bf16", device, opt)
    batches = models.make_batches(case, case.default_batch(mode), device, count=2)
    for i in range(5):
        step(*batches[i % 2])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(*batches[i % 2])
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(out / f"trace_{name}_{mode}_{backend}.json"))
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.name and not evt.name.startswith("Memcpy"):
            kernels.setdefault(evt.name, []).append(evt.device_time_total if hasattr(evt, "device_time_total")
                                                    else evt.cuda_time_total)
    total = sum(sum(v) for v in kernels.values())
    fam: dict[str, float] = {}
    for k, v in kernels.items():
        fam[kernel_family(k)] = fam.get(kernel_family(k), 0.0) + sum(v)
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "model": name, "backend": backend, "mode": mode,
        "gpu_ms_per_step": total / 1e3 / steps,
        "launches_per_step": sum(len(v) for v in kernels.values()) / steps,
        "share": {k: 100 * v / total for k, v in fam.items()},
        "top": [{"kernel": k[:140], "family": kernel_family(k), "ms_per_step": sum(v) / 1e3 / steps,
                 "calls_per_step": len(v) / steps} for k, v in top],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,inductor")
    parser.add_argument("--mode", default="train")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="profile_out")
    parser.add_argument("--no-trace", action="store_true", help="skip the Chrome traces (large files)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        for backend in args.backend.split(","):
            r = profile_case(name, backend, args.mode, args.steps, out, trace=not args.no_trace)
            rows.append(r)
            share = " ".join(f"{k} {v:.0f}%" for k, v in sorted(r["share"].items()))
            print(f"\n== {name} {args.mode} {backend}: GPU {r['gpu_ms_per_step']:.2f} ms/step, "
                  f"{r['launches_per_step']:.0f} launches/step, {share}")
            for t in r["top"][: args.top]:
                print(f"  {t['ms_per_step']:7.3f} ms {t['calls_per_step']:6.1f}x {t['family']:<9} {t['kernel'][:100]}")
            torch._dynamo.reset()
        (out / "profile.json").write_text(json.dumps(rows, indent=1))  # after each model: a cut-off run keeps it
    return 0


if __name__ == "__main__":
    sys.exit(main())
