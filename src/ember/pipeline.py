"""One ATen graph through Ember's stages, each a function from one printable artifact to the next:

    captured graph --passes--> passed graph --schedule--> KernelPlan --codegen--> GeneratedKernels
      --kernel_compile--> (numba modules built / Triton jobs submitted) --program--> ProgramSource
      --link--> run(args) --replay--> CompiledGraph (a CUDA-graph runner where the capture rule allows)

Every stage runs through ``instruments.run_stage``: timed into the graph's GraphRecord and visible
to hooks (tests, benchmarks, profilers). Every artifact is written to ``EMBER_DEBUG_DIR`` when set
and printed at ``DEBUG`` levels. A compiled-program cache hit skips from the captured graph to link.
"""

from __future__ import annotations

import hashlib
import linecache
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

import torch
import torch.fx as fx

from ember import config, instruments
from ember.codegen.input_writes import plan_input_writes
from ember.codegen.kernel_source import KernelSource
from ember.codegen.program import ProgramSource, base_namespace, generate_program
from ember.config import Options, settings
from ember.graph_utils import get_attr, is_symbolic, op_family
from ember.instruments import run_stage
from ember.ops import attention, depthwise_conv, max_pool, reflection_pad, small_bmm, tiled_matmul
from ember.passes import PassContext, PassResult, passes_for, run_passes
from ember.passes.attention_seeds import route_attention_seeds
from ember.passes.freeze import static_input_indices
from ember.passes.layout import layout_summary, report_output_strides
from ember.passes.matmul_padding_rule import tf32_matmuls
from ember.passes.pad_matmul import padding_line, padding_summary
from ember.passes.sibling_matmuls import MERGED_META
from ember.report import progress
from ember.report.records import GraphRecord
from ember.runtime.artifacts import ProgramStore, StoredProgram, graph_key, restore_record, stored_program
from ember.runtime.aten_first import AtenFirstRun
from ember.runtime.cache_folder import usable_options
from ember.runtime.cpu_compile import BehindCompile
from ember.runtime.cudagraphs.rules import cudagraph_blocker, read_only_inputs, tensor_free
from ember.runtime.cudagraphs.runner import CudaGraphRunner
from ember.runtime.kernel_module import compile_kept
from ember.runtime.kernels import kernel_file
from ember.runtime.library_warmup import BackgroundReplay, library_calls, replay_here
from ember.runtime.library_warmup import collect as collect_library_calls
from ember.runtime.library_warmup import join_all as join_library_replays
from ember.runtime.library_warmup import start_replay as start_library_replay
from ember.runtime.precompile import PendingCompile, job_for, submit
from ember.runtime.program import CompiledGraph, boxed, expect_strides
from ember.schedule.batched_casts import batch_input_casts
from ember.schedule.plan import FusedGroup, KernelPlan, plan_graph
from ember.schedule.rules import OpClass
from ember.targets import GeneratedKernels, Target, cpu_codegen_unavailable, resolve_target

__all__ = ["compile_graph", "cpu_codegen_unavailable", "debug_folder"]

_PLACEMENT = {OpClass.EXTERN: "library", OpClass.VIEW: "view", OpClass.CONSTANT: "constant",
              OpClass.GETITEM: None, OpClass.FALLBACK: "fallback", OpClass.FROZEN: "frozen"}


@dataclass
class GraphJob:
    """One graph's compile: what every stage reads besides the previous stage's artifact."""

    gm: fx.GraphModule
    example_inputs: list
    options: Options
    record: GraphRecord
    target: Target
    slug: str  # its folder under the debug dir
    level: int  # DEBUG level
    cache_problem: str = ""  # why the cache folder cannot be used ("" when it can)
    stored: StoredProgram | None = None  # the program as the cache keeps it (loaded or built)

    def dump(self, name: str, text: str) -> None:
        if self.options.debug_dir:
            path = Path(self.options.debug_dir) / self.slug / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def debug_folder(title: str) -> str:
    """A graph's folder under the debug dir: "backward 0 (frame 0/0)" -> "backward_0_frame_0-0",
    a name any shell or file copy takes as it is."""
    return re.sub(r"[^\w.-]+", "_", title.replace("/", "-")).strip("_")


def compile_graph(gm: fx.GraphModule, example_inputs: list, options: Options, record: GraphRecord,
                  target: Target | None = None) -> Callable:
    """Compile one AOTAutograd graph; on an internal error run the graph as captured (and say so).
    ``target`` is the frame's resolved target (resolved from the graph's inputs when not given)."""
    reference = fx.GraphModule(gm, _copy_graph(gm.graph)) if options.check else None
    # A backward's inputs are freed as it runs: holding them through its first call for a rerun
    # would raise that call's peak (and the CUDA-graph pool measured on it).
    rescue = _as_captured_later(gm) if record.kind != "backward" and not config.strict() else None
    try:
        if target is None:
            # Every value, not the inputs alone: a graph with no CUDA input can make CUDA tensors.
            target = resolve_target(options.target, [n.meta.get("val") for n in gm.graph.nodes])
        # An unusable cache folder: kernels go to a temporary folder, no program cache (warned once).
        options, cache_problem = usable_options(options)
        job = GraphJob(gm, example_inputs, options, record, target, debug_folder(record.title), config.debug_level(),
                       cache_problem)
        compiled = _compile(job, reference)
        if rescue is not None:
            compiled.rescue = rescue
            compiled.on_rescue = lambda why: _rescued(record, why)
        return boxed(compiled)
    except Exception as err:  # noqa: BLE001 - never fail where eager works
        if config.strict():
            raise
        record.error = f"{type(err).__name__}: {err}"
        warnings.warn(f"ember: could not compile {record.title} ({record.error}); running it through ATen as "
                      "captured. Please report this with the traceback from EMBER_STRICT=1.", stacklevel=2)
        if config.debug_level() >= 1:
            traceback.print_exc()
        fallback = _captured_module(gm, _copy_graph(gm.graph))
        return boxed(CompiledGraph(record.title, fallback.code, lambda args: fallback(*_take(args))))


def _compile(job: GraphJob, reference: fx.GraphModule | None) -> CompiledGraph:
    gm, record = job.gm, job.record
    if any(is_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"):
        raise NotImplementedError("graph has symbolic shapes; Ember compiles static shapes")
    record.target = job.target.name
    if job.options.debug_dir:  # reading .code writes a lazy module's code out
        job.dump("00_captured.py", gm.code)
    # Decided on the captured graph, before the passes rewrite it in place.
    rule = instruments.active().capture_rule or cudagraph_blocker
    blocker = rule(gm, job.example_inputs, record.kind, job.target.name, job.options.cudagraphs)
    # Whole-step programs turn per-graph capture off and capture the step around this program; a
    # graph without tensors (its target is the CPU's for want of any) runs no device work there.
    if tensor_free(gm, job.example_inputs):
        record.whole_step_blocker = None
    else:
        record.whole_step_blocker = (blocker if job.options.cudagraphs
                                     else rule(gm, job.example_inputs, record.kind, job.target.name, True))
    read_only = read_only_inputs(gm) if blocker is None else frozenset()
    store, key = _cache_key(job)
    if store is not None and key is not None and not job.options.debug_dir and job.level == 0:
        # (with a debug folder or DEBUG set the user wants every stage: compile, do not look up)
        run = run_stage("cache_load", record, _load_cached, job, store, key)
        if run is not None:
            assert job.stored is not None
            helper = start_library_replay(job.stored.library_calls)
            return _keep(job, _replay_stage(job, run, blocker, read_only, reference, library=helper), blocker,
                         read_only)

    run_stage("passes", record, _passes_stage, job)
    plan = run_stage("schedule", record, _schedule_stage, job)
    # The libraries' first-call set-up starts now, beside the rest of this compile and the next.
    calls = library_calls(plan.steps)
    helper = start_library_replay(calls)
    kernels = run_stage("codegen", record, _codegen_stage, job, plan)
    pending = run_stage("kernel_compile", record, _kernel_compile_stage, job, kernels)
    behind = pending if isinstance(pending, BehindCompile) else None
    _record_plan(record, plan, kernels)
    program = run_stage("program", record, _program_stage, job, plan, kernels, behind)
    if behind is not None:
        pending = None
    job.stored = stored_program(program.source.text, [(ks.name, ks.module_source()) for ks in program.kernels],
                                program.source.namespace["_consts"], program.source.attrs, job.record, calls)
    if store is not None and key is not None:
        _save(job, store, key)
    return _keep(job, _replay_stage(job, program.run, blocker, read_only, reference, pending, helper), blocker,
                 read_only)


def _keep(job: GraphJob, graph: CompiledGraph, blocker: str | None, read_only: frozenset[int]) -> CompiledGraph:
    """Note on the compiled graph what relinking it elsewhere needs (capture/warm_start.py)."""
    graph.saved = {"program": job.stored, "blocker": blocker, "read_only": sorted(read_only)}
    if job.stored is not None:
        collect_library_calls(job.stored.library_calls)
    return graph


def link_stored(stored: StoredProgram, attrs: dict[str, object], options: Options, record: GraphRecord,
                target: Target, blocker: str | None, read_only: frozenset[int],
                replay_library: bool = False) -> CompiledGraph:
    """A program a previous process compiled (``CompiledGraph.saved``), linked again with its kernels
    and the graph attributes it reads (``attrs``: name in the program -> value), wrapped as
    ``_compile`` wraps a fresh one (CUDA-graph replay where the rule allowed it). ``replay_library``:
    set its libraries up in the helper thread meanwhile, as a compile does."""
    options, cache_problem = usable_options(options)
    job = GraphJob(None, [], options, record, target, debug_folder(record.title), config.debug_level(),  # type: ignore[arg-type]
                   cache_problem, stored)
    run = _link(job, stored.text, stored.kernels, stored.consts, attrs)
    restore_record(record, stored.record)
    record.target = target.name
    record.program = stored.text
    helper = start_library_replay(stored.library_calls) if replay_library else None
    return _keep(job, _replay_stage(job, run, blocker, read_only, None, library=helper), blocker, read_only)


# -- stages --------------------------------------------------------------------------------------

def _passes_stage(job: GraphJob) -> fx.GraphModule:
    """The named graph passes (passes/), in place; each pass's graph goes to the debug folder."""
    record = job.record

    def on_pass(result: PassResult) -> None:
        record.passes.append((result.name, result.seconds, result.changed))
        job.dump(f"{len(record.passes):02d}_{result.name}.py", result.graph_after)
        if job.level >= 3:
            print(f"# ember: {record.title} after {result.name}\n{result.graph_after}")

    from ember.tune.apply import library_chooser
    context = PassContext(record.kind, job.target.name, static_input_indices(), job.options.freeze,
                          job.options.channels_last, list(job.example_inputs),
                          library_choice=library_chooser(job.target, job.options.cache_root(), record),
                          pad_matmul=job.options.pad_matmul, merge_matmuls=job.options.merge_matmuls)
    run_passes(job.gm, passes_for(context), on_result=on_pass,
               keep_text=job.level >= 3 or bool(job.options.debug_dir))
    record.layout = layout_summary(job.gm)
    report_output_strides(record.kind, record.layout)
    record.matmul_padding = padding_summary(job.gm)
    record.merged_matmuls = list(job.gm.meta.get(MERGED_META, []))
    if job.level >= 1 and record.matmul_padding.get("padded"):
        print(f"# ember: {record.title}: {padding_line(record.matmul_padding)}")
    return job.gm


def _schedule_stage(job: GraphJob) -> KernelPlan:
    """Partition the graph into Extern / Fused / Fallback steps (schedule/)."""
    # cat / slice_scatter fuse where the generator writes range selects (Triton, not numba).
    plan = plan_graph(job.gm.graph, fuse_range_select=job.options.fuse_cat and job.target.language == "triton",
                      refine_views=job.options.fuse_reshapes, merge_groups=job.options.merge_groups,
                      recompute=job.options.recompute_values,
                      fuse_merged_row_sums=settings().fuse_merged_row_sums and job.target.language == "triton")
    if job.options.batch_casts and job.target.language == "triton":
        batch_input_casts(plan)  # weights cast under autocast: a few multi-tensor kernels, not one each
    job.record.plan_text = plan.describe()
    job.dump("plan.txt", job.record.plan_text)
    if job.level >= 1:
        print(f"# ember: kernel plan of {job.record.title}\n{job.record.plan_text}")
    return plan


def _codegen_stage(job: GraphJob, plan: KernelPlan) -> GeneratedKernels:
    """Kernel sources by the generator's rules, then the tuned configurations the tuning database
    holds for this device (ember/tune/apply.py; nothing to do when it has none)."""
    from ember.tune.apply import apply_tuned
    return apply_tuned(job.target.generate(plan), plan, job.target, job.options.cache_root(), job.record)


def _kernel_compile_stage(job: GraphJob, kernels: GeneratedKernels) -> PendingCompile | BehindCompile | None:
    """numba modules compiled now, or, where numba has not cached them, handed to workers while
    the first calls run through ATen (runtime/aten_first.py); Triton kernels submitted to the
    compile workers, not awaited: the program's first call waits (_await_kernels). With the
    generated kernels go those of Ember's own ops that the graph launches."""
    behind = job.target.compile_behind(kernels, job.options.kernel_dir())
    if behind is None:
        job.target.compile_kernels(kernels, job.options.kernel_dir())
    job.record.kernels = len(kernels.by_step)
    job.record.unique_kernels = len({k.name for k in kernels.by_step.values()})
    if behind is not None:
        return behind
    if not job.target.precompiles():
        return None
    jobs = [job_for(kernel_file(ks, job.options.kernel_dir()), ks.name, ks.arg_dtypes(), ks.meta)
            for ks in kernels.unique()]
    jobs += reflection_pad.compile_jobs(job.gm) + max_pool.compile_jobs(job.gm) + depthwise_conv.compile_jobs(job.gm)
    jobs += small_bmm.compile_jobs(job.gm) + tiled_matmul.compile_jobs(job.gm) + attention.compile_jobs(job.gm)
    return submit(jobs) if jobs else None


@dataclass
class LinkedProgram:
    """The program stage's artifact: the generated source and its linked ``run``."""

    source: ProgramSource
    kernels: list[KernelSource]
    run: Callable[[list], object]

    def __str__(self) -> str:
        return self.source.text


def _program_stage(job: GraphJob, plan: KernelPlan, kernels: GeneratedKernels,
                   behind: BehindCompile | None = None) -> LinkedProgram:
    """Generate the program (codegen/program.py) and link it with its kernels; with kernels still
    compiling ``behind``, link the plan's ATen program for the first calls too."""
    record = job.record
    program = generate_program(job.gm, plan, kernels.by_step, record.title, _expect_nodes(plan, kernels.by_step))
    unique = kernels.unique()
    for ks in unique:
        record.kernel_sources[ks.name] = ks.source
        job.dump(f"kernels/{ks.name}.py", ks.annotated_source())
        if job.level >= 2:
            print(f"# ember: kernel {ks.name}\n{ks.source}")
    attrs = {name: program.namespace[name] for name in program.attrs}
    if behind is None:
        run = _link(job, program.text, unique, program.namespace["_consts"], attrs)
    else:
        run = _aten_first(job, plan, behind, lambda: _link(job, program.text, unique, program.namespace["_consts"], attrs))
    record.program = program.text
    job.dump("program.py", program.text)
    if job.level >= 2:
        print(program.text)
    return LinkedProgram(program, unique, run)


def _aten_first(job: GraphJob, plan: KernelPlan, behind: BehindCompile,
                link_kernels: Callable[[], Callable[[list], object]]) -> AtenFirstRun:
    """The plan's program with every fused group on ATen, run until ``behind`` is done."""
    aten = generate_program(job.gm, plan, {}, job.record.title, _expect_nodes(plan, {}))
    job.dump("program_aten_first.py", aten.text)
    aten_run = _link(job, aten.text, [], aten.namespace["_consts"], {name: aten.namespace[name] for name in aten.attrs})
    return AtenFirstRun(aten_run, behind, link_kernels, on_status=lambda status: setattr(job.record, "aten_first", status))


def _replay_stage(job: GraphJob, run: Callable[[list], object], blocker: str | None, read_only: frozenset[int],
                  reference: fx.GraphModule | None, pending: PendingCompile | None = None,
                  library: BackgroundReplay | None = None) -> CompiledGraph:
    """Wrap the program: a CUDA-graph runner where the capture rule allows, the first-call wait
    for kernels still compiling and library set-up still running, and check=True's comparison
    with the captured graph."""
    record = job.record
    if blocker is None:
        device = instruments.active().cudagraph_device
        extra = {"backend": device} if device is not None else {}
        run = CudaGraphRunner(run, record.title, on_status=lambda status: setattr(record, "cudagraph", status),
                              read_only=read_only, **extra)
    else:
        record.cudagraph = f"not captured: {blocker}"
    graph = CompiledGraph(record.title, record.program, run, reference, job.options.check)
    graph.after_first_call = lambda seconds: setattr(record, "first_call_s", seconds)
    if pending is not None or library is not None:
        graph.before_first_call = lambda: _await_kernels(record, pending, library)
    return graph


# -- the compiled-program cache ------------------------------------------------------------------

def _cache_key(job: GraphJob) -> tuple[ProgramStore | None, str | None]:
    caching = job.options.cache  # the option already holds argument > patch > environment
    store = ProgramStore(job.options.cache_root()) if caching and not job.cache_problem else None
    # The layout and matmul-padding options change the program: part of the key (padding float32
    # depends on whether TF32 is allowed).
    key_target = job.target.name if job.options.channels_last else f"{job.target.name}+nchw"
    key_target += "" if job.options.fuse_reshapes else "+noreshape"
    key_target += "" if job.options.merge_groups else "+nomerge"
    key_target += "" if job.options.recompute_values else "+norecompute"
    key_target += "" if job.options.batch_casts else "+nobatchcasts"
    if job.target.gpu_code_path:
        key_target += "" if job.options.fuse_cat else "+nocat"
        key_target += "" if job.options.merge_matmuls else "+nomergemm"
        key_target += f"+pad:{job.options.pad_matmul}{'+tf32' if tf32_matmuls() else ''}"
    if store is not None:  # tuned kernels change the program: a database change is a new key
        from ember.tune.apply import tuning_stamp
        key_target += f"+tuning:{tuning_stamp(job.options.cache_root())}"
    key = graph_key(job.gm, job.example_inputs, key_target, job.record.kind) if store is not None else None
    job.record.cache = (f"off: {job.cache_problem}" if job.cache_problem and caching else "off"
                        if store is None else "not cacheable (large constant tensor)" if key is None else "miss")
    return store, key


def _load_cached(job: GraphJob, store: ProgramStore, key: str) -> Callable[[list], object] | None:
    hit = store.load(key)
    if hit is None:
        return None
    try:
        run = _link(job, hit.text, hit.kernels, hit.consts, {name: get_attr(job.gm, attr) for name, attr in hit.attrs.items()})
    except Exception:  # noqa: BLE001 - a stale or damaged entry: rebuild it
        store.discard(key)
        return None
    job.stored = hit
    restore_record(job.record, hit.record)
    report_output_strides(job.record.kind, job.record.layout)
    job.record.cache = "hit"
    job.record.program = hit.text
    job.dump("program.py", hit.text)
    return run


def _save(job: GraphJob, store: ProgramStore, key: str) -> None:
    assert job.stored is not None
    saved = store.save(key, job.stored, job.record.title)
    job.record.cache = "stored" if saved else f"not stored: {store.error}"


# -- helpers -------------------------------------------------------------------------------------

def _await_kernels(record: GraphRecord, pending: PendingCompile | None, library: BackgroundReplay | None) -> None:
    """Before a program's first run: wait for its kernels, then for every library set-up still
    running in the helper thread (runtime/library_warmup.py; the first run must not meet it). The
    kernels' wait counts as kernel_compile (what the stage cost the first call beyond the time the
    next graph's compile overlapped). First, this thread (the one that runs the program) makes
    the graph's calls whose set-up torch keeps per thread (``replay_here``), while the workers
    may still be compiling."""
    here = replay_here(library.calls) if library is not None else None
    if pending is not None:
        start = time.perf_counter()
        progress.waiting_for_kernels(pending)
        stats = pending.wait()
        stage = record.stage_seconds
        stage["kernel_compile"] = stage.get("kernel_compile", 0.0) + time.perf_counter() - start
        record.compile_note = stats.describe()
        if config.debug_level() >= 1:
            print(f"# ember: kernel compile of {record.title}: {record.compile_note}")
            for err in stats.errors:
                print(f"# ember: precompile: {err}")
    if library is not None:
        start = time.perf_counter()
        replayed = library.join()
        join_library_replays()
        waited = time.perf_counter() - start
        note = (f"beside the compile: {replayed.describe()} (first run waited {waited:.3f} s)" if replayed
                else "beside the compile: the library set-up thread ended without a result")
        if here is not None and here.calls:
            note += f"; on the running thread before its first run: {here.describe()}"
        record.compile_note = f"{record.compile_note}; {note}" if record.compile_note else note


def _link(job: GraphJob, text: str, kernels: list, consts: list, attrs: dict[str, object]) -> Callable[[list], object]:
    """Execute a program's text in a fresh namespace with its kernels loaded; returns ``run``."""
    namespace = base_namespace()
    namespace.update(attrs)
    namespace["_consts"] = consts
    namespace["_expect"] = expect_strides
    for k in kernels:
        namespace[k.name] = job.target.load(k, job.options.kernel_dir())
    filename = f"<ember program {job.record.title}>"
    # Tracebacks, profilers and allocation traces then show the program's own lines.
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(_program_code(job, text, filename), namespace)
    run = namespace["run"]
    if "refresh_frozen" in namespace:  # the CUDA-graph runner calls it before each replay
        run.refresh_frozen = namespace["refresh_frozen"]
    # Tensors the program holds (graph attributes, folded values): an output that is one of them
    # is handed out as it is by every replay, not as graph memory (runtime/cudagraphs/recording.py).
    run.constants = [v for v in (*attrs.values(), *consts) if isinstance(v, torch.Tensor)]
    return run


def _program_code(job: GraphJob, text: str, filename: str) -> CodeType:
    """The program's code object; with the program cache and ``kernel_load_cache`` on, kept in the
    kernel folder by the text's hash like a kernel module's, so a process that loads a stored
    program does not compile its text again (bert's two training programs: 0.064 s of a warm
    first call on an H200 host under cProfile)."""
    if not (job.options.cache and settings().kernel_load_cache):
        return compile(text, filename, "exec")
    source = text.encode()
    name = hashlib.sha256(source).hexdigest()[:32]
    folder = job.options.kernel_dir() / "__pycache__"
    return compile_kept(source, filename, folder / f"program-{name}.ember-{sys.implementation.cache_tag}.code")


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


def _record_plan(record: GraphRecord, plan: KernelPlan, kernels: GeneratedKernels) -> None:
    # A write into a graph input that a kernel stores in place runs in generated code (codegen/input_writes.py).
    stored = plan_input_writes(plan, kernels.by_step, settings().input_writes_as_stores).elided
    for node, (cls, reason) in plan.classes.items():
        record.op_classes[cls.value] += 1
        step = plan.step_of.get(node)
        if node in stored:
            where = "generated"
        elif isinstance(step, FusedGroup) and step.index in kernels.by_rule:
            where, reason = "fallback", kernels.by_rule[step.index]
        elif step is not None and step.kind == "foreach":
            where = "library"  # ATen's multi-tensor copy (schedule/batched_casts.py)
        elif isinstance(step, FusedGroup) or (step is not None and step.kind == "fused"):
            where = "generated" if step.index in kernels.by_step else "fused-aten"
        else:
            where = _PLACEMENT.get(cls)
        if where is None:
            continue
        record.placement.setdefault(where, Counter())[op_family(node)] += 1
        if where == "fallback":
            record.fallback_reasons[f"{op_family(node)}: {reason}"] += 1
    for s in plan.steps:
        record.steps[s.kind] += 1
    record.fusion_decisions.update(plan.fusion_decisions())
    for why, count in kernels.on_aten.items():
        record.fallback_reasons[f"fused group via ATen: {why}"] += count


def _as_captured_later(gm: fx.GraphModule) -> Callable[[], Callable[[list], object]]:
    """The graph as captured, copied now (the passes rewrite ``gm`` in place), made runnable
    only if the program fails on its first call (``CompiledGraph.rescue``)."""
    graph = _copy_graph(gm.graph)
    attrs = {str(n.target): get_attr(gm, str(n.target)) for n in graph.nodes if n.op == "get_attr"}

    def make() -> Callable[[list], object]:
        module = _captured_module(attrs, graph)
        return lambda args: module(*_take(args))
    return make


def _captured_module(root: fx.GraphModule | dict[str, object], graph: fx.Graph) -> fx.GraphModule:
    """A captured graph made runnable op by op through ATen (a compile that failed, or a program
    that failed on its first call): it runs uncaptured, maybe after a replayed forward, so its
    attention seeds take the form that status reads (passes/attention_seeds.py)."""
    module = fx.GraphModule(root, graph)
    if route_attention_seeds(module):
        module.recompile()
    return module


def _rescued(record: GraphRecord, why: str) -> None:
    record.error = f"failed on its first call, runs through ATen as captured: {why}"
    record.cudagraph = "not captured: the program failed on its first call"


def _take(args: list) -> list:
    out = list(args)
    args.clear()
    return out


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new
