"""CPU kernel families: Ember's generated numba kernels vs ATen eager vs Inductor (torch.compile).

Run from the repo root:
    python benchmarks/scripts/cpu_kernel_bench.py --json benchmarks/cpu_kernel_bench_<date>.json
    python benchmarks/scripts/cpu_kernel_bench.py --only softmax,layer        # a subset (substring match)

Each case is one small function at a CPU shape of the seed models: batch 1 inference
(BERT-base seq 128, MobileNetV3 at 224) and ResNet-18 training at batch 8 (224x224). Time per
call: the compiled function (Dynamo guards, program and allocation included, as a model sees
them) in short timed loops, 15 of them; "ms" is the fastest loop (other processes on a shared
2-core machine only ever add time) and "median ms" the median. GB/s counts the minimum traffic:
every input read once and every output written once. The first call of each compiled
function is reported as its compile time (for Ember: Dynamo + AOTAutograd + numba, on an empty
kernel cache unless --warm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ember


def _pointwise_chain(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 0.5 + b) + r


def _gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def _hardswish(x: torch.Tensor) -> torch.Tensor:
    return F.hardswish(x * 1.0)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 0.125, dim=-1)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _bn_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    return mean, var


def _bn_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.relu(F.batch_norm(x, None, None, w, b, training=True))


def _column_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=0)


def cases() -> list[tuple[str, str, Callable, tuple]]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape)

    return [
        ("pointwise chain", "bert bs1 128x768", _pointwise_chain, (t(128, 768), t(768), t(128, 768))),
        ("pointwise chain", "resnet18 bs8 8x64x56x56", _pointwise_chain, (t(8, 64, 56, 56), t(64, 1, 1), t(8, 64, 56, 56))),
        ("gelu", "bert bs1 128x3072", _gelu, (t(128, 3072), t(3072))),
        ("hardswish", "mobilenet bs1 1x16x112x112", _hardswish, (t(1, 16, 112, 112),)),
        ("softmax", "bert bs1 12x128x128", _softmax, (t(1, 12, 128, 128),)),
        ("layer norm 768", "bert bs1 128x768", _layer_norm, (t(128, 768), t(768), t(768))),
        ("layer norm 768", "bert bs8 1024x768", _layer_norm, (t(1024, 768), t(768), t(768))),
        ("bn statistics N,H,W", "resnet18 bs8 8x64x56x56", _bn_stats, (t(8, 64, 56, 56),)),
        ("bn statistics N,H,W", "resnet18 bs8 8x512x7x7", _bn_stats, (t(8, 512, 7, 7),)),
        ("bn+relu (train)", "resnet18 bs8 8x64x112x112", _bn_relu, (t(8, 64, 112, 112), t(64), t(64))),
        ("bn+relu (train)", "resnet18 bs8 8x128x28x28", _bn_relu, (t(8, 128, 28, 28), t(128), t(128))),
        ("column sum (bias grad)", "bert bs8 1024x768", _column_sum, (t(1024, 768),)),
    ]


def _nbytes(args: tuple, out: object) -> int:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(a.numel() * a.element_size() for a in args) + sum(o.numel() * o.element_size() for o in outs)


def _time_ms(fn: Callable, args: tuple, loop_s: float = 0.02, repeats: int = 15) -> tuple[float, float]:
    """(fastest, median) milliseconds per call over ``repeats`` loops of ~``loop_s`` seconds."""
    fn(*args)
    n = 1
    while True:  # calibrate the loop length
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        if time.perf_counter() - start > loop_s or n >= 1 << 16:
            break
        n *= 2
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        samples.append((time.perf_counter() - start) / n * 1e3)
    return min(samples), statistics.median(samples)


def _compiled(kind: str, fn: Callable, cache_dir: str | None) -> Callable:
    torch._dynamo.reset()
    if kind == "ember":
        return ember.compile(fn, target="cpu", **({"cache_dir": cache_dir} if cache_dir else {}))
    return torch.compile(fn)


def _check(got: object, want: object) -> float:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return max(float((g - w).abs().max() / (w.abs().max() + 1e-12)) for g, w in zip(got, want))


def environment(load_at_start: tuple | None = None) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import numba
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
            "torch threads": torch.get_num_threads(), "torch": torch.__version__, "numba": numba.__version__,
            "numba threading layer": _threading_layer(), "python": platform.python_version(),
            "load average (1, 5, 15 min) at start": load_at_start, "load average at end": os.getloadavg()}


def _threading_layer() -> str:
    import numba
    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="comma list of substrings of family names")
    ap.add_argument("--backends", default="eager,ember,inductor")
    ap.add_argument("--warm", action="store_true", help="keep Ember's kernel cache between runs")
    args = ap.parse_args(argv)
    cache_dir = None if args.warm else tempfile.mkdtemp(prefix="ember-cpu-bench-")
    backends = args.backends.split(",")
    load_at_start = os.getloadavg()
    rows = []
    print(f"{'family':24s} {'shape':28s} " + " ".join(f"{b + ' ms':>11s} {b + ' GB/s':>11s}" for b in backends)
          + "  compile s (ember / inductor)")
    for family, shape, fn, inputs in cases():
        if args.only and not any(s in family for s in args.only.split(",")):
            continue
        want = fn(*inputs)
        row = {"family": family, "shape": shape, "bytes": _nbytes(inputs, want)}
        for b in backends:
            f = fn if b == "eager" else _compiled(b, fn, cache_dir)
            start = time.perf_counter()
            got = f(*inputs)
            if b != "eager":
                row[f"{b} compile s"] = round(time.perf_counter() - start, 3)
                row[f"{b} max rel err"] = _check(got, want)
            ms, median = _time_ms(f, inputs)
            row[f"{b} ms"] = round(ms, 4)
            row[f"{b} median ms"] = round(median, 4)
            row[f"{b} GB/s"] = round(row["bytes"] / ms / 1e6, 2)
        rows.append(row)
        print(f"{family:24s} {shape:28s} " + " ".join(f"{row[b + ' ms']:11.4f} {row[b + ' GB/s']:11.2f}" for b in backends)
              + f"  {row.get('ember compile s', '-')} / {row.get('inductor compile s', '-')}", flush=True)
    result = {"environment": environment(load_at_start), "cases": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
