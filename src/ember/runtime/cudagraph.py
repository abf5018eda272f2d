"""CUDA graphs for compiled programs: one replay instead of hundreds of kernel launches.

Small batches and latency-bound inference are dominated by the host launching kernels; a
captured CUDA graph replays them all with one call. Whether a graph is captured is an
explicit rule (``cudagraph_blocker``) whose reason ``ember.explain`` prints.

Safety across replays:
- Inputs that keep their address between calls (parameters, buffers) are used in place;
  every other input is copied into a static buffer of the same strides before each replay
  (one ``_foreach_copy_`` launch). If a "static" input moves later (a parameter reassigned),
  the graph is captured again, a bounded number of times, then the program runs uncaptured.
- Outputs live in the graph's private memory pool and would be overwritten by the next
  replay, so callers get clones.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import fx

aten = torch.ops.aten

# Ops that wait for the device or produce data-dependent shapes on the host.
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.repeat_interleave.Tensor,
    aten.item.default, aten.equal.default, aten.is_nonzero.default,
}
# Graph kinds captured today. Training graphs hand saved activations from forward to
# backward; capturing them needs those buffers allocated in one shared pool.
CAPTURED_KINDS = ("inference",)
MAX_CAPTURES = 3


def cudagraphs_enabled(option: bool) -> bool:
    return option and os.environ.get("EMBER_CUDAGRAPHS", "1") not in ("0", "false", "")


def cudagraph_blocker(gm: fx.GraphModule, example_inputs: Sequence[object], kind: str, target: str,
                      enabled: bool = True) -> str | None:
    """Why this graph must not be captured, or None when it can be."""
    if not cudagraphs_enabled(enabled):
        return "turned off (cudagraphs=False or EMBER_CUDAGRAPHS=0)"
    if target != "triton":
        return f"target {target} does not run on a CUDA device"
    if kind not in CAPTURED_KINDS:
        return f"{kind} graphs are not captured yet (only {', '.join(CAPTURED_KINDS)})"
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and t.device.type != "cuda":
            return f"input {i} is on {t.device}"
        if not isinstance(t, torch.Tensor) and t is not None:
            return f"input {i} is a Python {type(t).__name__}, not a tensor"
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in SYNC_OPS:
            return f"{node.name} ({node.target}) synchronizes with the CPU"
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            for arg, sarg in zip(node.args, schema.arguments):
                if arg in placeholders and sarg.alias_info is not None and sarg.alias_info.is_write:
                    return f"input {arg.name} is mutated in place by {node.name} ({node.target})"
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != "cuda":
            return f"{node.name} ({node.target}) produces a tensor on {val.device}"
    return None


class CudaGraphRunner:
    """Runs a boxed program eagerly on its first call, then captures it and replays."""

    def __init__(self, run: Callable[[list], object], title: str,
                 on_status: Callable[[str], None] | None = None) -> None:
        self.run = run
        self.on_status = on_status
        self.title = title
        self.calls = 0
        self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = None
        self.first_ptrs: list[int] | None = None
        self.static_idx: list[int] = []
        self.static_ptrs: list[int] = []
        self.dynamic_idx: list[int] = []
        self.buffers: list[torch.Tensor] = []
        self.inputs: list[object] = []
        self.outputs: object = None
        self._set_status("captured on the second call, replayed after")

    def _set_status(self, text: str) -> None:
        self.status = text
        if self.on_status is not None:
            self.on_status(text)

    def __call__(self, args: list) -> object:
        self.calls += 1
        if self.graph is None and (self.first_ptrs is None or self.captures >= MAX_CAPTURES):
            # First call (or capture given up): run as is, note where inputs live.
            if self.first_ptrs is None:
                self.first_ptrs = [_ptr(a) for a in args]
            return self.run(args)
        if self.graph is None:
            return self._capture(args)
        if any(_ptr(args[i]) != p for i, p in zip(self.static_idx, self.static_ptrs)):
            self.first_ptrs = [_ptr(a) for a in args]
            self.graph = None
            if self.captures >= MAX_CAPTURES:
                self._set_status(f"stopped replaying: static inputs moved after {self.captures} captures")
                return self.run(args)
            return self._capture(args)
        if self.dynamic_idx:
            torch._foreach_copy_(self.buffers, [args[i] for i in self.dynamic_idx])
        args.clear()
        self.graph.replay()
        return _clone(self.outputs)

    def _capture(self, args: list) -> object:
        ptrs = [_ptr(a) for a in args]
        self.static_idx = [i for i, (p, q) in enumerate(zip(ptrs, self.first_ptrs or [])) if p == q and p]
        self.static_ptrs = [ptrs[i] for i in self.static_idx]
        statics = set(self.static_idx)
        self.dynamic_idx = [i for i, a in enumerate(args) if i not in statics and isinstance(a, torch.Tensor)]
        self.buffers = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype,
                                            device=args[i].device) for i in self.dynamic_idx]
        if self.buffers:
            torch._foreach_copy_(self.buffers, [args[i] for i in self.dynamic_idx])
        inputs = list(args)
        for i, buf in zip(self.dynamic_idx, self.buffers):
            inputs[i] = buf
        self.inputs = inputs
        args.clear()
        # Warm up on a side stream (lazy initialisation must not land in the capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run(list(inputs))
        torch.cuda.current_stream().wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self.captures += 1
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs = self.run(list(inputs))
        except Exception as err:  # noqa: BLE001 - an uncapturable program still runs
            self.captures = MAX_CAPTURES
            self._set_status(f"capture failed, running uncaptured: {type(err).__name__}: {str(err)[:200]}")
            torch.cuda.synchronize()
            return self.run(list(inputs))
        self.graph = graph
        graph.replay()
        return _clone(self.outputs)


def _ptr(a: object) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else 0


def _clone(out: object) -> object:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_clone(o) for o in out)
    return out
