"""Graph passes: FX -> FX functions, each named, timed and printable.

A pass is a plain function ``(gm: fx.GraphModule) -> int`` that rewrites the graph in
place and returns how many nodes it changed. ``run_passes`` times each one, and records
the graph after it (``DEBUG=3`` prints it; ``EMBER_DEBUG_DIR`` writes it to disk).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ember.config import settings
from ember.passes.attention_seeds import route_attention_seeds
from ember.passes.cleanup import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_constants,
    remove_layout_preserving_clones,
    replace_functional_copies,
)
from ember.passes.cpu_library import lower_cpu_library_calls
from ember.passes.depthwise import generate_depthwise_convs
from ember.passes.fold_conv import fold_conv_affine
from ember.passes.freeze import extend_frozen, mark_frozen
from ember.passes.gpu_library_choices import choose_gpu_library_implementations
from ember.passes.layout import to_channels_last
from ember.passes.library_sites import Choose
from ember.passes.pad_matmul import pad_unaligned_matmuls
from ember.passes.sibling_matmuls import merge_sibling_matmuls
from ember.passes.small_bmm import generate_small_bmms
from ember.targets import BY_NAME

GraphPass = Callable[[fx.GraphModule], int]

DEFAULT_PASSES: list[GraphPass] = [eliminate_dead_code, replace_functional_copies, fold_constants,
                                   eliminate_common_subexpressions, eliminate_dead_code]


@dataclass
class PassContext:
    """What decides which passes run on a graph."""

    kind: str  # "inference", "forward" or "backward"
    target: str  # the resolved target ("triton", "triton-interpret", "cpu", "aten")
    static_inputs: set[int]  # graph inputs that are parameters or buffers
    freeze: bool = True
    channels_last: bool = True  # Options.channels_last
    example_inputs: list | None = None  # what AOTAutograd passed (the backward's carry saved strides)
    library_choice: Choose | None = None  # tuned library implementations per site (tune/apply.py)
    pad_matmul: str = "auto"  # Options.pad_matmul: auto | always | off
    merge_matmuls: bool = True  # Options.merge_matmuls

    @property
    def freezing(self) -> bool:
        # Parameters only stay put between calls of inference graphs; training updates them.
        return self.freeze and self.kind == "inference" and bool(self.static_inputs)

    @property
    def cpu_library(self) -> bool:
        # CPU tensors only: target="aten" also runs on CUDA tensors, where the oneDNN calls these
        # passes insert do not exist.
        on_cpu = all(t.device.type == "cpu" for t in (self.example_inputs or []) if isinstance(t, torch.Tensor))
        return self.freezing and BY_NAME[self.target].cpu_library_passes and on_cpu

    @property
    def gpu_freezing(self) -> bool:
        # The GPU code path: autocast's weight casts, padded weights and batch-norm scales are
        # computed once per parameter version instead of on every call (a CUDA-graph replay runs
        # none of the program's host code: the runner calls ``refresh_frozen`` before each replay).
        return self.freezing and BY_NAME[self.target].gpu_code_path


def passes_for(context: PassContext) -> list[GraphPass]:
    """The pass pipeline of one graph: cleanup always; on CUDA backward graphs, the seeds of
    memory-efficient attention with dropout routed for CUDA graphs; on the GPU targets, matmul dims
    padded to cuBLAS's alignment where the rule says it pays, small unaligned batched products as
    Ember's kernel, channels_last for convolutional
    graphs and (when switched on) depthwise convolutions as Ember's kernels, then clones that keep
    their source's layout removed; freezing, convolution folding and oneDNN library calls for CPU
    inference graphs whose parameters are known; freezing for GPU inference graphs, then matmuls
    of one activation with frozen weights merged into one (attention's query, key and value); last,
    when a tuning database exists, the tuned implementation of each matmul, depthwise convolution and
    inference attention call on the GPU targets, of each attention call in CPU inference graphs."""
    passes = list(DEFAULT_PASSES)
    if BY_NAME[context.target].runs_on_cuda and context.kind == "backward":
        passes.append(route_attention_seeds)  # memory-efficient attention's dropout seeds, captured or not
    if context.pad_matmul != "off" and BY_NAME[context.target].gpu_code_path:
        def pad_matmul_dims(gm: fx.GraphModule) -> int:
            tuning = settings()
            return pad_unaligned_matmuls(gm, context.pad_matmul, tuning.pad_matmul_min_flops_per_byte,
                                         tuning.pad_matmul_min_gflop)
        passes.append(pad_matmul_dims)
    if settings().small_bmm and BY_NAME[context.target].gpu_code_path:
        passes.append(generate_small_bmms)  # after the padding pass: products it pads stay cuBLAS's
    if context.channels_last and BY_NAME[context.target].gpu_code_path:
        def channels_last_layout(gm: fx.GraphModule) -> int:
            return to_channels_last(gm, context.kind, context.example_inputs)
        passes.append(channels_last_layout)
        if settings().depthwise_kernels:  # after the layout pass: the rule reads the layout it chose
            passes.append(generate_depthwise_convs)
    if BY_NAME[context.target].gpu_code_path:
        passes.append(remove_layout_preserving_clones)  # after the layout pass: its strides decide
    if context.cpu_library:
        def mark_frozen_parameters(gm: fx.GraphModule) -> int:
            return mark_frozen(gm, context.static_inputs)
        library = lower_cpu_library_calls
        if context.library_choice is not None:
            choose = context.library_choice

            def library(gm: fx.GraphModule) -> int:
                return lower_cpu_library_calls(gm, choose)
            library.__name__ = lower_cpu_library_calls.__name__  # the pass keeps its name in reports
        # extend_frozen after the library calls: the nodes they add (a linear's output view) are
        # computed from parameters too, and a frozen node must only read frozen ones.
        passes += [mark_frozen_parameters, fold_conv_affine, library, eliminate_dead_code, extend_frozen]
    elif context.gpu_freezing:
        def mark_frozen_parameters(gm: fx.GraphModule) -> int:
            return mark_frozen(gm, context.static_inputs)
        passes.append(mark_frozen_parameters)
        if context.merge_matmuls:  # after the marks: it merges products of frozen weights only
            def merge_matmuls(gm: fx.GraphModule) -> int:
                return merge_sibling_matmuls(gm, settings().merge_matmuls_max_copy_mb)
            merge_matmuls.__name__ = merge_sibling_matmuls.__name__  # the pass keeps its name in reports
            passes.append(merge_matmuls)
    target = BY_NAME[context.target]
    if context.library_choice is not None and (target.gpu_code_path or context.cpu_library):
        # Last: the calls the program would run. CPU inference: attention alone (its matmuls and
        # convolutions are the CPU library pass's choices).
        choose, attention_only = context.library_choice, not target.gpu_code_path

        def tuned_library_calls(gm: fx.GraphModule) -> int:
            return choose_gpu_library_implementations(gm, choose, target.device_type, attention_only)
        tuned_library_calls.__name__ = choose_gpu_library_implementations.__name__
        passes.append(tuned_library_calls)
    return passes


@dataclass
class PassResult:
    name: str
    seconds: float
    changed: int
    nodes_after: int
    graph_after: str


def run_passes(gm: fx.GraphModule, passes: list[GraphPass] | None = None,
               on_result: Callable[[PassResult], None] | None = None, keep_text: bool = True) -> list[PassResult]:
    """Run ``passes`` in order on ``gm``; return one PassResult per pass.

    ``keep_text``: record each pass's resulting graph as Python (``graph_after``). Printing the
    code regenerates it after every pass, most of the passes' time on a ResNet-50 graph, so the
    pipeline asks for it only where it is shown (``DEBUG=3``, ``EMBER_DEBUG_DIR``); without it
    ``graph_after`` is empty and the module's code is regenerated once, at the end."""
    results = []
    for p in DEFAULT_PASSES if passes is None else passes:
        start = time.perf_counter()
        changed = p(gm)
        gm.graph.lint()
        if keep_text:
            gm.recompile()
        seconds = time.perf_counter() - start
        result = PassResult(p.__name__, seconds, changed, len(gm.graph.nodes), gm.code if keep_text else "")
        results.append(result)
        if on_result is not None:
            on_result(result)
    if not keep_text:
        gm.recompile()
    return results
