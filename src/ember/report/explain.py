"""``ember.explain``: compile and run a model once, then say what ran where and what it cost.

    report = ember.explain(model, x)        # default options (EMBER_TARGET from the environment)
    report = explain_with(model, (x,), target="triton-interpret")
    print(report); report.to_html("explain.html"); report.coverage(); report.as_dict()

The model is run once through a fresh ``EmberBackend`` (forward, and backward when the
output requires grad), then for a few more timed steps: host milliseconds per step and what ran
outside the graphs (report/host_time.py). The user's weights, buffers, ``.grad`` fields and RNG
state are left as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ember import config
from ember.capture.backend import EmberBackend, optimize
from ember.capture.eager_fallback import install as install_eager_fallback
from ember.config import Options
from ember.passes.pad_matmul import padding_line
from ember.report.graph_breaks import collect_graph_breaks
from ember.report.host_time import HostTimes, host_time_section, measure_steps
from ember.report.html import Section, Table, render_html
from ember.report.records import STAGES, CompileLog, GraphRecord  # noqa: F401 - STAGES re-exported
from ember.schedule.rules import CONSTANT_OPS, VIEW_OPS
from ember.tune.report import tuning_section

PLACEMENTS = ("generated", "fused-aten", "library", "fallback", "frozen", "view", "constant")
COMPUTE = ("generated", "fused-aten", "library", "fallback")  # what coverage is a share of
CAPTURE_LABEL = "Dynamo + AOTAutograd capture (approx.)"


def _names(ops: set) -> set[str]:
    return {f"{op.namespace}.{op._overloadpacket.__name__}" for op in ops}


# Placement files fusable views under the kernel they sit in; coverage counts compute only.
_NOT_COMPUTE = _names(VIEW_OPS) | _names(CONSTANT_OPS)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{x:.1f}%"


def short_reason(text: str, limit: int = 160) -> str:
    """Dynamo's multi-line graph-break message as one line: headline plus its explanation."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no reason given)"
    head = lines[0]
    expl = next((ln.removeprefix("Explanation:").strip() for ln in lines[1:] if ln.startswith("Explanation:")), "")
    one = f"{head}: {expl}" if expl else head
    return one if len(one) <= limit else one[: limit - 1] + "…"


@dataclass
class ExplainReport:
    """What one compile-and-run of a model did. ``print()`` it, or ``to_html(path)``, ``as_dict()``."""

    log: CompileLog
    target: str  # the requested target; each graph's resolved target is in its record
    training: bool
    total_s: float  # wall time of the first call (forward, plus backward when training)
    forward_s: float
    backward_s: float
    first_run_s: float  # running (not compiling) the graphs on the first call, as far as measured
    first_run_note: str
    dynamo_graphs: int
    graph_breaks: Counter = field(default_factory=Counter)  # Dynamo's full reason -> count
    break_locations: dict[str, list[str]] = field(default_factory=dict)  # reason -> ["file:line: source"]
    recompiles: list[str] = field(default_factory=list)
    # For a model from ember.compile: its own compiles so far (explain compiles afresh, once).
    model_compiles: list[str] = field(default_factory=list)  # compile ids, e.g. "0/3"
    model_recompiles: list[str] = field(default_factory=list)  # what changed, per recompile
    model_dynamic: list[str] = field(default_factory=list)  # compile ids of dynamic-shape graphs
    host: HostTimes | None = None  # steady-state steps after the first call (report/host_time.py)
    host_note: str = "not measured (steps=0)"  # why ``host`` is None
    model_gave_up: list[str] = field(default_factory=list)  # frames Dynamo stopped compiling (run eagerly)
    model_whole_call: str = ""  # whole_call=True: how the compiled model's calls ran (runtime/cudagraphs/whole_call.py)

    # -- numbers -------------------------------------------------------------------------------
    @property
    def graphs(self) -> list[GraphRecord]:
        return self.log.graphs

    def stage_totals(self) -> dict[str, float]:
        """Ember's compile time per stage, summed over all graphs."""
        return self.log.stage_totals()

    @property
    def ember_s(self) -> float:
        return sum(self.stage_totals().values())

    @property
    def capture_s(self) -> float:
        # Whatever the first call spent outside Ember's stages and the graphs' own run time:
        # mostly Dynamo tracing and AOTAutograd (plus any eager code between graph breaks).
        return max(0.0, self.total_s - self.ember_s - self.first_run_s)

    @property
    def kernels(self) -> int:
        return sum(g.kernels for g in self.graphs)

    @property
    def unique_kernels(self) -> int:
        # Kernel names are content hashes, so equal kernels in different graphs share a name.
        return len({name for g in self.graphs for name in g.kernel_sources})

    def placement_counts(self, graph: GraphRecord | None = None) -> dict[str, Counter]:
        """Op -> count per placement, for one graph or all; a graph Ember could not compile
        ran entirely through ATen, so its ops count as fallback."""
        out: dict[str, Counter] = {p: Counter() for p in PLACEMENTS}
        for g in [graph] if graph is not None else self.graphs:
            for where, ops in g.placement.items():
                dest = "fallback" if g.error and where in COMPUTE else where
                out.setdefault(dest, Counter()).update(ops)
        return out

    def coverage(self, graph: GraphRecord | None = None) -> dict[str, float]:
        """Share (%) of compute ops (no views, constants, getitems) in generated kernels,
        ATen-fused groups, library calls and fallbacks; for one graph or all. Empty if none."""
        counts = self._compute_counts(graph)
        total = sum(counts.values())
        return {k: 100.0 * v / total for k, v in counts.items()} if total else {}

    def _compute_counts(self, graph: GraphRecord | None) -> dict[str, int]:
        placed = self.placement_counts(graph)
        return {k: sum(n for op, n in placed[k].items() if k == "library" or op not in _NOT_COMPUTE)
                for k in COMPUTE}

    def problems(self) -> list[str]:
        out = [f"{g.title}: Ember could not compile this graph; it ran through ATen as captured. {g.error}"
               for g in self.graphs if g.error]
        out += [f"Dynamo gave up compiling a frame of the compiled model; it runs eagerly from now on (correct "
                f"results, no Ember code): {note}" for note in self.model_gave_up]
        if not self.graphs:
            out.append("Dynamo compiled no graph: the model ran eagerly (nothing to trace, the frame was "
                       "skipped, or Dynamo's recompile limit was hit).")
        return out

    # -- output --------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        """Everything in the report as JSON-serialisable data."""
        graphs = []
        for g in self.graphs:
            d = dataclasses.asdict(g)
            d["op_classes"] = dict(g.op_classes)
            d["placement"] = {k: dict(v) for k, v in g.placement.items()}
            d["fallback_reasons"] = dict(g.fallback_reasons)
            d["steps"] = dict(g.steps)
            d["fusion_decisions"] = dict(g.fusion_decisions)
            d["passes"] = [{"name": n, "seconds": s, "changed": c} for n, s, c in g.passes]
            d["coverage"] = self.coverage(g)
            graphs.append(d)
        return {
            "target": self.target, "training": self.training,
            "first_call_s": self.total_s, "forward_call_s": self.forward_s, "backward_call_s": self.backward_s,
            "capture_s": self.capture_s, "capture_label": CAPTURE_LABEL, "ember_stage_s": self.stage_totals(),
            "first_run_s": self.first_run_s, "first_run_note": self.first_run_note,
            "dynamo_graphs": self.dynamo_graphs, "aten_graphs": len(self.graphs),
            "graph_breaks": {"count": sum(self.graph_breaks.values()),
                             "reasons": [{"reason": r, "count": n, "where": self.break_locations.get(r, [])}
                                         for r, n in self.graph_breaks.items()]},
            "recompiles": list(self.recompiles),
            "capture_rewrites": dict(+self.log.rewrites), "frame_cache": list(self.log.frame_cache),
            "model_history": {"compiles": list(self.model_compiles), "recompiles": list(self.model_recompiles),
                              "dynamic_shape_graphs": list(self.model_dynamic),
                              "frames_run_eagerly": list(self.model_gave_up)},
            "kernels": self.kernels, "unique_kernels": self.unique_kernels,
            "layout_conversions": self.layout_conversions(),
            "coverage": self.coverage(), "problems": self.problems(), "graphs": graphs,
            "host_time": self.host.as_dict() if self.host is not None else {"note": self.host_note},
        }

    def sections(self) -> list[Section]:
        """The report as plain data, shared by the text and the HTML renderers."""
        out = []
        if self.problems():
            out.append(Section("Problems", self.problems(), alert=True))
        out += [self._summary(), self._host_section(), self._times(), self._categories(), self._placement(),
                self._fusion_section(), self._layout_section(), self._padding_section(),
                self._merged_matmuls_section(), self._fallbacks(),
                self._coverage_section(),
                tuning_section(self.graphs)]
        return out

    def _host_section(self) -> Section:
        return host_time_section(self.host, sum(self.graph_breaks.values()), self.dynamo_graphs,
                                 [f"{n}x {short_reason(r)}" for r, n in self.graph_breaks.most_common()],
                                 self.host_note)

    def layout_conversions(self) -> int:
        """Layout conversions (copies) the channels_last pass inserted, over all graphs."""
        return sum(len(g.layout.get("conversions", [])) for g in self.graphs)

    def _layout_section(self) -> Section:
        ran = [g for g in self.graphs if g.layout]
        if not ran:
            return Section("Memory layout", ["eager's layout everywhere (the channels_last pass runs on the GPU "
                                             "targets only; EMBER_LAYOUT=0 turns it off)."])
        lines = ["Convolutional graphs run in channels_last (passes/layout.py): one copy per tensor that",
                 "enters a convolution in another layout; outputs the caller sees keep eager's layout;",
                 "saved activations stay channels_last and the backward is compiled for them.",
                 f"Conversions: {self.layout_conversions()} in {len(ran)} graph(s)."]
        rows = []
        for g in ran:
            if g.layout.get("skipped"):
                lines.append(f"{g.title}: {g.layout['skipped']}")
                continue
            lines.append(f"{g.title}: {g.layout.get('convolutions', 0)} convolution(s), "
                         f"{len(g.layout.get('conversions', []))} conversion(s), "
                         f"{len(g.layout.get('synced_inputs', []))} input(s) compiled for the forward's layout")
            rows += [[g.title, c] for c in g.layout.get("conversions", [])]
        tables = [Table(["graph", "conversion (where)"], rows, numeric_from=2)] if rows else []
        return Section("Memory layout", lines, tables)

    def _padding_section(self) -> Section:
        ran = [g for g in self.graphs if g.matmul_padding]
        if not ran:
            return Section("Matmul padding", ["no matmul padded (the pass runs on the GPU targets; "
                                              "EMBER_PAD_MATMUL=off turns it off)."])
        lines = ["Matmul dims that are not a multiple of 16 bytes, padded with zeros so cuBLAS runs its aligned",
                 "kernels (passes/pad_matmul.py; the rule: passes/matmul_padding_rule.py):"]
        for g in ran:
            lines.append(f"{g.title}: {padding_line(g.matmul_padding)}")
            if g.matmul_padding.get("restored_outputs"):
                lines.append(f"  {g.matmul_padding['restored_outputs']} graph output(s) copied back to eager's strides")
            lines += [f"  not padded ({n}x): {why}" for why, n in g.matmul_padding.get("declined", {}).items()]
        return Section("Matmul padding", lines)

    def _merged_matmuls_section(self) -> Section:
        ran = [g for g in self.graphs if g.merged_matmuls]
        if not ran:
            return Section("Merged matmuls", ["none merged (GPU inference graphs only: matmuls of one activation "
                                              "with parameter-only weights; EMBER_MERGE_MATMULS=0 turns it off)."])
        lines = ["Matmuls of one activation with parameter-only weights run as one matmul over the weights side",
                 "by side, concatenated once per parameter version (passes/sibling_matmuls.py):"]
        for g in ran:
            lines += [f"{g.title}: {sum(not m.startswith('not merged') for m in g.merged_matmuls)} merge(s)"]
            for line, n in Counter(g.merged_matmuls).items():
                lines.append(f"  {line}" + (f" ({n}x)" if n > 1 else ""))
        return Section("Merged matmuls", lines)

    def _summary(self) -> Section:
        kinds = Counter(g.kind for g in self.graphs)
        resolved = sorted({g.target for g in self.graphs if g.target})
        target = self.target + (f" -> {', '.join(resolved)}" if resolved and resolved != [self.target] else "")
        lines = [
            f"Mode: {'training (forward and backward compiled)' if self.training else 'inference'}; "
            f"target: {target}",
            f"Graphs: {self.dynamo_graphs} captured by Dynamo, {len(self.graphs)} ATen graph(s) compiled"
            + (f" ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})" if kinds else ""),
            f"Graph breaks: {sum(self.graph_breaks.values())}",
        ]
        for r, n in self.graph_breaks.most_common():
            lines.append(f"  {n}x {short_reason(r, 240)}")
            lines += [f"     at {place}" for place in self.break_locations.get(r, [])]
        lines.append(f"Recompiles in this run: {len(self.recompiles)}"
                     + (" (explain compiles the model afresh, once)" if self.model_compiles else ""))
        lines += [f"  {r}" for r in self.recompiles]
        rewrites = +self.log.rewrites
        if rewrites:
            lines.append("Rewritten before AOTAutograd: " + "; ".join(f"{n}x {r}" for r, n in rewrites.items()))
        if self.model_compiles:
            static = len(self.model_compiles) - len(self.model_dynamic)
            lines.append(f"The compiled model so far: {len(self.model_compiles)} Dynamo graph(s), {static} with static "
                         f"shapes, {len(self.model_dynamic)} with dynamic shapes (run through ATen as captured); "
                         f"{len(self.model_recompiles)} recompile(s)" + (":" if self.model_recompiles else ""))
            lines += [f"  {r}" for r in self.model_recompiles]
        hint = ""
        if not self.kernels and any(g.placement.get("fused-aten") for g in self.graphs):
            hint = "; fused groups ran op by op through ATen (target aten)"
        lines.append(f"Kernels generated: {self.kernels} (unique after dedupe: {self.unique_kernels}){hint}")
        lines += [f"CUDA graph, {g.title}: {g.cudagraph}" for g in self.graphs if g.cudagraph]
        if self.model_whole_call:
            lines.append(f"Whole call (the compiled model so far): {self.model_whole_call}")
        lines += [f"Compile cache, {g.title}: {g.cache}" for g in self.graphs if g.cache]
        lines += [f"Kernels compiled behind, {g.title}: {g.aten_first}" for g in self.graphs if g.aten_first]
        lines += [f"Frame cache, {line}" for line in self.log.frame_cache]
        lines.append(f"First call: {_ms(self.total_s)} (capture ~{_ms(self.capture_s)}, Ember stages "
                     f"{_ms(self.ember_s)}, first run {_ms(self.first_run_s)})")
        return Section("Summary", lines)

    def _times(self) -> Section:
        rows = [[g.title, g.target or "-", *(_ms(g.stage_seconds.get(s)) for s in STAGES),
                 _ms(sum(g.stage_seconds.values()))] for g in self.graphs]
        totals = self.stage_totals()
        rows.append(["all graphs", "", *(_ms(totals[s]) for s in STAGES), _ms(self.ember_s)])
        table = Table(["graph", "target", *STAGES, "total"], rows, numeric_from=2, bold_last=True,
                      caption="Ember stages per graph")
        first = Table(["first call", "time"], [
            [CAPTURE_LABEL, _ms(self.capture_s)], ["Ember stages (all graphs)", _ms(self.ember_s)],
            [f"first run of the compiled graphs ({self.first_run_note})", _ms(self.first_run_s)],
            ["whole first call" + (" (forward + backward)" if self.training else ""), _ms(self.total_s)],
        ], bold_last=True)
        notes = [f"kernel_compile, {g.title}: {g.compile_note}" for g in self.graphs if g.compile_note]
        from ember.runtime.cubin_launch import describe_launches
        launches = describe_launches()
        notes += [launches] if launches else []
        return Section("Compile time", notes, [first, table])

    def _categories(self) -> Section:
        cats = sorted({c for g in self.graphs for c in g.op_classes})
        rows = [[g.title, *(str(g.op_classes.get(c, 0)) for c in cats), str(sum(g.op_classes.values()))]
                for g in self.graphs]
        total: Counter = sum((g.op_classes for g in self.graphs), Counter())
        rows.append(["total", *(str(total.get(c, 0)) for c in cats), str(sum(total.values()))])
        return Section("Ops by category", [], [Table(["graph", *cats, "all"], rows, bold_last=True)])

    def _placement(self) -> Section:
        placed = self.placement_counts()
        ops = sorted({op for c in placed.values() for op in c},
                     key=lambda op: (-sum(placed[p].get(op, 0) for p in PLACEMENTS), op))
        rows = [[op, *(str(placed[p].get(op, 0) or "") for p in PLACEMENTS)] for op in ops]
        lines = ["Where each ATen op ran, summed over graphs. generated: inside an Ember-generated kernel;",
                 "fused-aten: in a fused group run op by op through ATen; library: a vendor library call;",
                 "fallback: an ATen op run as is; view, constant: no compute; frozen: computed from",
                 "parameters only, once per parameter version (inference graphs, passes/freeze.py)."]
        return Section("Placement", lines, [Table(["op", *PLACEMENTS], rows)])

    def _fusion_section(self) -> Section:
        decisions: Counter = sum((g.fusion_decisions for g in self.graphs), Counter())
        rows = [[why, str(n)] for why, n in decisions.most_common()]
        lines = ["Why each generated kernel starts where it does: an op joins the latest fused group that",
                 "produces one of its inputs unless a rule below forbids it (per-group detail: plan.txt in",
                 "EMBER_DEBUG_DIR, or DEBUG=1)."] if rows else ["No fused groups."]
        tables = [Table(["new fused group because", "groups"], rows)] if rows else []
        return Section("Fusion decisions", lines, tables)

    def _fallbacks(self) -> Section:
        reasons: Counter = sum((g.fallback_reasons for g in self.graphs), Counter())
        rows = []
        for key, n in reasons.most_common():
            op, _, why = key.partition(": ")
            rows.append([op, why, str(n)])
        lines = [] if rows else ["No op fell back to ATen."]
        lines += [f"{g.title}: every op ran through ATen (graph not compiled)" for g in self.graphs if g.error]
        tables = [Table(["op", "reason", "count"], rows, numeric_from=2)] if rows else []
        return Section("Fallback ops", lines, tables)

    def _coverage_section(self) -> Section:
        def row(name: str, graph: GraphRecord | None) -> list[str]:
            cov, n = self.coverage(graph), sum(self._compute_counts(graph).values())
            return [name, *(_pct(cov.get(k, 0.0)) if cov else "-" for k in COMPUTE), str(n)]
        rows = [row(g.title + (" (not compiled)" if g.error else ""), g) for g in self.graphs]
        rows.append(row("total", None))
        lines = ["Share of compute ops (views, constants and getitems excluded)."]
        return Section("Coverage", lines, [Table(["graph", *COMPUTE, "compute ops"], rows, bold_last=True)])

    def __str__(self) -> str:
        from rich import box
        from rich.console import Console
        from rich.table import Table as RichTable

        console = Console(record=True, width=110, file=io.StringIO())
        console.rule("[bold]Ember explain")
        for s in self.sections():
            console.print()
            console.print(f"[bold{' red' if s.alert else ''}]{'!! ' if s.alert else ''}{s.heading}")
            for line in s.lines:
                console.print(line, markup=False, highlight=False)
            for i, t in enumerate(s.tables):
                if i:
                    console.print()
                rt = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
                for i, h in enumerate(t.headers):
                    rt.add_column(h, justify="right" if i >= t.numeric_from else "left")
                for r, cells in enumerate(t.rows):
                    rt.add_row(*cells, style="bold" if t.bold_last and r == len(t.rows) - 1 else None)
                if t.caption:
                    console.print(t.caption, style="italic", markup=False, highlight=False)
                console.print(rt)
        return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"

    def __repr__(self) -> str:
        return (f"<ExplainReport {len(self.graphs)} graph(s), {sum(self.graph_breaks.values())} graph break(s), "
                f"{self.kernels} kernel(s), first call {_ms(self.total_s)}>")

    def to_html(self, path: str | Path) -> Path:
        """Write a self-contained HTML page (no external assets); returns its path."""
        path = Path(path)
        subtitle = f"target {self.target}, {'training' if self.training else 'inference'}"
        path.write_text(render_html("Ember explain", subtitle, self.sections(), self.graphs), encoding="utf-8")
        return path


# -- running the model ---------------------------------------------------------------------------

class _TimedBackend:
    """Times each Dynamo graph's first call: the fallback when the records have no first-run times
    (GraphRecord.first_call_s, filled by the compiled program)."""

    __name__ = "ember"  # what Dynamo's errors call the backend

    def __init__(self, backend: EmberBackend) -> None:
        self.backend = backend
        self.first_calls: list[float] = []
        # Dynamo enters this around each call: the backend's shape policy and recompile limit.
        self.backend_ctx_ctor = backend.backend_ctx_ctor

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        fn = self.backend(gm, example_inputs)
        done = False

        @functools.wraps(fn)  # keeps attributes such as _boxed_call that Dynamo may look at
        def run(*args: Any) -> Any:
            nonlocal done
            if done:
                return fn(*args)
            done = True
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.first_calls.append(time.perf_counter() - start)
        return run


def _unwrap(model: Callable) -> tuple[Callable, dict[str, Any]]:
    """The original model and options of an ``ember.compile`` result; else the model, no options."""
    backend = getattr(model, "_ember_backend", None)
    if backend is None:
        return model, {}
    orig = getattr(model, "_orig_mod", None) or getattr(model, "_torchdynamo_orig_callable", None) or model
    return orig, dataclasses.asdict(backend.options)


@contextmanager
def _preserve_state(model: Callable) -> Iterator[None]:
    """Leave buffers (e.g. BatchNorm running stats), .grad fields and the RNG as they were."""
    module = model if isinstance(model, torch.nn.Module) else None
    buffers = [(b, b.detach().clone()) for b in module.buffers()] if module is not None else []
    grads = [(p, p.grad) for p in module.parameters()] if module is not None else []
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _leaves_needing_grad(root: torch.Tensor) -> list[torch.Tensor]:
    """Leaf tensors (parameters, inputs) the autograd graph of ``root`` accumulates into."""
    leaves, seen, stack = [], set(), [root.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes carry their leaf
        if isinstance(var, torch.Tensor):
            leaves.append(var)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return leaves


_RECOMPILE = re.compile(r"frame (\S+) compile (\S+):")


def _own_recompiles(log: CompileLog) -> list[str]:
    """Recompiles of frames this backend had compiled before. The backend also logs a frame's
    first compile here when another backend (an earlier explain) compiled it already."""
    real, seen = set(), set()
    for cid, _ in log.frames:
        frame = cid.partition("/")[0]
        if frame in seen:
            real.add(cid)
        seen.add(frame)
    out = []
    for line in log.recompiles:
        m = _RECOMPILE.match(line)
        if m is None or f"{m.group(1)}/{m.group(2)}" in real:
            out.append(line)
    return out


def _run_once(compiled: Callable, args: tuple | list, kwargs: dict[str, Any]) -> tuple[float, float, bool]:
    """One call (and its backward when the output requires grad): (forward s, backward s, training)."""
    start = time.perf_counter()
    out = compiled(*args, **kwargs)
    forward_s = time.perf_counter() - start
    floats = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not (floats and torch.is_grad_enabled()):
        return forward_s, 0.0, False
    loss = sum(t.sum() for t in floats)
    leaves = _leaves_needing_grad(loss)
    start = time.perf_counter()
    # autograd.grad, not .backward(): the backward graph compiles and runs, no .grad is touched.
    torch.autograd.grad(loss, leaves, allow_unused=True)
    return forward_s, time.perf_counter() - start, True


def _device_sync(args: tuple | list, kwargs: dict[str, Any]) -> Callable[[], None] | None:
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves((args, kwargs))):
        return torch.cuda.synchronize
    return None


def explain_with(model: Callable, args: tuple | list = (), kwargs: dict[str, Any] | None = None, *,
                 steps: int | None = None, **options: Any) -> ExplainReport:
    """Compile ``model`` with Ember ``options``, call ``model(*args, **kwargs)`` once (and backward
    when the output requires grad), then ``steps`` more timed steps after two warm-up steps
    (``EMBER_EXPLAIN_STEPS``, default 3; 0: none) for the host time per step, and return the report."""
    history = getattr(getattr(model, "_ember_backend", None), "log", None)
    whole_call = getattr(getattr(model, "_ember_backend", None), "whole_call", None)
    model, inherited = _unwrap(model)
    backend = EmberBackend(Options.from_env(**{**inherited, **options}))
    timed = _TimedBackend(backend)
    compiled = install_eager_fallback(optimize(model, timed, isolate_recompiles=True), model, backend)
    kwargs = kwargs or {}
    steps = config.explain_steps() if steps is None else steps
    host, host_note = None, "not measured (steps=0)"
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    versions = [t._version for t in inputs]
    with _preserve_state(model):
        with collect_graph_breaks() as breaks:
            forward_s, backward_s, training = _run_once(compiled, args, kwargs)
        if steps > 0 and versions != [t._version for t in inputs]:
            host_note = "not measured: the model writes its inputs, and more steps would change the caller's tensors"
        elif steps > 0:  # report/host_time.py
            host = measure_steps(lambda: _run_once(compiled, args, kwargs), lambda: list(backend.programs),
                                 steps, synchronize=_device_sync(args, kwargs))
    log = backend.log
    measured = [g.first_call_s for g in log.graphs if g.first_call_s is not None]
    if measured:
        first_run, note = sum(measured), "per graph, from the records"
    else:
        first_run = sum(timed.first_calls)
        note = "forward graphs only" if training else "all graphs"
    return ExplainReport(
        log=log, target=backend.options.target, training=training, total_s=forward_s + backward_s,
        forward_s=forward_s, backward_s=backward_s, first_run_s=first_run, first_run_note=note,
        dynamo_graphs=len(log.frames), graph_breaks=+breaks.counts,
        break_locations=breaks.where, recompiles=_own_recompiles(log),
        model_compiles=[cid for cid, _ in history.frames] if history else [],
        model_recompiles=_own_recompiles(history) if history else [],
        model_dynamic=list(history.dynamic) if history else [],
        model_gave_up=list(dict.fromkeys([*(history.gave_up if history else []), *log.gave_up])),
        host=host, host_note=host_note,
        model_whole_call=whole_call.describe() if whole_call is not None else "")


def explain(model: Callable, *args: Any, **kwargs: Any) -> ExplainReport:
    """Compile ``model`` with default options (``EMBER_*`` environment), run ``model(*args, **kwargs)``
    once and report what ran where. For other options use ``explain_with``."""
    return explain_with(model, args, kwargs)
