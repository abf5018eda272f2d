"""Does ember.data.prefetch turn a loop's step time from data + compute into max(data, compute)?

Target: with a loader whose batches cost as much as the step, the prefetched loop's step time is
at most 1.1x max(data time, compute time). Runs on the CPU and on a GPU (device auto):

  PYTHONPATH=src python benchmarks/scripts/data_prefetch_bench.py                  # every case
  PYTHONPATH=src python benchmarks/scripts/data_prefetch_bench.py --cases sleep --steps 20 --json out.json

Cases (each measures: data alone, compute alone, the plain loop, the prefetched loop):
  sleep   the loader sleeps as long as the step takes (CPU: the step sleeps --step-ms; GPU: the step
          is a real training step, measured first, and the loader's sleep is set to it; the batch is
          a real uint8 image batch, pinned and copied by the prefetcher)
  jpeg    a DataLoader decoding JPEG files (torchvision.io.decode_jpeg, --workers processes); the
          step is calibrated to the loader's measured time per batch (CPU: a sleep; GPU: a real
          step, its batch size as given, the ratio to max(data, compute) reported as measured)
  model   (GPU, or CPU with --cpu-model) the JPEG loader feeding the real model unchanged: the ratio
          prefetched / max(data, compute) whatever the balance
On a GPU it also times one device-to-device copy of a batch (what a CUDA-graph replay's copy of
its input costs, the copy a hand-off into the graph's static buffers would save) and, with
--backend ember or ember-step, runs the model through ember.compile (CUDA graphs per compiled
graph) or ember.compile_step (the whole training step as one CUDA graph) under the prefetcher.
Every step is synchronised (the consumer stream) and timed by wall clock; median over --steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from ember.data import prefetch  # noqa: E402
from ember.data.jpeg_folder import JpegFolder, make_jpeg_folder  # noqa: E402

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Step:
    """One training step on a device batch (uint8 or float images, int labels)."""

    def __init__(self, device: torch.device, model_name: str, batch: int, size: int, backend: str,
                 sleep_ms: float | None = None) -> None:
        self.device, self.sleep_ms = device, sleep_ms
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.inv_std = 1 / torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.model = None
        if sleep_ms is None:
            import torchvision

            torch.manual_seed(0)
            model = getattr(torchvision.models, model_name)(num_classes=10).to(device)
            if device.type == "cuda":
                model = model.to(memory_format=torch.channels_last)
            self.model = model
            self.run = model
            self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            self.whole_step = None
            if backend == "ember":
                import ember

                self.run = ember.compile(model)
            elif backend == "ember-step":  # forward, backward and SGD as one program (one CUDA graph)
                import ember

                self.whole_step = ember.compile_step(
                    lambda x, y: torch.nn.functional.cross_entropy(model(x), y), optimizer=self.opt)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """What a plain loop does to a batch the prefetcher would have transformed on the device."""
        if x.dtype == torch.uint8:
            x = x.float().sub_(self.mean).mul_(self.inv_std)
        if self.device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.sleep_ms is not None:
            time.sleep(self.sleep_ms / 1e3)
            return
        assert self.model is not None
        x = self.prepare(x)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        if self.whole_step is not None:
            with autocast:
                self.whole_step(x, y)
            return
        with autocast:
            loss = torch.nn.functional.cross_entropy(self.run(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class SleepLoader:
    """``steps`` batches of real uint8 images, each after sleeping ``ms`` (a stand-in for decoding)."""

    def __init__(self, steps: int, ms: float, batch: int, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = [(torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g),
                      torch.randint(0, 10, (batch,), generator=g)) for _ in range(3)]
        self.steps, self.ms = steps, ms

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            time.sleep(self.ms / 1e3)
            yield self.pool[i % len(self.pool)]


def time_loader(loader: Any, skip: int = 1) -> list[float]:
    """Seconds per batch of iterating the loader alone."""
    times, it = [], iter(loader)
    t0 = time.perf_counter()
    for i, _ in enumerate(it):
        t1 = time.perf_counter()
        if i >= skip:
            times.append(t1 - t0)
        t0 = t1
    return times


def time_compute(step: Step, device: torch.device, batch: int, size: int, steps: int) -> list[float]:
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    times = []
    for i in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        step(x, y)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def time_loop(batches: Any, step: Step, device: torch.device, to_device: bool, skip: int = 2) -> list[float]:
    """Seconds per step of a training loop, from one step's end to the next's (data included)."""
    times = []
    sync(device)
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        if to_device:  # the plain loop's copy, as a typical script writes it
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        step(x, y)
        sync(device)
        t1 = time.perf_counter()
        if i >= skip:
            times.append(t1 - t0)
        t0 = t1
    return times


def med_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def run_case(name: str, make_loader: Any, step: Step, device: torch.device, batch: int, size: int,
             steps: int, data_ms: float | None = None) -> dict[str, Any]:
    data = med_ms(time_loader(make_loader())) if data_ms is None else data_ms
    compute = med_ms(time_compute(step, device, batch, size, steps))
    plain = med_ms(time_loop(make_loader(), step, device, to_device=True))
    pre = med_ms(time_loop(prefetch(make_loader(), device, depth=2, dtype=torch.float32 if step.model else None,
                                    normalize=(MEAN, STD) if step.model else None,
                                    channels_last=device.type == "cuda" and step.model is not None),
                           step, device, to_device=False))
    bound = max(data, compute)
    row = {"case": name, "data_ms": data, "compute_ms": compute, "plain_ms": plain, "prefetch_ms": pre,
           "max_ms": bound, "sum_ms": data + compute, "prefetch_over_max": pre / bound,
           "target_met": pre <= 1.1 * bound}
    print(f"  {name}: data {data:.2f} ms, compute {compute:.2f} ms, plain {plain:.2f}, prefetch {pre:.2f} "
          f"-> {pre / bound:.3f}x max", flush=True)
    return row


def gpu_checks(device: torch.device) -> dict[str, bool]:
    """The CUDA path's guarantees, which CI (no GPU) cannot run: every batch arrives whole (the
    consumer waits for the copy), none is overwritten while the consumer's queued work still reads
    it (record_stream), transforms match eager, the thread ends on break."""
    import gc
    import threading

    g = torch.Generator().manual_seed(0)
    host = [torch.randint(0, 256, (16, 3, 256, 256), dtype=torch.uint8, generator=g) for _ in range(24)]
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    want = [((x.float() - mean) / std).sum().item() for x in host]
    sums = []
    for x in prefetch(host, device, depth=3, dtype=torch.float32, normalize=(MEAN, STD), channels_last=True):
        torch.cuda._sleep(2_000_000)  # the consumer stream is busy: a missing wait or record_stream shows
        sums.append(x.sum())
        del x
    got = [float(s) for s in sums]
    whole = len(got) == len(want) and all(abs(a - b) <= 1e-3 * abs(b) + 1 for a, b in zip(got, want))
    raw = [int(x.sum()) for x in host]
    plain = [int(b.sum()) for b in prefetch(host, device, depth=2)]
    base = threading.active_count()
    for i, _ in enumerate(prefetch(host, device)):
        if i == 3:
            break
    gc.collect()
    time.sleep(0.2)
    checks = {"batches whole, transformed as eager (busy consumer)": whole, "untransformed batches equal": plain == raw,
              "thread ends on break": threading.active_count() == base}
    for k, v in checks.items():
        print(f"  check {k}: {'ok' if v else 'FAILED'}", flush=True)
    return checks


def d2d_copy_ms(device: torch.device, batch: int, size: int, dtype: torch.dtype) -> float:
    src = torch.randn(batch, 3, size, size, device=device).to(dtype)
    dst = torch.empty_like(src)
    for _ in range(3):
        torch._foreach_copy_([dst], [src])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch._foreach_copy_([dst], [src])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--cases", default="sleep,jpeg,model", help="comma list of sleep, jpeg, model")
    p.add_argument("--steps", type=int, default=15, help="timed steps per loop")
    p.add_argument("--step-ms", type=float, default=40.0, help="CPU: the step's sleep (sleep case)")
    p.add_argument("--batch", type=int, default=None, help="default: 64 on GPU, 8 on CPU")
    p.add_argument("--size", type=int, default=None, help="model input pixels (default 224 GPU, 64 CPU)")
    p.add_argument("--jpeg-size", type=int, default=None, help="JPEG pixels (default 256 GPU, 256 CPU)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default 8 GPU, 0 CPU)")
    p.add_argument("--backend", default="eager", choices=["eager", "ember", "ember-step"],
                   help="ember: ember.compile(model) (per-graph CUDA graphs); ember-step: ember.compile_step "
                   "(the whole training step as one CUDA graph)")
    p.add_argument("--cpu-model", action="store_true", help="CPU: also run the model case (resnet18)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    batch = args.batch or (64 if cuda else 8)
    size = args.size or (224 if cuda else 64)
    jpeg_size = args.jpeg_size or 256
    workers = args.workers if args.workers is not None else (8 if cuda else 0)
    model_name = "resnet50" if cuda else "resnet18"
    cases = [c for c in args.cases.split(",") if c]
    total = args.steps + 3  # loops skip their first two steps; the loader timing its first batch
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'} | torch {torch.__version__} | "
          f"batch {batch} | {size}px | workers {workers} | {args.steps} steps", flush=True)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}

    checks = gpu_checks(device) if cuda else {}
    real = Step(device, model_name, batch, size, args.backend) if cuda or args.cpu_model else None
    if "sleep" in cases:
        if cuda:
            assert real is not None
            step_ms = med_ms(time_compute(real, device, batch, size, args.steps))
            step = real
        else:
            step_ms = args.step_ms
            step = Step(device, model_name, batch, size, args.backend, sleep_ms=step_ms)
        rows.append(run_case(f"sleep {step_ms:.1f} ms loader", lambda: SleepLoader(total, step_ms, batch, size),
                             step, device, batch, size, args.steps))
    if "jpeg" in cases or "model" in cases:
        with tempfile.TemporaryDirectory(prefix="ember-jpeg-") as folder:
            t0 = time.perf_counter()
            paths = make_jpeg_folder(folder, batch * total, jpeg_size)
            print(f"  wrote {len(paths)} JPEG files ({jpeg_size}px) in {time.perf_counter() - t0:.1f} s", flush=True)
            ds = JpegFolder(paths, 10, size)

            def make_loader() -> torch.utils.data.DataLoader:
                return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, pin_memory=cuda,
                                                   drop_last=True)

            data_ms = med_ms(time_loader(make_loader(), skip=2))
            if "jpeg" in cases:
                step = real if cuda else Step(device, model_name, batch, size, args.backend, sleep_ms=data_ms)
                assert step is not None
                rows.append(run_case(f"jpeg decode ({workers} workers), {'model' if cuda else 'sleep'} step",
                                     make_loader, step, device, batch, size, args.steps, data_ms))
            if "model" in cases and real is not None and not cuda:
                rows.append(run_case("jpeg decode, resnet18 step", make_loader, real, device, batch, size,
                                     args.steps, data_ms))
    if cuda:
        for dtype in (torch.float32, torch.bfloat16):
            extra[f"d2d_copy_ms_{str(dtype).split('.')[-1]}"] = d2d_copy_ms(device, batch, size, dtype)

    from rich.console import Console
    from rich.table import Table

    table = Table(title="ember.data.prefetch: step time vs max(data, compute)", header_style="bold")
    for col in ("case", "data ms", "compute ms", "plain ms", "prefetch ms", "max ms", "prefetch / max", "<= 1.1x"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['data_ms']:.2f}", f"{r['compute_ms']:.2f}", f"{r['plain_ms']:.2f}",
                      f"{r['prefetch_ms']:.2f}", f"{r['max_ms']:.2f}", f"{r['prefetch_over_max']:.3f}",
                      "yes" if r["target_met"] else "NO")
    Console(width=140).print(table)
    for k, v in extra.items():
        print(f"{k}: {v:.4f} ms (one batch {batch}x3x{size}x{size}, device to device)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "batch": batch,
                                               "size": size, "workers": workers, "backend": args.backend,
                                               "steps": args.steps, "rows": rows, "checks": checks, **extra},
                                              indent=2) + "\n")
    return 0 if all(r["target_met"] for r in rows) and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
