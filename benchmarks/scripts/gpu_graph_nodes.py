"""What a CUDA graph's launch costs by the kind of node in it, and what a real whole step holds.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_graph_nodes.py --models resnet50,bert --json $OUT/graph_nodes.json

Synthetic graphs of one kind of node each (ATen pointwise kernels, Triton kernels, cuBLAS matmuls,
cuDNN convolutions, multi-tensor ``_foreach`` kernels, ATen copies), ``--nodes`` launches each: the
host time of ``replay()`` until it returns, the step synchronised after each launch, and the
graph's device time (replays back to back between CUDA events); "sync - device" is what the host
adds to a synchronised step. Then each bench model's captured whole training step
(``ember-whole-step``) with CUDA's graph debug mode on: its nodes counted by type (from
``debug_dump``'s DOT file) and the same three times, replayed on the default stream and on a side
stream.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gpu_graph_launch_split import time_step  # noqa: E402 - the scripts folder is not a package


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 0.999, mask=mask)


def _kinds(nodes: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Per kind: a maker of its tensors, returning the body a graph captures (``nodes`` launches)."""
    dev = "cuda"

    def pointwise():
        x = torch.randn(1 << 16, device=dev)
        return lambda: [x.mul_(0.999) for _ in range(nodes)]

    def triton_kernels():
        x = torch.randn(1 << 16, device=dev)
        grid = (triton.cdiv(x.numel(), 1024),)
        return lambda: [_scale_kernel[grid](x, x.numel(), BLOCK=1024) for _ in range(nodes)]

    def cublas():
        a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        return lambda: [torch.mm(a, a, out=out) for _ in range(nodes)]

    def cudnn():
        x = torch.randn(8, 64, 28, 28, device=dev, dtype=torch.bfloat16)
        w = torch.randn(64, 64, 3, 3, device=dev, dtype=torch.bfloat16)
        return lambda: [F.conv2d(x, w, padding=1) for _ in range(nodes)]

    def foreach():
        xs = [torch.randn(4096, device=dev) for _ in range(64)]
        return lambda: [torch._foreach_mul_(xs, 0.999) for _ in range(nodes)]

    def copies():
        a, b = torch.randn(1 << 16, device=dev), torch.empty(1 << 16, device=dev)
        return lambda: [b.copy_(a) for _ in range(nodes)]

    return {"aten pointwise": pointwise, "triton": triton_kernels, "cublas matmul": cublas,
            "cudnn conv": cudnn, "foreach (64 tensors)": foreach, "aten copy": copies}


def time_replays(graph: torch.cuda.CUDAGraph, steps: int, stream: torch.cuda.Stream | None = None) -> dict:
    """replay() host time, synchronised step and device time (us, medians), replayed on ``stream``."""
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
        t = time_step([graph], steps)
    return {"replay_host_us": t["host_us"], "sync_us": t["sync_us"], "device_us": t["pipelined_us"],
            "sync_minus_device_us": t["sync_us"] - t["pipelined_us"]}


def synthetic(nodes: int, steps: int) -> list[dict]:
    rows = []
    for kind, make in _kinds(nodes).items():
        body = make()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up: libraries pick their kernels, Triton compiles
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        r = {"kind": kind, "launches": nodes, **time_replays(graph, steps)}
        r["host_ns_per_launch"] = r["replay_host_us"] * 1e3 / nodes
        rows.append(r)
        print(f"{kind:>22} {nodes:>6} {r['replay_host_us']:>9.1f} {r['sync_us']:>10.1f} {r['device_us']:>10.1f} "
              f"{r['sync_minus_device_us']:>9.1f}", flush=True)
        del graph
    return rows


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its graph for ``debug_dump`` (made in place of torch's while Ember captures)."""

    made: list = []

    def __new__(cls, *args, **kwargs):
        g = super().__new__(cls, *args, **kwargs)
        g.enable_debug_mode()
        cls.made.append(g)
        return g


def node_census(dot: str) -> dict:
    """Node types (the first word of each node's label), edges and a sample of a CUDA graph's DOT dump."""
    types = collections.Counter(re.findall(r'label="\{?\s*([A-Za-z_]+)', dot))
    return {"types": dict(types.most_common(20)), "edges": dot.count("->"), "sample": dot[:4000]}


def whole_step(name: str, steps: int) -> dict:
    from gpu_host_profile import bench_step

    original = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = _DebugGraph  # type: ignore[misc]
    try:
        step, batches = bench_step(name, "ember-whole-step")
        for i in range(12):
            step(*batches[i % 2])
        torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph = original  # type: ignore[misc]
    graph = step.whole_step.cuda.graphs["full"].graph
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        graph.debug_dump(str(path))
        # torch 2.11 wrote no file for the whole-step graph (its template was not kept): the
        # census is then empty and the launch times still come.
        dot = path.read_text(errors="replace") if path.exists() else ""
    census = node_census(dot) if dot else {"types": {}, "edges": 0, "sample": "debug_dump wrote no file"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    r = {"model": name, "census": census, "default_stream": time_replays(graph, steps),
         "side_stream": time_replays(graph, steps, side), "dot_bytes": len(dot)}
    print(f"{name}: nodes {census['types']}, edges {census['edges']}; default stream "
          f"{r['default_stream']}; side stream {r['side_stream']}", flush=True)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=700)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", default="", help="comma-separated bench models (whole training step)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'kind':>22} {'nodes':>6} {'replay us':>9} {'sync us':>10} {'device us':>10} {'sync-dev':>9}")
    rows = synthetic(args.nodes, args.steps)
    models = [whole_step(m, args.steps) for m in args.models.split(",") if m]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "synthetic": rows, "whole_step": models}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
