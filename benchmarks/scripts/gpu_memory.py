"""Peak GPU memory of a training (or inference) step, one fresh process per model and backend.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_memory.py resnet50 vgg16 --backends eager,ember,ember-nographs \\
        --json $OUT/memory.json

In one process, an earlier backend's cached blocks (and Ember's CUDA-graph pools, which live as
long as the compiled model) would count towards the next backend's reserved peak; a process each
keeps every row clean. Each child runs the benchmark's bf16 training step (SGD with momentum) for
5 warm-up steps (their peak, CUDA-graph captures included, is ``peak_allocated_from_start``),
resets the peak counters, runs 5 more, and reports:

- ``peak_allocated``: ``torch.cuda.max_memory_allocated``. CUDA-graph replays allocate nothing,
  so for Ember it misses the graphs' pool; not comparable on its own.
- ``peak_reserved``: ``torch.cuda.max_memory_reserved``, the comparable figure: eager's caching
  allocator and Ember's graph pools both count.
- ``pools``: the reserved and active bytes of each memory pool at the end (the default pool and
  each CUDA-graph pool), from ``torch.cuda.memory_snapshot``: reserved minus active in a graph
  pool is memory the captured graphs never use at the same time (fragmentation).
- ``state``: bytes of parameters, gradients and momentum buffers, which every backend holds.

``ember-nographs`` is Ember with ``EMBER_CUDAGRAPHS=0``. ``--trace ember`` records every
allocation of the first five steps and lists the blocks live at the highest point by the
Python line that allocated them (for Ember: the generated program's line, which names its op).
"""

from __future__ import annotations

import argparse
import os
import sys

from fresh_process import child_result, fresh_caches, write_rows

CHILD = r"""
import json, sys, torch
from ember.bench import harness, models
name, backend, mode, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
device = torch.device("cuda")
case = models.get_case(name)
torch.manual_seed(0)
model = case.build(False).to(device).train(mode == "train")
batches = models.make_batches(case, batch or case.default_batch(mode), device, count=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if mode == "train" else None
step, fn = harness._backend_step(case, backend, model, mode, "bf16", device, optimizer)
if fn is None:  # a backend with a step of its own (ember-whole-step)
    fn = step
trace = len(sys.argv) > 5
if trace:
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=400000)
torch.cuda.reset_peak_memory_stats()
for i in range(5):
    step(*batches[i % 2])
torch.cuda.synchronize()
peak_all = torch.cuda.max_memory_allocated()
live_at_peak = []
if trace:
    import linecache
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, best, best_set = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_set = total, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    by_site = {}
    for e in best_set.values():
        frames = [f for f in e.get("frames", []) if "/torch/" not in f["filename"]
                  and not f["filename"].endswith(("runner.py", "rules.py"))]
        f = frames[0] if frames else (e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}])[0]
        code = linecache.getline(f["filename"], f["line"]).strip()[:140]
        key = f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}: {code}"
        by_site[key] = by_site.get(key, 0) + e["size"]
    live_at_peak = sorted(by_site.items(), key=lambda kv: -kv[1])[:40]
    print(f"TRACE peak live {best / 2**20:.0f} MiB over {len(best_set)} blocks (traced from before the first step)")
    for k, v in live_at_peak[:25]:
        print(f"TRACE {v / 2**20:9.1f} MiB  {k}")
torch.cuda.reset_peak_memory_stats()
for i in range(5):
    step(*batches[i % 2])
torch.cuda.synchronize()
pools = {}
for seg in torch.cuda.memory_snapshot():
    key = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else str(tuple(seg["segment_pool_id"]))
    p = pools.setdefault(key, {"segments": 0, "reserved": 0, "active": 0})
    p["segments"] += 1
    p["reserved"] += seg["total_size"]
    p["active"] += seg["active_size"]
notes = []
if trace:  # the default pool's inactive blocks at the end, largest first, with their last allocation
    free = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "inactive":
                fr = [f for f in b.get("frames", []) if "/torch/" not in f["filename"]][:2]
                free.append((b["size"], seg["total_size"], seg["active_size"],
                             "; ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in fr)))
    notes += [f"inactive {size / 2**20:8.1f} MiB in a {seg_size / 2**20:.0f} MiB segment ({seg_active / 2**20:.1f} "
              f"active): {where}" for size, seg_size, seg_active, where in sorted(free, reverse=True)[:12]]
    notes.append("default-pool blocks by state: " + json.dumps({st: sum(b["size"] for seg in torch.cuda.memory_snapshot()
                 if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) for b in seg.get("blocks", [])
                 if b.get("state") == st) for st in ("active_allocated", "active_pending_free", "inactive")}))
    for seg in torch.cuda.memory_snapshot():  # every graph pool's segments and their blocks
        pool_id = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool_id == (0, 0):
            continue
        blocks = sorted(((b["size"], b.get("state", "?")) for b in seg.get("blocks", [])), reverse=True)[:6]
        notes.append(f"pool {pool_id} segment {seg['total_size'] / 2**20:.1f} MiB ({seg['active_size'] / 2**20:.1f} "
                     f"active), largest blocks: " + ", ".join(f"{sz / 2**20:.1f} {st}" for sz, st in blocks))
    if hasattr(fn, "_ember_backend"):
        notes += [f"graph {g.title}: {g.cudagraph}" for g in fn._ember_backend.log.graphs]
if getattr(getattr(fn, "_ember_backend", None), "whole_call", None) is not None:  # replayed, or why not
    notes.append(f"whole call: {fn._ember_backend.whole_call.describe()[:400]}")
if hasattr(step, "whole_step"):  # what the whole-step program did (captured, or why not)
    notes.append(f"whole step: {step.whole_step.status}")
params = sum(p.numel() * p.element_size() for p in model.parameters())
momentum = sum(v.numel() * v.element_size() for s in (optimizer.state.values() if optimizer else ())
               for v in s.values() if torch.is_tensor(v) and v.is_cuda)
print("RESULT " + json.dumps({"peak_allocated": torch.cuda.max_memory_allocated(), "peak_allocated_from_start": peak_all,
      "live_at_peak": live_at_peak, "notes": notes,
      "peak_reserved": torch.cuda.max_memory_reserved(), "pools": pools,
      "state": {"params": params, "momentum": momentum}}))
"""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet50", "vgg16", "bert"])
    parser.add_argument("--backends", default="eager,ember")
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--batch", type=int, default=0, help="batch size (default: the model's for the mode)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default="", help="comma-separated backends whose allocations are traced from the "
                        "first step: the blocks live at the peak, by allocation site")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<14}{'backend':<16}{'peak alloc MiB':>15}{'peak rsv MiB':>13}  pools (reserved / active MiB)")
    for name in args.models:
        for backend in args.backends.split(","):
            extra = {"EMBER_CUDAGRAPHS": "0"} if backend == "ember-nographs" else {}
            with fresh_caches(**extra) as env:
                traced = ["trace"] if backend in args.trace.split(",") else []
                # ember-nographs is Ember with the environment above; every other name is the
                # bench's backend itself (ember-whole-step ran as plain ember here before).
                child_backend = "ember" if backend == "ember-nographs" else backend
                r, stderr = child_result(CHILD, [name, child_backend, args.mode, str(args.batch), *traced], env)
            if r is None:
                print(f"{name:<14}{backend:<16}ERROR {stderr[-600:]}", flush=True)
                rows.append({"model": name, "backend": backend, "error": stderr[-3000:]})
                continue
            rows.append({"model": name, "backend": backend, "mode": args.mode, "batch": args.batch or None, **r})
            pools = "; ".join(f"{k}: {_mib(p['reserved'])} / {_mib(p['active'])}" for k, p in r["pools"].items())
            print(f"{name:<14}{backend:<16}{_mib(r['peak_allocated']):>15}{_mib(r['peak_reserved']):>13}  {pools}; "
                  f"peak allocated from the first step (captures included) {_mib(r['peak_allocated_from_start'])}",
                  flush=True)
            for site, size in r["live_at_peak"][:20]:
                print(f"    {_mib(size):>8} MiB live at the peak: {site}")
            for note in r.get("notes", []):
                print(f"    {note}")
    return write_rows(args.json, rows)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    sys.exit(main())
