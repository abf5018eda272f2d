"""Whether a compiled model's GPU memory goes back when the model is dropped.

    PYTHONPATH=src python benchmarks/scripts/gpu_memory_release.py resnet50 --backend ember,ember-whole-step

For each model and backend: a few training (or inference) steps of the bench's step inside a
function (``gpu_host_profile.bench_step``: bf16, SGD with momentum), then the model, optimizer and step dropped, ``torch._dynamo.reset()``, ``gc.collect()``
and ``torch.cuda.empty_cache()``; prints the memory still reserved and allocated, the allocator's
segments still held by pool, and the live objects that can hold device memory (CUDA graphs,
Ember's runners and pools, CUDA tensors) with a chain of what refers to the first of each kind.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import types
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_host_profile import bench_step  # noqa: E402 - the sibling script's step of a bench model

MiB = 2**20


def _run(name: str, backend: str, mode: str, steps: int) -> None:
    step, batches = bench_step(name, backend, mode)
    for i in range(steps):
        step(*batches[i % 2])
    torch.cuda.synchronize()


def _holders(obj: object, skip: set[int], depth: int = 6) -> list[str]:
    """Types along one chain of referrers of ``obj`` (frames, huge lists and ``skip`` left out)."""
    chain = []
    seen = {id(obj), *skip}
    for _ in range(depth):
        found = None
        for r in gc.get_referrers(obj):
            if id(r) in seen or isinstance(r, types.FrameType) or r is globals() \
                    or (isinstance(r, list) and len(r) > 1000):
                continue
            found = r
            break
        if found is None:
            break
        obj = found
        seen.add(id(obj))
        label = type(obj).__name__
        if isinstance(obj, dict):
            label += "{" + ", ".join(map(str, list(obj)[:4])) + "}"
        elif hasattr(obj, "__qualname__"):
            label += f" {obj.__qualname__}"
        chain.append(label)
    return chain


def _live() -> dict:
    kinds = Counter()
    first: dict[str, object] = {}
    cuda_bytes = 0
    for o in gc.get_objects():
        try:
            t = type(o)
            name = f"{t.__module__}.{t.__qualname__}"
        except Exception:  # noqa: BLE001 - a dead weak proxy, an odd type
            continue
        if isinstance(o, torch.Tensor) and o.is_cuda:
            cuda_bytes += o.untyped_storage().nbytes()
            name = "cuda tensor"
        elif not (name.startswith("ember.") or name.startswith("torch.cuda.graphs")):
            continue
        kinds[name] += 1
        first.setdefault(name, o)
    wanted = [k for k in first if "CUDAGraph" in k or "Runner" in k or "Pool" in k or "Captured" in k
              or k == "cuda tensor" or "WholeStep" in k]
    return {"kinds": dict(kinds.most_common(25)), "cuda_tensor_bytes": cuda_bytes,
            "holders": {k: _holders(first[k], {id(first), id(kinds)}) for k in wanted}}


def check(name: str, backend: str, mode: str, steps: int) -> dict:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    _run(name, backend, mode, steps)
    during = torch.cuda.memory_reserved()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    segments = Counter()
    for seg in torch.cuda.memory_snapshot():
        segments[str(seg.get("segment_pool_id"))] += seg["total_size"]
    row = {"model": name, "backend": backend, "mode": mode, "reserved_before_mib": before / MiB,
           "reserved_after_steps_mib": during / MiB, "reserved_after_drop_mib": torch.cuda.memory_reserved() / MiB,
           "allocated_after_drop_mib": torch.cuda.memory_allocated() / MiB,
           "segments_by_pool_mib": {k: v / MiB for k, v in segments.items()}, **_live()}
    print(f"== {name} {mode} {backend}: reserved before {row['reserved_before_mib']:.0f} MiB, after steps "
          f"{row['reserved_after_steps_mib']:.0f}, after drop {row['reserved_after_drop_mib']:.0f} "
          f"(allocated {row['allocated_after_drop_mib']:.0f}); pools {row['segments_by_pool_mib']}", flush=True)
    for kind, chain in row["holders"].items():
        print(f"   {kind} x{row['kinds'].get(kind)}: " + " <- ".join(chain))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="ember,ember-whole-step")
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = [check(m, b, args.mode, args.steps) for m in args.models for b in args.backend.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
