"""What every kernel generator returns (Triton and CPU alike): ``KernelSource``, and the rules
that make a kernel's identity independent of the graph it came from (``canonical_source``)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass
class KernelSource:
    """Generated source plus everything the program needs to launch it."""

    name: str
    source: str  # the kernel function annotated with the graph nodes it came from (for people)
    digest: str
    args: list[fx.Node]  # pointer args in order: inputs then outputs
    n_inputs: int
    grid: int
    meta: dict[str, int]
    header: str
    canonical: str = ""  # the function without node names: what is hashed, written and compiled
    # "triton": launched as ``name[(grid,)](*args, **meta)``; "cpu": called as ``name(*args)``.
    backend: str = "triton"
    # Split reductions: float32 workspace elements (passed after ``args``), and the kernels that
    # write its partial results, launched in order before this one with the same arguments.
    workspace: int = 0
    pre: list[KernelSource] = dataclasses.field(default_factory=list)

    def arg_dtypes(self) -> list[torch.dtype]:
        return [a.meta["val"].dtype for a in self.args] + ([torch.float32] if self.workspace else [])

    def launch_order(self) -> list[KernelSource]:
        """The kernels of this group in launch order (partial-result kernels, then this one)."""
        return [*self.pre, self]

    def module_source(self) -> str:
        """The module Triton compiles: identical for identical kernels of any graph, so the
        file, the name and Triton's own cache entry are shared."""
        return self.header + "\n\n" + self.canonical

    def annotated_source(self) -> str:
        """The module with every line's source node, as dumped to EMBER_DEBUG_DIR."""
        return self.header + "\n\n" + self.source


_TRAILING_NODE = re.compile(r"(?<=\S)  # (partial )?\w+ = ([\w.]+)\(.*$", re.MULTILINE)


def canonical_source(text: str) -> str:
    """``text`` with each line's node annotation reduced to its op (``# partial sum_3 = sum...``
    becomes ``# partial sum.dim_IntList``): identical kernels of different blocks hash alike."""
    return _TRAILING_NODE.sub(r"  # \1\2", text)


# Ops that move or relabel data (and add, mul: in nearly every kernel); a kernel's name lists the
# others, so a profile says what each kernel computes.
_PLAIN_OPS = frozenset({"view", "_unsafe_view", "reshape", "clone", "permute", "expand", "_to_copy", "t",
                        "transpose", "squeeze", "unsqueeze", "slice", "select", "copy", "copy_", "detach",
                        "alias", "convert_element_type", "add", "mul", "sub", "div", "where", "full",
                        "scalar_tensor", "index", "cat", "split", "split_with_sizes", "unbind", "embedding"})
_NAME_OPS, _NAME_CHARS = 3, 40


def op_summary(nodes: list[fx.Node]) -> str:
    """The source ops a kernel computes, for its name: ``native_layer_norm_backward_gelu``. Each node's
    op before decomposition (``original_aten``), in order, data-moving ones left out, at most three."""
    names: list[str] = []
    for node in nodes:
        op = node.meta.get("original_aten", node.target)
        name = getattr(op, "__name__", str(op)).split(".")[0].strip("_").removeprefix("native_")
        if name and name not in _PLAIN_OPS and name not in names:
            names.append(name)
    return re.sub(r"[^a-z0-9_]", "", "_".join(names[:_NAME_OPS]).lower())[:_NAME_CHARS].strip("_")


def node_source(node: fx.Node) -> str:
    """``name = op(args)``: how a kernel line names the graph node it computes."""
    target = getattr(node.target, "__name__", str(node.target))
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
    return f"{node.name} = {target}({args})"


def launch_kernels(kernels: dict[int, KernelSource]) -> list[KernelSource]:
    """Every kernel a graph's program launches (split reductions launch several per group)."""
    return [k for ks in kernels.values() for k in ks.launch_order()]


# A CPU kernel's module source is its shared module plus this line with one use's data
# (codegen/cpu_kernel.py). Split here, where loading a warm start does it without importing the
# CPU code generator.
INSTANCE_MARKER = "# ember-cpu-instance: "


def split_module(text: str) -> tuple[str, dict]:
    """A CPU kernel's module source -> (the shared kernel module, this use's data)."""
    shared, marker, trailer = text.rpartition(INSTANCE_MARKER)
    if not marker:
        raise ValueError("not a CPU kernel module (no instance line)")
    return shared.rstrip("\n") + "\n", json.loads(trailer)
