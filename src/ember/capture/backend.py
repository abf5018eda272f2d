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

import contextlib
import functools
import itertools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember.capture.aot_settings import aot_graph_text_off, backward_with_forward, gc_paused
from ember.capture.decompositions import decomposition_table
from ember.capture.instance_norm import rewrite_instance_norm
from ember.capture.upsample import rewrite_nearest_interpolate
from ember.config import Options
from ember.pipeline import compile_graph
from ember.report.records import CompileLog, GraphRecord
from ember.runtime.cudagraph import GraphPool, share_pool
from ember.runtime.precompile import start_workers
from ember.runtime.program import CompiledGraph, boxed

# Compiles of one frame Dynamo still allows after its static budget (more dynamic dims, a new
# dtype or grad mode) before it runs the frame eagerly.
DYNAMIC_RECOMPILES = 4
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

_DECOMPOSITIONS: dict[tuple[bool, bool], dict] = {}


def _decompositions(cpu_inference: bool = False, gpu: bool = False) -> dict:
    if (cpu_inference, gpu) not in _DECOMPOSITIONS:
        _DECOMPOSITIONS[cpu_inference, gpu] = decomposition_table(cpu_inference, gpu)
    return _DECOMPOSITIONS[cpu_inference, gpu]


def _gpu_target(example_inputs: list, options: Options) -> bool:
    """Whether this frame compiles for a Triton target (the interpreter included: CI runs the GPU
    code path through it)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return options.target == "triton-interpret" or (options.target in ("auto", "triton") and on_cuda)


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
        elif isinstance(x, torch.SymInt):
            sig.append(f"SymInt {x}")
        else:
            sig.append(type(x).__name__)
    return sig


def _symbolic(value: object) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(not isinstance(d, int) for d in value.shape)


def _symbolic_inputs(gm: fx.GraphModule, key: str) -> list[str]:
    """The graph's inputs with symbolic sizes (``key``: "example_value" for Dynamo's graph, "val"
    for AOTAutograd's), e.g. ``torch.float32[s77, 7]@cpu``."""
    vals = [n.meta.get(key) for n in gm.graph.nodes if n.op == "placeholder"]
    return _signature([v for v in vals if isinstance(v, torch.Tensor) and _symbolic(v)])


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext
        cid = CompileContext.current_compile_id()
        if cid is not None:
            return f"{cid.frame_id}/{cid.frame_compile_id}"
    except Exception:  # noqa: BLE001 - only used for reporting
        pass
    return "?"


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


class EmberBackend:
    """A ``torch.compile`` backend with its options and a log of everything it compiled."""

    _ids = itertools.count()
    __name__ = "ember"  # what Dynamo's errors call the backend (backend='ember', not '?')

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self.log = CompileLog()
        self.static_compiles: Counter = Counter()  # frame id -> static-shape compiles
        # One CUDA-graph memory pool for every training graph of this model, so that a backward
        # reuses the memory of the activations it consumes (runtime/cudagraph.py).
        self.graph_pool = GraphPool()
        # torch._dynamo.optimize enters this around every call of the compiled model (what
        # ember.compile uses; torch.compile(backend=...) does not pass it on).
        self.backend_ctx_ctor = self.shape_policy

    @property
    def static_budget(self) -> int:
        return max(1, self.options.max_recompiles)

    def dynamic_shapes_on(self) -> bool:
        """Whether a frame of this model has used up its static specialisations."""
        return any(n >= self.static_budget for n in self.static_compiles.values())

    @contextlib.contextmanager
    def shape_policy(self) -> Iterator[None]:
        """Dynamo's settings during one call: static shapes (``dynamic=False``'s settings) until the
        static budget is spent, then automatic dynamic shapes; this model's recompile limit."""
        cfg = torch._dynamo.config
        new = {"automatic_dynamic_shapes": self.dynamic_shapes_on(), "assume_static_by_default": True,
               _LIMIT: self.static_budget + DYNAMIC_RECOMPILES}
        old = {name: getattr(cfg, name) for name in new}
        for name, value in new.items():
            setattr(cfg, name, value)
        _CALLING.append(self)
        try:
            yield
        finally:
            _CALLING.pop()
            for name, value in old.items():
                setattr(cfg, name, value)

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
        check_device(example_inputs, self.options.device)
        cid = _compile_id()
        # Sizes as called; a dynamic-shape graph also takes its symbolic sizes as SymInt inputs.
        sig = _signature([x for x in example_inputs if not isinstance(x, torch.SymInt)])
        dynamic = any(_symbolic(x) for x in example_inputs) or bool(_symbolic_inputs(gm, "example_value"))
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
        n = next(self._ids)

        def make(kind: str) -> Callable:
            def compiler(graph: fx.GraphModule, inputs: list) -> Callable:
                record = GraphRecord(title=f"{kind} {n} (frame {cid})", kind=kind, frame=cid, target="",
                                     input_signature=_signature(inputs))
                self.log.graphs.append(record)
                if _symbolic_inputs(graph, "val") or any(_symbolic(x) for x in inputs):
                    return _run_as_captured(graph, record)
                # AOTAutograd calls compilers with its fake mode active; Ember's compile works on
                # real constants (folding, cache keys) and enters the graph's fake mode where it needs it.
                with unset_fake_temporarily():
                    compiled = compile_graph(graph, inputs, self.options, record)
                # Training graphs share the model's pool; an inference graph gets a pool of its own,
                # measured, pre-sized and released the same way (runtime/graph_pool.py).
                share_pool(compiled, self.graph_pool if kind != "inference" else GraphPool(training=False))
                return compiled
            return compiler

        gpu = _gpu_target(example_inputs, self.options)
        if gpu and self.options.target != "triton-interpret":
            start_workers()  # their start-up overlaps AOTAutograd's capture (runtime/precompile.py)
        self.log.rewrites["F.interpolate(mode='nearest') -> ATen's nearest kernels (capture/upsample.py)"] += \
            rewrite_nearest_interpolate(gm)
        if gpu:
            self.log.rewrites["F.instance_norm -> spatial reductions in the input's layout "
                              "(capture/instance_norm.py)"] += rewrite_instance_norm(gm)
        backend = aot_autograd(fw_compiler=make("forward"), bw_compiler=make("backward"),
                               inference_compiler=make("inference"),
                               decompositions=_decompositions(_cpu_inference(example_inputs, self.options), gpu),
                               partition_fn=_PARTITION)
        with aot_graph_text_off(), backward_with_forward(gpu), gc_paused():  # capture/aot_settings.py
            return backend(gm, example_inputs)


# The default partitioner saves every forward value the backward reads. The min-cut partitioner
# (what Inductor uses) saves a minimal set and recomputes cheap pointwise chains in the backward,
# where they fuse into the backward's kernels: fewer, smaller saved activations, lower peak memory.
_PARTITION = functools.partial(min_cut_rematerialization_partition, compiler="inductor")


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
