"""Where the time goes: torch.profiler over a few steps of a model under one backend.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_profile.py resnet50 --backend ember,inductor --out $OUT/profile

For each model and backend: GPU time per step, kernel launches per step, the share of GPU
time in library kernels (cuBLAS/cuDNN/flash), generated Triton kernels and other ATen
kernels, and the top kernels. Writes a table per run and a Chrome trace under ``--out``.

``--keep N`` keeps N kernels per run in the JSON (all: 0). For generated Triton kernels the JSON
also gives the bytes of the tensors each was launched with (recorded at its first launch, which
is uncaptured) and the GB/s that makes at its profiled time: an upper bound of what it moves
(a split reduction's combining kernel is handed tensors it does not read), to set against the
device's copy bandwidth. ``EMBER_DEBUG_DIR`` set: Ember's kernel sources land there.
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


# Ember's hand-written Triton kernels (ops/window_kernels.py) count as generated code.
EMBER_WINDOW_KERNELS = ("max_pool2d_forward", "max_pool2d_backward", "reflection_pad2d_forward",
                        "reflection_pad2d_backward")


def kernel_family(name: str) -> str:
    low = name.lower()
    if low.startswith(("triton", "ember_", "k_") + EMBER_WINDOW_KERNELS) or "triton" in low:
        return "generated"
    if any(m in low for m in LIBRARY_MARKS):
        return "library"
    return "aten"


_ARG_BYTES: dict[str, int] = {}


def record_arg_bytes() -> None:
    """Note, at each Triton kernel's first launch, the bytes of the tensors it is handed (each
    storage once)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, **kwargs):
        name = getattr(self, "__name__", None) or self.fn.__name__
        if name not in _ARG_BYTES:
            sizes: dict[int, int] = {}
            for a in args:
                if isinstance(a, torch.Tensor):
                    key = a.untyped_storage().data_ptr()
                    sizes[key] = max(sizes.get(key, 0), a.numel() * a.element_size())
            _ARG_BYTES[name] = sum(sizes.values())
        return original(self, *args, **kwargs)

    JITFunction.run = run


def profile_case(name: str, backend: str, mode: str, steps: int, out: Path, trace: bool = True,
                 keep: int = 25, batch: int | None = None, sequence: bool = False) -> dict:
    device = torch.device("cuda")
    case = models.get_case(name)
    torch.manual_seed(0)
    model = case.build(False).to(device).train(mode == "train")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if mode == "train" else None
    step, _ = harness._backend_step(case, backend, model, mode, "bf16", device, opt)  # whole-step backends too
    batches = models.make_batches(case, batch or case.default_batch(mode), device, count=2)
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
    timeline: list[tuple[float, str, float]] = []
    for evt in prof.events():
        # GPU-side ranges of record_function (the optimizer's "Optimizer.step#SGD.step") span kernels
        # counted on their own: counting them too would add the step's optimizer time twice.
        if getattr(evt, "is_user_annotation", False) or (evt.name or "").startswith("Optimizer."):
            continue
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.name and not evt.name.startswith("Memcpy"):
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            kernels.setdefault(evt.name, []).append(us)
            timeline.append((evt.time_range.start, evt.name, us))
    total = sum(sum(v) for v in kernels.values())
    fam: dict[str, float] = {}
    for k, v in kernels.items():
        fam[kernel_family(k)] = fam.get(kernel_family(k), 0.0) + sum(v)
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:keep or None]
    if sequence:  # the last step's kernels in launch order: one row per launch, to line up two backends
        per_step = len(timeline) // steps
        last = sorted(timeline)[-per_step:]
        (out / f"sequence_{name}_{mode}_{backend}.json").write_text(json.dumps(
            [{"kernel": k, "us": round(us, 2), "family": kernel_family(k)} for _, k, us in last]))
    return {
        "model": name, "backend": backend, "mode": mode,
        "gpu_ms_per_step": total / 1e3 / steps,
        "launches_per_step": sum(len(v) for v in kernels.values()) / steps,
        "share": {k: 100 * v / total for k, v in fam.items()},
        "family_ms_per_step": {k: v / 1e3 / steps for k, v in fam.items()},
        "top": [{"kernel": k[:140], "family": kernel_family(k), "ms_per_step": sum(v) / 1e3 / steps,
                 "calls_per_step": len(v) / steps, **_bandwidth(k, v)} for k, v in top],
    }


def _bandwidth(kernel: str, times_us: list[float]) -> dict:
    nbytes = _ARG_BYTES.get(kernel)
    if not nbytes:
        return {}
    mean_s = sum(times_us) / len(times_us) / 1e6
    return {"arg_bytes": nbytes, "arg_gb_per_s": nbytes / mean_s / 1e9 if mean_s else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,inductor")
    parser.add_argument("--mode", default="train")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's for the mode)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="profile_out")
    parser.add_argument("--keep", type=int, default=25, help="kernels kept per run in the JSON (0: all)")
    parser.add_argument("--no-trace", action="store_true", help="skip the Chrome traces (large files)")
    parser.add_argument("--sequence", action="store_true",
                        help="also write the last step's kernels in launch order (sequence_*.json)")
    args = parser.parse_args()
    record_arg_bytes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        for backend in args.backend.split(","):
            r = profile_case(name, backend, args.mode, args.steps, out, trace=not args.no_trace, keep=args.keep, batch=args.batch,
                             sequence=args.sequence)
            rows.append(r)
            share = " ".join(f"{k} {v:.0f}%" for k, v in sorted(r["share"].items()))
            print(f"\n== {name} {args.mode} {backend}: GPU {r['gpu_ms_per_step']:.2f} ms/step, "
                  f"{r['launches_per_step']:.0f} launches/step, {share}")
            for t in r["top"][: args.top]:
                rate = f"{t['arg_gb_per_s']:6.0f} GB/s" if t.get("arg_gb_per_s") else " " * 11
                print(f"  {t['ms_per_step']:7.3f} ms {t['calls_per_step']:6.1f}x {t['family']:<9} {rate} {t['kernel'][:90]}")
            torch._dynamo.reset()
            (out / "profile.json").write_text(json.dumps(rows, indent=1))  # after each run: a cut-off one keeps it
    return 0


if __name__ == "__main__":
    sys.exit(main())
