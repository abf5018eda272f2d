"""The TorchDynamo backend: Dynamo FX graph -> AOTAutograd ATen graphs -> Ember programs.

Training graphs are split by AOTAutograd into a forward and a backward graph, both compiled
by Ember; with grad disabled AOTAutograd hands over one inference graph. Registered as the
``torch.compile`` backend ``"ember"`` (entry point group ``torch_dynamo_backends``).

Recompiles (``ember.compile``). Dynamo guards every graph on its inputs' shapes, dtypes and
devices; a call that fails them compiles again. Each frame gets up to ``max_recompiles`` static
specialisations (Ember generates its kernels for exact shapes). Once a frame of the model has
used them up, Dynamo's automatic dynamic shapes are switched on for the model's calls: the next
recompile of a frame whose sizes changed traces ONE dynamic-shape graph (the changed sizes
symbolic) that serves every later size. Ember compiles static shapes only, so a dynamic-shape
graph runs through ATen as captured (every op reported as a fallback with that reason). Past
``max_recompiles + DYNAMIC_RECOMPILES`` compiles of one frame Dynamo runs it eagerly. Every
recompile is logged with what changed, and whether it made a dynamic-shape graph.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import logging
import warnings
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember import compat
from ember.capture.aot_settings import aot_graph_text_off, backward_with_forward, gc_paused, rng_ops_kept
from ember.capture.decompositions import decomposition_table
from ember.capture.frame_cache import compile_frame as compile_cached_frame
from ember.capture.instance_norm import rewrite_instance_norm
from ember.capture.partition import partition_joint_graph
from ember.capture.rng_states import fix_rng_state_sizes
from ember.config import Options, settings
from ember.graph_utils import is_symbolic
from ember.ops.rnn import rewrite_long_rnns
from ember.ops.upsample import rewrite_nearest_interpolate
from ember.pipeline import compile_graph
from ember.report import progress
from ember.report.records import CompileLog, GraphRecord
from ember.runtime.cudagraphs.call_sites import CallClock
from ember.runtime.cudagraphs.runner import GraphPool, share_pool
from ember.runtime.precompile import start_workers
from ember.runtime.program import CompiledGraph, boxed
from ember.targets import Target, frame_values, resolve_target

# Compiles of one frame Dynamo still allows after its static budget (more dynamic dims, a new
# dtype or grad mode) before it runs the frame eagerly.
DYNAMIC_RECOMPILES = 4
_LIMIT = compat.recompile_limit_name()


# Dynamo's switch for tracing RNN modules, set per call by ShapePolicy where this torch has it.
# None: decided per call (ShapePolicy).
_RNN_SWITCH: tuple[tuple[str, None], ...] = (("allow_rnn", None),) if hasattr(torch._dynamo.config, "allow_rnn") else ()
# Dynamo's recursive dict-tag guards (read when a frame's guards are built), where this torch has
# them: set during Ember's calls when Options.dict_tag_guards is given, else torch's own setting.
_DICT_TAGS = "use_recursive_dict_tags_for_guards" if hasattr(torch._dynamo.config,
                                                             "use_recursive_dict_tags_for_guards") else None

_DECOMPOSITIONS: dict[tuple[bool, bool], dict] = {}


def _decompositions(cpu_inference: bool = False, gpu: bool = False) -> dict:
    if (cpu_inference, gpu) not in _DECOMPOSITIONS:
        _DECOMPOSITIONS[cpu_inference, gpu] = decomposition_table(cpu_inference, gpu)
    return _DECOMPOSITIONS[cpu_inference, gpu]


def _cpu_inference(example_inputs: list, options: Options, target: Target) -> bool:
    """Whether this frame becomes a CPU inference graph (grad off, every tensor on the CPU)."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return (not torch.is_grad_enabled() and target.cpu_library_passes and options.freeze
            and all(t.device.type == "cpu" for t in tensors))


def _signature(inputs: list) -> list[str]:
    sig = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            sig.append(f"{x.dtype}{list(x.shape)}@{x.device}")
        elif isinstance(x, torch.SymInt):
            sig.append(f"SymInt {x}")
        else:
            sig.append(type(x).__name__)
    return sig


def _symbolic_inputs(gm: fx.GraphModule, key: str) -> list[str]:
    """The graph's inputs with symbolic sizes (``key``: "example_value" for Dynamo's graph, "val"
    for AOTAutograd's), e.g. ``torch.float32[s77, 7]@cpu``."""
    vals = [n.meta.get(key) for n in gm.graph.nodes if n.op == "placeholder"]
    return _signature([v for v in vals if isinstance(v, torch.Tensor) and is_symbolic(v)])


# The id of a warm start's own trace ("warm/N", its N-th saved program): torch's ahead-of-time
# compile runs Dynamo without a compile id (capture/warm_start.py sets it).
WARM_COMPILE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("ember_warm_compile_id", default=None)


def _compile_id() -> str:
    """Dynamo's "frame/compile" id of the compile in progress, for titles and the log ("?" if unknown)."""
    return compat.current_compile_id() or WARM_COMPILE_ID.get() or "?"


# The EmberBackend whose model call is in progress (shape_policy), to whom a recompile-limit
# message of Dynamo belongs.
_CALLING: list[EmberBackend] = []


class _RecompileLimitWatch(logging.Filter):
    """Dynamo logs "torch._dynamo hit config.recompile_limit" and from then on runs the frame
    eagerly. Ember notes it in the model's log, and warns once per model and function."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _CALLING and str(record.msg).startswith("torch._dynamo hit config."):
            args = record.args if isinstance(record.args, tuple) else ()
            if len(args) >= 4:
                limit, value, function, reason = (str(a) for a in args[:4])
                note = f"{function}: Dynamo hit {limit} ({value}); last reason: {reason.strip()}"
            else:
                note = record.getMessage().splitlines()[0]
            _CALLING[-1].dynamo_gave_up(note)
        return True


logging.getLogger("torch._dynamo.convert_frame").addFilter(_RecompileLimitWatch())


class ShapePolicy:
    """Entered around every call of a compiled model (Dynamo's ``backend_ctx_ctor``): sets the
    model's Dynamo settings where they differ and opens the call's progress scope. A plain class,
    and only changed settings written and restored: a generator-based context manager setting
    and restoring all three cost 12.5 us a call on the CI CPU, host time a batch-1 call adds."""

    __slots__ = ("backend", "changed", "scope")

    def __init__(self, backend: EmberBackend) -> None:
        self.backend = backend
        self.changed: list[tuple[str, object]] = []
        self.scope: progress.Scope | None = None

    def __enter__(self) -> None:
        backend = self.backend
        wanted = backend.dynamo_settings
        if wanted is None:
            wanted = backend.dynamo_settings = (
                ("automatic_dynamic_shapes", backend.dynamic_shapes_on()), ("assume_static_by_default", True),
                (_LIMIT, backend.static_budget + DYNAMIC_RECOMPILES)) + _RNN_SWITCH
            if _DICT_TAGS and backend.options.dict_tag_guards is not None:
                wanted = backend.dynamo_settings = wanted + ((_DICT_TAGS, backend.options.dict_tag_guards),)
        cfg = torch._dynamo.config
        for name, value in wanted:
            if value is None:  # allow_rnn: on for inference calls (Options.trace_rnn); else the user's
                if not backend.options.trace_rnn or torch.is_grad_enabled():
                    continue
                value = True
            old = getattr(cfg, name)
            if old != value:
                setattr(cfg, name, value)
                self.changed.append((name, old))
        _CALLING.append(backend)
        backend.call_clock.calls += 1
        self.scope = progress.open_scope(backend.options.progress)  # a compile's progress line

    def __exit__(self, *exc: object) -> None:
        progress.close_scope(self.scope)
        _CALLING.pop()
        cfg = torch._dynamo.config
        for name, old in reversed(self.changed):
            setattr(cfg, name, old)
        self.changed.clear()


class EmberBackend:
    """A ``torch.compile`` backend with its options and a log of everything it compiled."""

    _ids = itertools.count()
    __name__ = "ember"  # what Dynamo's errors call the backend (backend='ember', not '?')

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self.log = CompileLog()
        self.programs: list[tuple[GraphRecord, CompiledGraph]] = []  # every compiled graph, with its record
        self.static_compiles: Counter = Counter()  # frame id -> static-shape compiles
        # One CUDA-graph memory pool for every training graph of this model, so that a backward
        # reuses the memory of the activations it consumes (runtime/cudagraphs/runner.py).
        self.graph_pool = GraphPool()
        # Calls of the compiled model, counted by ShapePolicy: a graph run several times in one
        # gets a CUDA graph per call (runtime/cudagraphs/call_sites.py).
        self.call_clock = CallClock()
        # torch._dynamo.optimize enters this around every call of the compiled model (what
        # ember.compile uses; torch.compile(backend=...) does not pass it on).
        self.backend_ctx_ctor = self.shape_policy
        self.dynamo_settings: tuple[tuple[str, object], ...] | None = None  # ShapePolicy's, while valid
        # Set by a warm start's compile (capture/warm_start.py): wraps each compiled graph so that
        # AOTAutograd's bundled cache entry can carry it to the next process.
        self.output_wrapper: Callable[[Callable, fx.GraphModule, GraphRecord], Callable] | None = None

    @property
    def static_budget(self) -> int:
        return max(1, self.options.max_recompiles)

    def dynamic_shapes_on(self) -> bool:
        """Whether a frame of this model has used up its static specialisations."""
        return any(n >= self.static_budget for n in self.static_compiles.values())

    def shape_policy(self) -> ShapePolicy:
        """Dynamo's settings during one call: static shapes (``dynamic=False``'s settings) until the
        static budget is spent, then automatic dynamic shapes; this model's recompile limit."""
        return ShapePolicy(self)

    def dynamo_gave_up(self, note: str) -> None:
        """Dynamo stopped compiling a frame of this model: it runs eagerly (correct, not compiled)."""
        function = note.split(": Dynamo hit")[0]
        if any(n.split(": Dynamo hit")[0] == function for n in self.log.gave_up):
            return
        self.log.gave_up.append(note)
        warnings.warn(f"ember: Dynamo stopped compiling a frame of this model and runs it eagerly from now on "
                      f"(correct results, no Ember code): {note}. A frame compiles at most max_recompiles="
                      f"{self.options.max_recompiles} static graphs plus {DYNAMIC_RECOMPILES} more; "
                      f"ember.explain(model, ...) lists every recompile.", RuntimeWarning, stacklevel=2)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        with progress.scope(self.options.progress):
            progress.compiling()
            return self._compile_frame(gm, example_inputs)

    def _compile_frame(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        check_device(example_inputs, self.options.device)
        cid = _compile_id()
        # Sizes as called; a dynamic-shape graph also takes its symbolic sizes as SymInt inputs.
        sig = _signature([x for x in example_inputs if not isinstance(x, torch.SymInt)])
        dynamic = any(is_symbolic(x) for x in example_inputs) or bool(_symbolic_inputs(gm, "example_value"))
        frame, _, nth = cid.partition("/")
        if nth not in ("", "0"):
            prior = [s for f, s in self.log.frames if f.partition("/")[0] == frame]
            changed = _describe_change(prior[-1], sig) if prior else "guard failure"
            if dynamic:
                changed += (f"; dynamic-shape graph {', '.join(_symbolic_inputs(gm, 'example_value'))} after "
                            f"{self.static_compiles[frame]} static specialisation(s), runs through ATen as captured")
            self.log.recompiles.append(f"frame {frame} compile {nth}: {changed}")
        self.log.frames.append((cid, sig))
        if dynamic:
            self.log.dynamic.append(cid)
        else:
            self.static_compiles[frame] += 1
            self.dynamo_settings = None  # the static budget may be spent now
        n = next(self._ids)

        def make(kind: str) -> Callable:
            def compiler(graph: fx.GraphModule, inputs: list) -> Callable:
                if kind == "backward":  # activation checkpointing's saved RNG states (capture/rng_states.py)
                    fix_rng_state_sizes(graph, inputs)
                record = GraphRecord(title=f"{kind} {n} (frame {cid})", kind=kind, frame=cid, target="",
                                     input_signature=_signature(inputs))
                self.log.graphs.append(record)
                if _symbolic_inputs(graph, "val") or any(is_symbolic(x) for x in inputs):
                    compiled = _run_as_captured(graph, record)
                    self.programs.append((record, compiled.ember_graph))
                    return self.output_wrapper(compiled, graph, record) if self.output_wrapper else compiled
                # AOTAutograd calls compilers with its fake mode active; Ember's compile works on
                # real constants (folding, cache keys) and enters the graph's fake mode where it needs it.
                # A backward compiled when autograd first reaches it has a progress scope of its own.
                with unset_fake_temporarily(), progress.scope(self.options.progress):
                    progress.compiling()
                    compiled = compile_graph(graph, inputs, self.options, record, target)
                self.programs.append((record, compiled.ember_graph))  # explain times their calls
                # Training graphs share the model's pool; an inference graph gets a pool of its own,
                # measured, pre-sized and released the same way (runtime/cudagraphs/pool.py).
                share_pool(compiled, self.graph_pool if kind != "inference" else GraphPool(training=False),
                           self.call_clock)
                return self.output_wrapper(compiled, graph, record) if self.output_wrapper else compiled
            return compiler

        # The frame's target, resolved once: its graphs (forward, backward) compile for it.
        target = resolve_target(self.options.target, frame_values(gm, example_inputs))
        if dynamic:
            self.log.frame_cache.append(f"frame {cid}: not cached: dynamic shapes")
            return self._trace_frame(gm, example_inputs, target, make)
        # A frame compiled before (any process): AOTAutograd's result with Ember's programs, loaded.
        return compile_cached_frame(self, gm, example_inputs, target, cid, n,
                                    lambda: self._trace_frame(gm, example_inputs, target, make))

    def _trace_frame(self, gm: fx.GraphModule, example_inputs: list, target: Target,
                     make: Callable[[str], Callable]) -> Callable:
        """AOTAutograd over the Dynamo graph, Ember's compilers (``make``) for its graphs."""
        gpu = target.gpu_code_path  # the interpreter included: CI runs the GPU code path through it
        if target.precompiles():
            start_workers()  # their start-up overlaps AOTAutograd's capture (runtime/precompile.py)
        self.log.rewrites["F.interpolate(mode='nearest') -> ATen's nearest kernels (ops/upsample.py)"] += \
            rewrite_nearest_interpolate(gm)
        if gpu:
            self.log.rewrites["F.instance_norm -> spatial reductions in the input's layout "
                              "(capture/instance_norm.py)"] += rewrite_instance_norm(gm)
        if not torch.is_grad_enabled():  # an inference trace (ops/rnn.py: the op has no backward)
            limit = settings().rnn_unroll_max_steps
            self.log.rewrites[f"an RNN of more than {limit} steps x layers -> one ATen RNN call "
                              "(ops/rnn.py)"] += rewrite_long_rnns(gm, limit)
        backend = aot_autograd(fw_compiler=make("forward"), bw_compiler=make("backward"),
                               inference_compiler=make("inference"),
                               decompositions=_decompositions(_cpu_inference(example_inputs, self.options, target), gpu),
                               partition_fn=partition_joint_graph,  # min-cut: capture/partition.py
                               # Writes into inputs (batch norm's running statistics) as copy_ nodes at
                               # the end of the graph: they run in Ember's program, inside its CUDA
                               # graph, instead of AOTAutograd's wrapper copying them back per call.
                               keep_inference_input_mutations=settings().input_mutations_in_graph)
        with aot_graph_text_off(), backward_with_forward(gpu), rng_ops_kept(), gc_paused():  # capture/aot_settings.py
            return backend(gm, example_inputs)


try:  # Dynamo re-raises a backend's ShortenTraceback as is, not wrapped in BackendCompilerFailed
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover - older torch: the error arrives wrapped
    _PassThrough = Exception  # type: ignore[misc,assignment]


class EmberDeviceError(_PassThrough, ValueError):  # type: ignore[misc]
    """An input on another device than ``ember.compile(device=...)`` asked for. It reaches the
    caller with this message, not as Dynamo's "backend='?' raised" wrapper."""

    def __init__(self, message: str) -> None:
        if _PassThrough is Exception:
            super().__init__(message)
        else:
            super().__init__(message, first_useful_frame=None)


def check_device(example_inputs: list, device: str) -> None:
    """``device="cpu"|"cuda"``: every input tensor must be there (an error naming the first that is not)."""
    if device == "auto":
        return
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.device.type != device:
            raise EmberDeviceError(f"ember.compile(device={device!r}): graph input {i} ({list(x.shape)}) is on "
                             f"{x.device}; move the model and its inputs to {device} or use device='auto'")


def _run_as_captured(graph: fx.GraphModule, record: GraphRecord) -> Callable:
    """A dynamic-shape graph: Ember generates code for static shapes only, so the ATen graph runs
    op by op as AOTAutograd captured it; every op is reported as a fallback saying why."""
    record.dynamic = True
    record.target = "aten (dynamic shapes)"
    record.program = graph.code
    record.cudagraph = "not captured: dynamic shapes"
    for node in graph.graph.nodes:
        if node.op == "call_function":
            target = node.target
            name = (f"{target.namespace}.{target._overloadpacket.__name__}"
                    if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target)))
            record.placement.setdefault("fallback", Counter())[name] += 1
            record.fallback_reasons[f"{name}: dynamic-shape graph, runs through ATen as captured"] += 1

    def run(args: list) -> object:
        inputs = list(args)
        args.clear()  # AOTAutograd's boxed convention: the graph owns its inputs
        return graph(*inputs)
    return boxed(CompiledGraph(record.title, graph.code, run))


def _describe_change(old: list[str], new: list[str]) -> str:
    if len(old) != len(new):
        return f"number of inputs {len(old)} -> {len(new)}"
    diffs = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old, new)) if a != b]
    return "; ".join(diffs[:3]) if diffs else "guard failure (same input signature)"


def ember_backend(gm: fx.GraphModule, example_inputs: list, **options: object) -> Callable:
    """Entry point for ``torch.compile(model, backend="ember", options={...})``."""
    return EmberBackend(Options.from_env(**options))(gm, example_inputs)


def optimize(model: Callable, backend: Callable, isolate_recompiles: bool = False) -> Callable:
    """Dynamo over ``model`` with an Ember backend: what ``ember.compile`` runs, and ``explain`` too,
    so a report describes the compile a user gets. ``torch._dynamo.optimize`` rather than
    ``torch.compile``, whose backend wrapper would drop the backend's ``backend_ctx_ctor`` (the
    per-call shape policy and recompile limit of this model). ``isolate_recompiles`` (torch >= 2.14)
    gives this compile its own recompile budget."""
    kwargs = {"isolate_recompiles": True} if isolate_recompiles and _ISOLATE else {}
    return torch._dynamo.optimize(backend, dynamic=None, **kwargs)(model)


_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters
