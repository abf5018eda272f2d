"""What a warm start saves of one compiled frame, and how it is linked again in a new process.

torch's ahead-of-time compile (``torch._dynamo.aot_compile``) saves a frame's guards and bytecode
and asks the backend for a ``SerializableCallable``. Ember's backend runs AOTAutograd, so the
callable is AOTAutograd's runtime wrapper around Ember's compiled forward (and backward). AOTAutograd
can already serialise that wrapper as a "bundled cache entry" (its forward/backward split and
runtime metadata, plus each compiled graph as an ``OutputCode``): ``EmberOutputCode`` is Ember's
compiled graph in that form. It carries the program as Ember's program cache stores it
(``runtime.artifacts.StoredProgram``: text, kernel modules, constants, the explain record), the
values of the graph attributes the program reads, and the replay rule's decision. In the new
process AOTAutograd rebuilds its wrapper and calls ``post_compile``, which links the program with
its kernels (``pipeline.link_stored``): no Dynamo, no AOTAutograd tracing, no Ember stage.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ember import compat
from ember.report.records import GraphRecord
from ember.runtime.artifacts import _decode, _encode

FORMAT = 1
API = compat.aot_compile_api()  # ImportError on a torch without it: warm_start.py turns warm start off

# The EmberBackend a warm start is loading into (its options, its log, its CUDA-graph pool).
LOADING: contextvars.ContextVar[Any] = contextvars.ContextVar("ember_warm_loading", default=None)
# What a loaded graph's record says: (its frame's compile id, the backend's graph number) when the
# frame cache (capture/frame_cache.py) loads it inside Dynamo's compile; None for a warm start.
LOADING_FRAME: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("ember_loading_frame",
                                                                                      default=None)


@dataclasses.dataclass
class EmberOutputCode(API.OutputCode):  # type: ignore[misc,name-defined]
    """One compiled ATen graph as AOTAutograd's bundled entry holds it (see the module docstring)."""

    title: str = ""
    kind: str = ""
    target: str = ""
    program: bytes = b""  # runtime.artifacts' encoding of the StoredProgram (checked when decoded)
    attrs: bytes = b""  # torch.save of {name in the program: graph attribute value}
    blocker: str | None = None
    read_only: tuple[int, ...] = ()
    unserializable: str = ""  # why this graph cannot be saved ("" when it can)
    whole_step_blocker: str | None = None  # the record's (pipeline._compile): compile_step reads it

    def __post_init__(self) -> None:
        self._run: Callable[[list], object] | None = None
        self._boxed_call = True  # AOTAutograd calls it with one list of inputs

    @classmethod
    def wrap(cls, compiled: Callable, gm: fx.GraphModule, record: GraphRecord) -> EmberOutputCode:
        """``compiled`` (what Ember's compiler returned for ``gm``) with what relinking it needs."""
        graph = getattr(compiled, "ember_graph", None)
        saved = getattr(graph, "saved", None)
        out = cls(title=record.title, kind=record.kind, target=record.target)
        if saved is None or saved.get("program") is None:
            out.unserializable = (f"{record.title} runs as captured ({record.error or record.cudagraph or 'dynamic'})"
                                  " and has no program to save")
        else:
            try:
                # The frame cache wraps inside Dynamo's compile, where torch 2.11 keeps a fake mode
                # active: a graph attribute read there would turn into a FakeTensor without data.
                with compat.real_tensors():
                    out.program = _encode(saved["program"])
                    attrs = {name: _attr(gm, path) for name, path in saved["program"].attrs.items()}
                    buf = io.BytesIO()
                    torch.save(attrs, buf)
                out.attrs = buf.getvalue()
                out.blocker, out.read_only = saved["blocker"], tuple(saved["read_only"])
                out.whole_step_blocker = record.whole_step_blocker
            except Exception as err:  # noqa: BLE001 - the compiled graph still runs; it is just not saved
                out.unserializable = f"{record.title}: {type(err).__name__}: {err}"
        out._run = compiled
        return out

    def __call__(self, inputs: list) -> Any:
        assert self._run is not None, "EmberOutputCode called before post_compile linked it"
        return self._run(inputs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_run"] = None  # the linked program lives in this process only
        return state

    def prepare_for_serialization(self) -> None:
        if self.unserializable:
            raise RuntimeError(self.unserializable)
        self._run = None

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        """Link the saved program in this process (called by AOTAutograd when it loads the entry)."""
        from ember.pipeline import link_stored
        from ember.runtime.cpu_background import kernels_in_background
        from ember.runtime.cudagraphs.runner import GraphPool, share_pool
        from ember.runtime.program import boxed
        from ember.targets import BY_NAME

        backend = LOADING.get()  # capture/backend.EmberBackend, set by the warm start or the frame cache
        if backend is None or not all(hasattr(backend, a) for a in ("options", "graph_pool", "call_clock", "log")):
            raise RuntimeError("an Ember warm-start artifact must be loaded by Ember's backend (warm start or frame cache)")
        stored = _decode(self.program)
        with compat.real_tensors():  # post_compile may run inside a compile (the frame cache)
            attrs = torch.load(io.BytesIO(self.attrs), weights_only=True)
        frame = LOADING_FRAME.get()
        if frame is None:
            record = GraphRecord(title=self.title, kind=self.kind, frame="warm start", target=self.target)
            record.cache = "warm start"
        else:
            cid, n = frame
            record = GraphRecord(title=f"{self.kind} {n} (frame {cid})", kind=self.kind, frame=cid, target=self.target)
            record.cache = "frame cache"
        record.whole_step_blocker = getattr(self, "whole_step_blocker", None)
        with kernels_in_background():  # CPU kernels load on runtime/cpu_background.py's thread
            # (a warm start replays every program's library calls beside its own load)
            graph = link_stored(stored, attrs, backend.options, record, BY_NAME[self.target], self.blocker,
                                frozenset(self.read_only), replay_library=frame is not None)
        compiled = boxed(graph)
        share_pool(compiled, backend.graph_pool if self.kind != "inference" else GraphPool(training=False),
                   backend.call_clock)
        backend.log.graphs.append(record)
        backend.programs.append((record, graph))
        self._run = compiled

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # Ember's kernels travel in the stored program


def _attr(gm: fx.GraphModule, path: str) -> object:
    from ember.graph_utils import get_attr
    value = get_attr(gm, path)
    return value.detach() if isinstance(value, torch.Tensor) else value


class EmberCompiledFrame(API.SerializableCallable):  # type: ignore[misc,name-defined]
    """What Ember's backend returns to torch's ahead-of-time compile: AOTAutograd's runtime wrapper
    around Ember's programs, saved as AOTAutograd's bundled entry."""

    def __init__(self, compiled_fn: Callable) -> None:
        self.compiled_fn = compiled_fn

    @classmethod
    def serialize_compile_artifacts(cls, fn: EmberCompiledFrame) -> bytes:
        serialize = getattr(fn.compiled_fn, "serialize", None)
        if serialize is None:
            raise RuntimeError("AOTAutograd made no bundled entry for this frame (its autograd cache is off: "
                               "torch._functorch.config.enable_autograd_cache)")
        with torch._functorch.config.patch("bundled_autograd_cache", True):
            entry = serialize()
            if entry is None:
                raise RuntimeError("AOTAutograd made no bundled entry for this frame")
            for part in (getattr(entry, "compiled_fw", None), getattr(entry, "compiled_bw", None)):
                code = getattr(part, "result", None)
                if part is not None and not isinstance(code, EmberOutputCode):
                    raise RuntimeError(f"AOTAutograd's entry holds {type(code).__name__}, not an Ember program")
                if isinstance(code, EmberOutputCode) and code.unserializable:
                    raise RuntimeError(code.unserializable)
            return pickle.dumps((FORMAT, entry))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> EmberCompiledFrame:
        fmt, entry = pickle.loads(data)
        if fmt != FORMAT:
            raise RuntimeError(f"warm-start format {fmt}, this Ember reads {FORMAT}")
        return cls(API.deserialize_bundled_cache_entry(entry))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled_fn(*args, **kwargs)
