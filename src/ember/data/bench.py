"""``ember bench --data``: a real JPEG input pipeline feeding a training loop, with and without
``ember.data.prefetch``, and the starvation doctor's verdict on each.

JPEG files are written to a temporary folder (``torchvision.io.encode_jpeg``), decoded per item
by a DataLoader (``torchvision.io.decode_jpeg``, ``--workers`` processes), and a model trains on
them: resnet50 at 224x224 on a GPU (bf16 autocast), resnet18 at 64x64 on a CPU (``--small`` gives
64x64 on a GPU too). The plain loop copies and normalises each batch itself, as a typical script
does; the prefetched loop lets ``ember.data.prefetch`` pin, copy ahead and normalise on the device.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from ember.data.doctor import doctor
from ember.data.jpeg_folder import JpegFolder, make_jpeg_folder
from ember.data.prefetch import prefetch

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # ImageNet statistics in uint8 units
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
CLASSES = 10


def _build_model(device: torch.device, small: bool, backend: str) -> tuple[torch.nn.Module, Any, str]:
    import torchvision

    name = "resnet50" if device.type == "cuda" else "resnet18"
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=CLASSES).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    run = model
    if backend == "ember":
        import ember

        run = ember.compile(model)
    elif backend == "inductor":
        run = torch.compile(model)
    return model, run, name


def _train_loop(batches: Any, model: torch.nn.Module, run: Any, device: torch.device, precision: str,
                prepare: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    for x, y in batches:
        x, y = prepare(x, y)
        with autocast:
            loss = torch.nn.functional.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_data_bench(args: argparse.Namespace) -> int:
    """The ``--data`` mode of ``ember bench``; returns the exit code."""
    from ember.bench import harness, report

    device = harness.resolve_device(args.device)
    precision = harness.resolve_precision(args.precision, device)
    backends = [b for v in (args.backend or []) for b in v.split(",") if b] or ["eager"]
    backend = backends[0]
    if backend not in ("eager", "ember", "inductor"):
        print(f"ember: bench --data runs one of eager, ember, inductor; got {backend!r}")
        return 2
    small = args.small or device.type == "cpu"
    size = 64 if small else 224
    batch = int(args.batch[0].split(",")[0]) if args.batch else (8 if device.type == "cpu" else 64)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cpu" else 10)
    iters = args.iters if args.iters is not None else 30
    workers = args.workers
    cuda = device.type == "cuda"
    steps = warmup + iters + 1  # +1: a pass's first step is reported apart by the doctor
    env = report.env_info()
    print(f"ember bench --data on {env['device']} | {precision} | backend {backend} | batch {batch} | "
          f"{args.jpeg_size or size}px JPEG -> {size}x{size} | workers {workers} | {iters} timed steps after {warmup} warm-up", flush=True)
    rows: list[dict[str, Any]] = []
    reports: dict[str, Any] = {}
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    inv_std = 1 / torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def prepare_plain(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(device, non_blocking=True).float().sub_(mean).mul_(inv_std)
        if cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(device, non_blocking=True)

    with tempfile.TemporaryDirectory(prefix="ember-jpeg-") as folder:
        t0 = time.perf_counter()
        jpeg_size = args.jpeg_size or size
        paths = make_jpeg_folder(folder, batch * steps, jpeg_size)
        print(f"wrote {len(paths)} JPEG files in {time.perf_counter() - t0:.1f} s", flush=True)
        dataset = JpegFolder(paths, CLASSES, size)
        model, run, name = _build_model(device, small, backend)
        # Warm the model (allocator, library kernels, a compile) before either loop is timed, so
        # the loop measured first does not pay for it.
        warm_x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
        warm_y = torch.arange(batch) % CLASSES
        _train_loop([(warm_x, warm_y)] * max(warmup, 1), model, run, device, precision, prepare_plain)
        for mode in ("plain", "prefetch"):
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers, pin_memory=cuda,
                                                 persistent_workers=workers > 0, drop_last=True)
            source: Any = loader
            prepare = prepare_plain
            if mode == "prefetch":
                source = prefetch(loader, device, depth=args.depth, dtype=torch.float32, normalize=(MEAN, STD),
                                  channels_last=cuda)
                prepare = lambda x, y: (x, y)  # noqa: E731 - on the device, normalised already
            doc = doctor(source, warmup=warmup)
            t0 = time.perf_counter()
            _train_loop(doc, model, run, device, precision, prepare)
            wall = time.perf_counter() - t0
            rep = doc.report()
            reports[mode] = rep
            rows.append({"loop": mode, "model": name, "step_ms": rep.step_ms, "wait_ms": rep.wait_ms,
                         "compute_ms": rep.compute_ms, "wait_share": rep.wait_share, "verdict": rep.verdict,
                         "steps": rep.steps, "wall_s": wall})
            del loader, source, doc
    _print(rows, reports)
    if args.json:
        report.write_json(args.json, rows, env=env, config={
            "data": True, "device": str(device), "precision": precision, "backend": backend, "batch": batch,
            "image_size": size, "jpeg_size": args.jpeg_size or size, "workers": workers, "depth": args.depth, "warmup": warmup, "iters": iters,
            "reports": {k: v.to_dict() for k, v in reports.items()}})
        print(f"results written to {args.json}")
    return 0


def _print(rows: list[dict[str, Any]], reports: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    table = Table(title="ember bench --data: step time with and without ember.data.prefetch", header_style="bold")
    for col in ("loop", "model", "step ms (median)", "waiting ms", "compute ms", "waiting share", "verdict"):
        table.add_column(col, justify="left" if col in ("loop", "model", "verdict") else "right")
    for r in rows:
        table.add_row(r["loop"], r["model"], f"{r['step_ms']:.2f}", f"{r['wait_ms']:.2f}", f"{r['compute_ms']:.2f}",
                      f"{100 * r['wait_share']:.1f}%", r["verdict"])
    console.print(table)
    if len(rows) == 2 and rows[1]["step_ms"] > 0:
        console.print(f"prefetch vs plain step time: {rows[0]['step_ms'] / rows[1]['step_ms']:.2f}x "
                      f"(medians {rows[0]['step_ms']:.2f} -> {rows[1]['step_ms']:.2f} ms)")
    console.print("\n[bold]doctor, plain loop[/bold]")
    console.print(reports["plain"])
    console.print("\n[bold]doctor, prefetched loop[/bold]")
    console.print(reports["prefetch"])
