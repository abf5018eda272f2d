"""The TorchDynamo backend: Dynamo FX graph -> AOTAutograd ATen graphs -> Ember programs.

Training graphs are split by AOTAutograd into a forward and a backward graph, both compiled
by Ember; with grad disabled AOTAutograd hands over one inference graph. Registered as the
``torch.compile`` backend ``"ember"`` (entry point group ``torch_dynamo_backends``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from ember.capture.decompositions import decomposition_table
from ember.config import Options
from ember.pipeline import compile_graph
from ember.report.records import CompileLog, GraphRecord

_DECOMPOSITIONS: dict[bool, dict] = {}


def _decompositions(cpu_inference: bool = False) -> dict:
    if cpu_inference not in _DECOMPOSITIONS:
        _DECOMPOSITIONS[cpu_inference] = decomposition_table(cpu_inference)
    return _DECOMPOSITIONS[cpu_inference]


def _cpu_inference(example_inputs: list, options: Options) -> bool:
    """Whether this frame becomes a CPU inference graph (grad off, every tensor on the CPU)."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return (not torch.is_grad_enabled() and options.target in ("auto", "cpu", "aten") and options.freeze
            and all(t.device.type == "cpu" for t in tensors))


def _signature(inputs: list) -> list[str]:
    sig = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            sig.append(f"{x.dtype}{list(x.shape)}@{x.device}")
        else:
            sig.append(type(x).__name__)
    return sig


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext
        cid = CompileContext.current_compile_id()
        if cid is not None:
            return f"{cid.frame_id}/{cid.frame_compile_id}"
    except Exception:  # noqa: BLE001 - only used for reporting
        pass
    return "?"


class EmberBackend:
    """A ``torch.compile`` backend with its options and a log of everything it compiled."""

    _ids = itertools.count()

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self.log = CompileLog()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        check_device(example_inputs, self.options.device)
        cid = _compile_id()
        sig = _signature(example_inputs)
        frame, _, nth = cid.partition("/")
        if nth not in ("", "0"):
            prior = [s for f, s in self.log.frames if f.partition("/")[0] == frame]
            changed = _describe_change(prior[-1], sig) if prior else "guard failure"
            self.log.recompiles.append(f"frame {frame} compile {nth}: {changed}")
        self.log.frames.append((cid, sig))
        n = next(self._ids)

        def make(kind: str) -> Callable:
            def compiler(graph: fx.GraphModule, inputs: list) -> Callable:
                record = GraphRecord(title=f"{kind} {n} (frame {cid})", kind=kind, frame=cid, target="",
                                     input_signature=_signature(inputs))
                self.log.graphs.append(record)
                return compile_graph(graph, inputs, self.options, record)
            return compiler

        backend = aot_autograd(fw_compiler=make("forward"), bw_compiler=make("backward"),
                               inference_compiler=make("inference"),
                               decompositions=_decompositions(_cpu_inference(example_inputs, self.options)),
                               partition_fn=_PARTITION)
        return backend(gm, example_inputs)


# The default partitioner saves every forward value the backward reads. The min-cut partitioner
# (what Inductor uses) saves a minimal set and recomputes cheap pointwise chains in the backward,
# where they fuse into the backward's kernels: fewer, smaller saved activations, lower peak memory.
_PARTITION = functools.partial(min_cut_rematerialization_partition, compiler="inductor")


def check_device(example_inputs: list, device: str) -> None:
    """``device="cpu"|"cuda"``: every input tensor must be there (an error naming the first that is not)."""
    if device == "auto":
        return
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.device.type != device:
            raise ValueError(f"ember.compile(device={device!r}): graph input {i} ({list(x.shape)}) is on "
                             f"{x.device}; move the model and its inputs to {device} or use device='auto'")


def _describe_change(old: list[str], new: list[str]) -> str:
    if len(old) != len(new):
        return f"number of inputs {len(old)} -> {len(new)}"
    diffs = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old, new)) if a != b]
    return "; ".join(diffs[:3]) if diffs else "guard failure (same input signature)"


def ember_backend(gm: fx.GraphModule, example_inputs: list, **options: object) -> Callable:
    """Entry point for ``torch.compile(model, backend="ember", options={...})``."""
    return EmberBackend(Options.from_env(**options))(gm, example_inputs)
