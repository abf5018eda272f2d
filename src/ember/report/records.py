"""Records of each compiled graph, collected by the backend and read by ``ember.explain``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Ember's compile stages of one graph, in order (GraphRecord.stage_seconds).
STAGES = ("cache_load", "passes", "schedule", "codegen", "kernel_compile", "program")


@dataclass
class GraphRecord:
    """What happened to one ATen graph (forward, backward or inference)."""

    title: str
    kind: str  # forward | backward | inference
    frame: str  # Dynamo compile id, e.g. "0/1" (frame 0, its second compile)
    target: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    passes: list[tuple[str, float, int]] = field(default_factory=list)  # name, seconds, changed
    op_classes: Counter = field(default_factory=Counter)  # ops by class (pointwise, library, ...)
    placement: dict[str, Counter] = field(default_factory=dict)  # generated|fused-aten|library|fallback|view -> op
    fallback_reasons: Counter = field(default_factory=Counter)  # "op: reason" -> count
    steps: Counter = field(default_factory=Counter)  # step kind -> count
    fusion_decisions: Counter = field(default_factory=Counter)  # why a fused group starts -> count
    kernels: int = 0
    unique_kernels: int = 0
    input_signature: list[str] = field(default_factory=list)
    error: str | None = None  # set when Ember could not compile and ran the graph as captured
    dynamic: bool = False  # a dynamic-shape graph: runs through ATen as captured (capture/backend.py)
    plan_text: str = ""
    program: str = ""
    kernel_sources: dict[str, str] = field(default_factory=dict)
    first_call_s: float | None = None
    cudagraph: str = ""  # "captured ..." or why the program runs without a CUDA graph
    # Why this program could not sit inside a whole-step CUDA graph (train/capture.py); None: it can.
    whole_step_blocker: str | None = None
    layout: dict = field(default_factory=dict)  # passes/layout.py: conversions, saved-output strides
    matmul_padding: dict = field(default_factory=dict)  # passes/pad_matmul.py: what was padded, what declined
    merged_matmuls: list[str] = field(default_factory=list)  # passes/sibling_matmuls.py: one line per merge
    cache: str = ""  # compiled-program cache: hit | stored | miss | off | not cacheable (...)
    compile_note: str = ""  # where the kernel_compile stage went (runtime/precompile.py)
    # CPU: the program ran its fused groups through ATen while its kernels compiled (runtime/aten_first.py).
    aten_first: str = ""
    # Kernels compiled with a tuned configuration (ember/tune/apply.py): default kernel name ->
    # {"kernel", "config", "ms", "default_ms", "gain", "source"}.
    tuned: dict[str, dict] = field(default_factory=dict)


@dataclass
class CompileLog:
    """All graphs one backend compiled, plus Dynamo's frames."""

    graphs: list[GraphRecord] = field(default_factory=list)
    frames: list[tuple[str, list[str]]] = field(default_factory=list)  # compile id, input signature
    recompiles: list[str] = field(default_factory=list)  # one line per recompile: id and reason
    dynamic: list[str] = field(default_factory=list)  # compile ids of dynamic-shape Dynamo graphs
    rewrites: Counter = field(default_factory=Counter)  # Dynamo-graph rewrites before AOTAutograd -> count
    # Frames Dynamo stopped compiling (its recompile limit): they run eagerly from then on.
    gave_up: list[str] = field(default_factory=list)
    # What the warm start did (capture/warm_start.py): loaded, compiled and saved, or why it is off.
    warm_start: list[str] = field(default_factory=list)
    # What the frame cache did per Dynamo frame (capture/frame_cache.py): loaded, stored, or why not.
    frame_cache: list[str] = field(default_factory=list)

    def stage_totals(self) -> dict[str, float]:
        """Ember's compile time per stage, summed over all graphs."""
        return {s: sum(g.stage_seconds.get(s, 0.0) for g in self.graphs) for s in STAGES}
