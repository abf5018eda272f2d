"""A CUDA-graph-replayed Ember model fed by ember.data.prefetch, with and without the direct copy.

    PYTHONPATH=src python benchmarks/scripts/prefetch_into_graph_bench.py
    PYTHONPATH=src python benchmarks/scripts/prefetch_into_graph_bench.py --model resnet50 --batch 128 --mode infer

``prefetch(loader, device)`` hands out a new device tensor per batch: each replay first copies
it into the graph's input buffer (the runner's copy-in, one device-to-device copy of the batch).
``prefetch(loader, device, into=model)`` copies the batch into one of two slots that the
model's graphs read in place: no copy-in (src/ember/data/graph_inputs.py). One compiled model
runs both loops (rounds alternate, so drift hits both alike); the loader hands out host batches
that are ready at once (pinned), so the step sets the pace and the host-to-device copy runs
beside it on the prefetcher's stream.

First it checks: every step's output (inference) or loss (training, from the same weights)
equals the plain loop's, step by step, and the slots' graphs copy no batch input. Then it times
both loops: wall clock per step, the consumer stream synchronised after each step (median, p10,
p90 over --steps, after --warmup steps that cover the first calls and both slots' captures),
and one device-to-device copy of the batch (what the direct copy can save at most).
Prints a table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import ember  # noqa: E402
from ember.runtime.cudagraphs.runner import CudaGraphRunner  # noqa: E402


class HostBatches:
    """``steps`` batches cycling over ``distinct`` pinned host batches, each ready at once."""

    def __init__(self, steps: int, batch: int, size: int, dtype: torch.dtype, distinct: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        pin = torch.cuda.is_available()
        self.pool = []
        for _ in range(distinct):
            x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
            y = torch.randint(0, 10, (batch,), generator=g)
            self.pool.append((x.pin_memory() if pin else x, y.pin_memory() if pin else y))
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.pool[i % len(self.pool)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Loop:
    """The model, compiled once, and one step of it (inference, or training with SGD)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, args.model)(num_classes=10).to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        self.train = args.mode == "train"
        model.train(self.train)
        self.model, self.device = model, device
        self.compiled = ember.compile(model)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if self.train else None
        self.amp = args.amp and device.type == "cuda"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            if not self.train:
                with torch.no_grad():
                    return self.compiled(x).float().sum()
            loss = torch.nn.functional.cross_entropy(self.compiled(x), y)
        loss.backward()
        assert self.opt is not None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state(self) -> Any:
        return copy.deepcopy((self.model.state_dict(), self.opt.state_dict() if self.opt else None))

    def restore(self, state: Any) -> None:
        with torch.no_grad():  # in place: the graphs read the parameters where they are
            for k, v in self.model.state_dict().items():
                v.copy_(state[0][k])
        if self.opt is not None:
            self.opt.load_state_dict(state[1])

    def copied_in(self, fetcher: Any = None) -> tuple[int, int]:
        """(inputs the parent runners copy in per replay, inputs the slot runners copy in)."""
        parents = [g.run for _, g in self.compiled._ember_backend.programs if isinstance(g.run, CudaGraphRunner)]
        plain = sum(len(r.g.dynamic_idx) for r in parents if r.g is not None)
        children = fetcher.router.children.values() if fetcher is not None and fetcher.router else []
        return plain, sum(len(c.g.dynamic_idx) for c in children if c.g is not None and c.title.endswith("slot 0]"))


def run_loop(loop: Loop, fetcher: Any, warmup: int) -> tuple[list[float], list[float]]:
    """(seconds per timed step, each step's value) of one pass over ``fetcher``."""
    times, values = [], []
    sync(loop.device)
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(fetcher):
        values.append(loop.step(x, y))
        sync(loop.device)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
        t0 = t1
    return times, [float(v) for v in values]


def d2d_copy_ms(x: torch.Tensor) -> float:
    dst = torch.empty_like(x)
    for _ in range(3):
        torch._foreach_copy_([dst], [x])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        torch._foreach_copy_([dst], [x])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return 1e3 * s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--mode", default="train", choices=["train", "infer"])
    p.add_argument("--batch", type=int, default=None, help="default: 128 (GPU), 2 (CPU)")
    p.add_argument("--size", type=int, default=None, help="input pixels (default 224 GPU, 32 CPU)")
    p.add_argument("--input-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 instead of bf16 autocast")
    p.add_argument("--steps", type=int, default=60, help="timed steps per pass")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each pass")
    p.add_argument("--rounds", type=int, default=3, help="passes per loop, alternating")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    gpu = device.type == "cuda"
    batch = args.batch or (128 if gpu else 2)
    size = args.size or (224 if gpu else 32)
    dtype = getattr(torch, args.input_dtype)
    if not gpu:
        print("no GPU: the loops run without CUDA graphs (nothing to route); this only checks the script")
    loop = Loop(args, device)
    n = args.warmup + args.steps

    # -- check: same values step by step, from the same weights --------------------------------
    start = loop.state()
    _, want = run_loop(loop, ember.data.prefetch(HostBatches(n, batch, size, dtype), device), n)
    loop.restore(start)
    direct = ember.data.prefetch(HostBatches(n, batch, size, dtype), device, into=loop.compiled)
    _, got = run_loop(loop, direct, n)
    tol = 2e-2 if loop.amp else 1e-3
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got, want))
    plain_copies, slot_copies = loop.copied_in(direct)
    checks = {"same values step by step (direct vs plain)": len(got) == len(want) and worst <= tol,
              "slot graphs copy fewer inputs than the plain ones": not gpu or slot_copies < plain_copies}
    print(f"check: {len(got)} steps, worst relative difference {worst:.2e} (tolerance {tol}); inputs copied "
          f"in per replay: plain graphs {plain_copies}, slot graphs {slot_copies}")
    print(f"check: {direct.slots.describe() if direct.slots else 'no slots'}")
    for name, ok in checks.items():
        print(f"  {name}: {'ok' if ok else 'FAILED'}")

    # -- timing --------------------------------------------------------------------------------
    times: dict[str, list[float]] = {"plain": [], "direct": []}
    for r in range(args.rounds):
        for name in ("plain", "direct") if r % 2 == 0 else ("direct", "plain"):
            fetcher = direct if name == "direct" else ember.data.prefetch(HostBatches(n, batch, size, dtype), device)
            if name == "direct":  # the same prefetcher each pass: the same slots, no new capture
                direct.loader = HostBatches(n, batch, size, dtype, seed=r + 1)
            times[name] += run_loop(loop, fetcher, args.warmup)[0]
    copy_ms = d2d_copy_ms(torch.randn(batch, 3, size, size, device=device).to(dtype)) if gpu else float("nan")
    rows = []
    for name, ts in times.items():
        rows.append({"loop": name, "median_ms": 1e3 * statistics.median(ts), "p10_ms": pct(ts, 0.1),
                     "p90_ms": pct(ts, 0.9), "steps": len(ts)})
    base = rows[0]["median_ms"]
    title = f"{args.model} {args.mode} bs{batch} {size}px, input {args.input_dtype}, {'bf16 autocast' if loop.amp else 'fp32'}"
    print(f"\n{title}; {torch.cuda.get_device_name(device) if gpu else 'cpu'}, torch {torch.__version__}")
    print(f"{'loop':<8} {'median ms':>10} {'p10':>8} {'p90':>8} {'vs plain':>9} {'steps':>6}")
    for row in rows:
        print(f"{row['loop']:<8} {row['median_ms']:>10.3f} {row['p10_ms']:>8.3f} {row['p90_ms']:>8.3f} "
              f"{row['median_ms'] / base:>9.4f} {row['steps']:>6}")
    print(f"one device-to-device copy of the batch: {copy_ms:.4f} ms (the most the direct copy can save)")
    if gpu:
        print(f"peak reserved {torch.cuda.max_memory_reserved(device) / 2**20:,.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "rows": rows, "d2d_copy_ms": copy_ms, "checks": checks,
                                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                               "device": torch.cuda.get_device_name(device) if gpu else "cpu"},
                                              indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
