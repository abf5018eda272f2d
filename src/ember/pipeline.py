"""One ATen graph through Ember's stages: passes -> schedule -> codegen -> load -> program.

Each stage is timed into the graph's GraphRecord. Every artefact (graph after each pass,
kernel plan, kernel sources, program) is printable, and is written to ``EMBER_DEBUG_DIR``
when set.
"""

from __future__ import annotations

import linecache
import re
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx

from ember import config
from ember.capture import reflection_pad
from ember.codegen.cpu_kernel import CpuUnsupported, generate_cpu
from ember.codegen.kernel_source import KernelSource, launch_kernels
from ember.codegen.program import base_namespace, generate_program, get_attr
from ember.codegen.triton_kernel import generate_triton
from ember.config import Options
from ember.passes import PassContext, PassResult, passes_for, run_passes
from ember.passes.freeze import static_input_indices
from ember.passes.layout import layout_summary, report_output_strides
from ember.report.records import GraphRecord
from ember.runtime.artifacts import ProgramStore, graph_key, restore_record, stored_program
from ember.runtime.capture_rules import cudagraph_blocker, read_only_inputs
from ember.runtime.cudagraph import CudaGraphRunner
from ember.runtime.kernels import compile_cpu_kernels, kernel_file, load_kernel
from ember.runtime.precompile import PendingCompile, job_for, submit
from ember.runtime.program import CompiledGraph, boxed, expect_strides
from ember.schedule.plan import FusedGroup, KernelPlan, plan_graph
from ember.schedule.rules import OpClass

_PLACEMENT = {OpClass.EXTERN: "library", OpClass.VIEW: "view", OpClass.CONSTANT: "constant",
              OpClass.GETITEM: None, OpClass.FALLBACK: "fallback", OpClass.FROZEN: "frozen"}


def _resolve_target(gm: fx.GraphModule, options: Options) -> str:
    if options.target != "auto":
        return options.target
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.device.type == "cuda":
            return "triton"
    return "aten" if cpu_codegen_unavailable() else "cpu"


_NUMBA_PROBLEM: list[str] = []


def cpu_codegen_unavailable() -> str:
    """Why CPU kernels cannot be generated in this process ("" when numba imports)."""
    if not _NUMBA_PROBLEM:
        try:
            import numba  # noqa: F401 - only whether it imports
        except Exception as err:  # noqa: BLE001 - any import failure means "use ATen"
            _NUMBA_PROBLEM.append(f"numba cannot be imported ({type(err).__name__}: {err})")
        else:
            _NUMBA_PROBLEM.append("")
    return _NUMBA_PROBLEM[0]


def debug_folder(title: str) -> str:
    """A graph's folder under the debug dir: "backward 0 (frame 0/0)" -> "backward_0_frame_0-0",
    a name any shell or file copy takes as it is."""
    return re.sub(r"[^\w.-]+", "_", title.replace("/", "-")).strip("_")


def _dump(options: Options, name: str, text: str) -> None:
    if options.debug_dir:
        path = Path(options.debug_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._overloadpacket.__name__}"
    return getattr(target, "__name__", str(target))


def _symbolic(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            if any(not isinstance(s, int) for s in val.shape):
                return True
        elif n.op == "placeholder" and isinstance(val, torch.SymInt):
            return True
    return False


def _expect_nodes(plan: KernelPlan, kernels: dict[int, KernelSource]) -> set[fx.Node]:
    """Tensors a generated kernel reads that Ember did not allocate: their strides get checked."""
    expect = set()
    for index in kernels:
        group = plan.steps[index]
        for a in group.inputs:
            root = a
            while True:
                step = plan.step_of.get(root)
                if step is None or step.kind != "view" or not isinstance(root.args[0], fx.Node):
                    break
                root = root.args[0]
            step = plan.step_of.get(root)
            if step is None or step.kind in ("extern", "fallback", "getitem", "frozen"):
                if root.op in ("placeholder", "call_function"):
                    expect.add(root)
    return expect


def _record_plan(record: GraphRecord, plan: KernelPlan, kernels: dict[int, KernelSource]) -> None:
    for node, (cls, reason) in plan.classes.items():
        record.op_classes[cls.value] += 1
        step = plan.step_of.get(node)
        if isinstance(step, FusedGroup) or (step is not None and step.kind == "fused"):
            where = "generated" if step.index in kernels else "fused-aten"
        else:
            where = _PLACEMENT.get(cls)
        if where is None:
            continue
        record.placement.setdefault(where, Counter())[_op_name(node)] += 1
        if where == "fallback":
            record.fallback_reasons[f"{_op_name(node)}: {reason}"] += 1
    for s in plan.steps:
        record.steps[s.kind] += 1
    record.fusion_decisions.update(plan.fusion_decisions())


def compile_graph(gm: fx.GraphModule, example_inputs: list, options: Options, record: GraphRecord) -> Callable:
    """Compile one AOTAutograd graph; on an internal error run the graph as captured (and say so)."""
    reference = fx.GraphModule(gm, _copy_graph(gm.graph)) if options.check else None
    try:
        return boxed(_compile(gm, example_inputs, options, record, reference))
    except Exception as err:  # noqa: BLE001 - never fail where eager works
        if config.settings().strict:
            raise
        record.error = f"{type(err).__name__}: {err}"
        warnings.warn(f"ember: could not compile {record.title} ({record.error}); running it through ATen as "
                      "captured. Please report this with the traceback from EMBER_STRICT=1.", stacklevel=2)
        if config.settings().debug >= 1:
            traceback.print_exc()
        fallback = fx.GraphModule(gm, _copy_graph(gm.graph))
        return boxed(CompiledGraph(record.title, fallback.code, lambda args: fallback(*_take(args))))


def _take(args: list) -> list:
    out = list(args)
    args.clear()
    return out


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _compile(gm: fx.GraphModule, example_inputs: list, options: Options, record: GraphRecord,
             reference: fx.GraphModule | None) -> CompiledGraph:
    level = config.settings().debug
    slug = debug_folder(record.title)
    stage = record.stage_seconds
    if _symbolic(gm):
        raise NotImplementedError("graph has symbolic shapes; Ember compiles static shapes")
    target = _resolve_target(gm, options)
    record.target = target
    _dump(options, f"{slug}/00_captured.py", gm.code)
    # Decided on the captured graph, before the passes rewrite it in place.
    blocker = cudagraph_blocker(gm, example_inputs, record.kind, target, options.cudagraphs)
    read_only = read_only_inputs(gm) if blocker is None else frozenset()
    store = ProgramStore(options.cache_root()) if options.cache else None
    # The layout option changes the program: part of the key.
    key_target = target if options.channels_last else f"{target}+nchw"
    key = graph_key(gm, example_inputs, key_target, record.kind) if store is not None else None
    record.cache = "off" if store is None else "not cacheable (large constant tensor)" if key is None else "miss"
    # With a debug folder or DEBUG set the user wants every stage: compile, do not look up.
    if store is not None and key is not None and not options.debug_dir and level == 0:
        start = time.perf_counter()
        hit = store.load(key)
        if hit is not None:
            try:
                run = _link(record, hit.text, hit.kernels, hit.consts,
                            {name: get_attr(gm, attr) for name, attr in hit.attrs.items()}, options, target)
            except Exception:  # noqa: BLE001 - a stale or damaged entry: rebuild it
                store.discard(key)
            else:
                restore_record(record, hit.record)
                report_output_strides(record.kind, record.layout)
                record.cache = "hit"
                stage["cache_load"] = time.perf_counter() - start
                _dump(options, f"{slug}/program.py", hit.text)
                return _finish(record, run, hit.text, blocker, read_only, reference, options)

    def on_pass(result: PassResult) -> None:
        record.passes.append((result.name, result.seconds, result.changed))
        _dump(options, f"{slug}/{len(record.passes):02d}_{result.name}.py", result.graph_after)
        if level >= 3:
            print(f"# ember: {record.title} after {result.name}\n{result.graph_after}")

    start = time.perf_counter()
    context = PassContext(record.kind, target, static_input_indices(), options.freeze, options.channels_last,
                          list(example_inputs))
    run_passes(gm, passes_for(context), on_result=on_pass, keep_text=level >= 3 or bool(options.debug_dir))
    record.layout = layout_summary(gm)
    report_output_strides(record.kind, record.layout)
    stage["passes"] = time.perf_counter() - start

    start = time.perf_counter()
    plan = plan_graph(gm.graph)
    stage["schedule"] = time.perf_counter() - start
    record.plan_text = plan.describe()
    _dump(options, f"{slug}/plan.txt", record.plan_text)
    if level >= 1:
        print(f"# ember: kernel plan of {record.title}\n{record.plan_text}")

    start = time.perf_counter()
    kernels: dict[int, KernelSource] = {}
    on_aten: Counter = Counter()  # fused groups left on the ATen path, by reason
    if target in ("triton", "triton-interpret"):
        for group in plan.fused():
            kernels[group.index] = generate_triton(group, interpret=target == "triton-interpret")
    elif target == "cpu":
        for group in plan.fused():
            try:
                kernels[group.index] = generate_cpu(group)
            except CpuUnsupported as why:
                on_aten[str(why)] += 1
            except Exception as err:  # noqa: BLE001 - a generator bug costs this group its kernel, never the graph
                if config.settings().strict:
                    raise
                on_aten[f"CPU code generator error {type(err).__name__}: {err}"] += 1
    elif target == "aten" and options.target == "auto" and cpu_codegen_unavailable():
        on_aten[cpu_codegen_unavailable()] += len(plan.fused())
    stage["codegen"] = time.perf_counter() - start
    if target == "cpu" and kernels:
        # Compile each unique kernel module now (or load numba's cached machine code), so the
        # time shows as kernel_compile; a module that fails to compile sends its groups to ATen.
        start = time.perf_counter()
        failed = compile_cpu_kernels(list(kernels.values()), options.kernel_dir())
        if failed and config.settings().strict:
            raise RuntimeError(f"CPU kernel compile failed: {next(iter(failed.values()))}")
        for index in [i for i, ks in kernels.items() if ks.digest in failed]:
            on_aten[f"CPU kernel compile error: {failed[kernels.pop(index).digest]}"] += 1
        stage["kernel_compile"] = time.perf_counter() - start
    record.kernels = len(kernels)
    record.unique_kernels = len({k.name for k in kernels.values()})
    _record_plan(record, plan, kernels)
    for why, count in on_aten.items():
        record.fallback_reasons[f"fused group via ATen: {why}"] += count

    pending = None
    if target == "triton":
        # Submitted, not awaited: the program's first call waits (_await_kernels). With the
        # generated kernels go those of Ember's custom ops that the graph launches.
        start = time.perf_counter()
        jobs = [job_for(kernel_file(ks, options.kernel_dir()), ks.name, ks.arg_dtypes(), ks.meta)
                for ks in launch_kernels(kernels)] + reflection_pad.compile_jobs(gm)
        if jobs:
            pending = submit(jobs)
            stage["kernel_compile"] = time.perf_counter() - start

    start = time.perf_counter()
    program = generate_program(gm, plan, kernels, record.title, _expect_nodes(plan, kernels))
    unique = list({ks.name: ks for ks in launch_kernels(kernels)}.values())
    for ks in unique:
        record.kernel_sources[ks.name] = ks.source
        _dump(options, f"{slug}/kernels/{ks.name}.py", ks.annotated_source())
        if level >= 2:
            print(f"# ember: kernel {ks.name}\n{ks.source}")
    consts = program.namespace["_consts"]
    attrs = {name: program.namespace[name] for name in program.attrs}
    run = _link(record, program.text, unique, consts, attrs, options, target)
    stage["program"] = time.perf_counter() - start
    record.program = program.text
    _dump(options, f"{slug}/program.py", program.text)
    if level >= 2:
        print(program.text)
    if store is not None and key is not None:
        kept = [(ks.name, ks.module_source()) for ks in unique]
        saved = store.save(key, stored_program(program.text, kept, consts, program.attrs, record), record.title)
        record.cache = "stored" if saved else "not cacheable (constants cannot be stored)"
    return _finish(record, run, program.text, blocker, read_only, reference, options, pending)


def _await_kernels(record: GraphRecord, pending: PendingCompile) -> None:
    """Before a program's first run: wait for its kernels. The wait counts as kernel_compile
    (what the stage cost the first call beyond the time the next graph's compile overlapped)."""
    start = time.perf_counter()
    stats = pending.wait()
    stage = record.stage_seconds
    stage["kernel_compile"] = stage.get("kernel_compile", 0.0) + time.perf_counter() - start
    record.compile_note = stats.describe()
    if config.settings().debug >= 1:
        print(f"# ember: kernel compile of {record.title}: {record.compile_note}")
        for err in stats.errors:
            print(f"# ember: precompile: {err}")


def _link(record: GraphRecord, text: str, kernels: list, consts: list, attrs: dict[str, object],
          options: Options, target: str) -> Callable[[list], object]:
    """Execute a program's text in a fresh namespace with its kernels loaded; returns ``run``."""
    namespace = base_namespace()
    namespace.update(attrs)
    namespace["_consts"] = consts
    namespace["_expect"] = expect_strides
    for k in kernels:
        namespace[k.name] = load_kernel(k, options.kernel_dir(), interpret=target == "triton-interpret")
    filename = f"<ember program {record.title}>"
    # Tracebacks, profilers and allocation traces then show the program's own lines.
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec"), namespace)
    return namespace["run"]


def _finish(record: GraphRecord, run: Callable[[list], object], text: str, blocker: str | None,
            read_only: frozenset[int], reference: fx.GraphModule | None, options: Options,
            pending: PendingCompile | None = None) -> CompiledGraph:
    if blocker is None:
        run = CudaGraphRunner(run, record.title, on_status=lambda status: setattr(record, "cudagraph", status),
                              read_only=read_only)
    else:
        record.cudagraph = f"not captured: {blocker}"
    graph = CompiledGraph(record.title, text, run, reference, options.check)
    graph.after_first_call = lambda seconds: setattr(record, "first_call_s", seconds)
    if pending is not None:
        graph.before_first_call = lambda: _await_kernels(record, pending)
    return graph
