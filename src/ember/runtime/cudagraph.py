"""CUDA graphs for compiled programs: one replay instead of hundreds of kernel launches.

Inference, training-forward and training-backward programs are captured when
``cudagraph_blocker`` (a pure function of the captured graph, its example inputs, kind, target
and the on/off switch) finds nothing that a replay could get wrong; ``ember.explain`` prints its
reason otherwise, and ``CudaGraphRunner`` keeps a status line of what it does at run time.

The rules a replay must keep, and how:

- Capture executes nothing: kernels are recorded, not run. The first call runs uncaptured
  (lazy initialisation, and the addresses of the inputs); the second is captured, then
  replayed. Mutations and random draws therefore happen exactly once per call.
- Inputs. An input found at the same address on two consecutive calls (parameters, buffers,
  optimizer-updated tensors) is *static*: the graph reads and writes it in place. Every other
  input is *dynamic*: copied into a buffer of the same strides before each replay (one
  ``_foreach_copy_``). A static input that moves is made dynamic for good and the graph is
  captured again; a dynamic input that keeps its address for ``PROMOTE_AFTER`` calls (saved
  activations once the forward replays) is made static by a new capture.
- Mutated inputs. Which inputs the program writes is read from their version counters across
  the capture (every write of an Ember program is an ATen op, which bumps the counter of the
  tensor and its views; generated kernels only write buffers the program allocated). A
  mutated static input is written in place by the replay and its version is bumped as eager
  would; a mutated dynamic input is copied back into the caller's tensor after each replay.
  Changing an input's shape or strides in place is refused by ``cudagraph_blocker``.
- Outputs live in the graph's private memory pool at fixed addresses, and the next replay
  overwrites them. An output that is (a view of) an input is rebuilt on the caller's tensor.
  Any other output is first handed out as an alias of the pool memory; before each replay
  the runner checks that nobody still holds one (the storage's reference count is back to the
  graph's own references). If somebody does (a kept loss, the saved activations of a forward
  whose backward has not run yet, a gradient being accumulated), that call runs uncaptured
  and those outputs are handed out as copies from then on; if the old ones are still held on
  the next call, the graph is captured again around them. A replay can therefore never
  overwrite a tensor the caller can still read.
- Random ops draw from the default CUDA generator's philox stream: a captured graph reads
  seed and offset from device memory that ``CUDAGraph.replay()`` advances, so each replay
  draws new numbers, the same ones uncaptured calls would. Random ops outside that set, or
  with an explicit generator, are refused.
- At most ``MAX_CAPTURES`` captures; the last one copies every input in and every output out,
  so it never needs another. A capture that fails runs the program uncaptured from then on
  and says why.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

aten = torch.ops.aten

# Ops that wait for the device or produce data-dependent shapes on the host.
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.argwhere.default,
    aten.masked_select.default, aten.unique_consecutive.default, aten._unique.default,
    aten._unique2.default, aten.unique_dim.default, aten.bincount.default, aten.item.default,
    aten.equal.default, aten.is_nonzero.default,
}
# Indexing with a boolean mask calls nonzero() on the host.
_MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  aten._index_put_impl_.default}
# Random ops (packet names) whose CUDA kernels draw from the default generator's philox stream,
# which torch.cuda.CUDAGraph registers for capture and advances on every replay.
GRAPH_SAFE_RANDOM = {
    "native_dropout", "_fused_dropout", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "bernoulli", "bernoulli_", "uniform", "uniform_", "normal", "normal_",
    "exponential", "exponential_", "geometric", "geometric_", "cauchy", "cauchy_", "log_normal",
    "log_normal_", "random", "random_",
}
# Attention with dropout (dropout_p > 0) stays uncaptured until verified on the device: its
# kernels hand philox seed/offset to the backward as CPU tensors when run uncaptured and as CUDA
# tensors when captured, and the H100 runs that trained BERT with graphs on did not finish
# (benchmarks/gpu_cudagraph_check.py, tiny_transformer rows). Without dropout it draws nothing.
CAPTURED_KINDS = ("inference", "forward", "backward")
MAX_CAPTURES = 5  # the last one copies every input and output, so it is final
PROMOTE_AFTER = 3  # calls a copied input must keep its address before it is read in place


def cudagraphs_enabled(option: bool) -> bool:
    return option and os.environ.get("EMBER_CUDAGRAPHS", "1") not in ("0", "false", "")


def training_capture_enabled() -> bool:
    """Forward/backward capture is opt-in until its memory cost is brought under eager's."""
    return os.environ.get("EMBER_CUDAGRAPHS_TRAINING", "0") not in ("0", "false", "")


def cudagraph_blocker(gm: fx.GraphModule, example_inputs: Sequence[object], kind: str, target: str,
                      enabled: bool = True) -> str | None:
    """Why this graph must not be captured, or None when it can be."""
    if not cudagraphs_enabled(enabled):
        return "turned off (cudagraphs=False or EMBER_CUDAGRAPHS=0)"
    if target != "triton":
        return f"target {target} does not run on a CUDA device"
    if kind not in CAPTURED_KINDS:
        return f"{kind} graphs are not captured (only {', '.join(CAPTURED_KINDS)})"
    if kind != "inference" and not training_capture_enabled():
        return ("training graphs are captured only with EMBER_CUDAGRAPHS_TRAINING=1: on the H100 they were "
                "exact for resnet18 and a conv net, but raised peak memory 1.4-1.9x eager (one pool per "
                "capture) and attention with dropout is not yet verified")
    devices = set()
    for i, t in enumerate(example_inputs):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"input {i} is a Python {type(t).__name__}, not a tensor (a replay would reuse its first value)"
        if t.device.type != "cuda":
            return f"input {i} is on {t.device}"
        devices.add(str(t.device))
    if len(devices) > 1:
        return f"inputs are on several devices ({', '.join(sorted(devices))})"
    return _graph_blocker(gm)


def _graph_blocker(gm: fx.GraphModule) -> str | None:
    # root: value -> the graph input it may share memory with (views, getitems of views).
    root: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = node
        elif node.op == "get_attr":
            val = node.meta.get("val", _attr(gm, str(node.target)))
            # 0-dim CPU constants are read as scalars when a kernel launches: fixed, so fine.
            if isinstance(val, torch.Tensor) and val.device.type != "cuda" and val.dim() > 0:
                return f"constant {node.target} is a tensor on {val.device}"
        elif node.op == "call_function":
            why = _sync_reason(node) or _random_reason(node) or _mutation_reason(node, root)
            if why:
                return why
            if _may_alias_input(node):
                for a in node.all_input_nodes:
                    if a in root:
                        root[node] = root[a]
                        break
            val = node.meta.get("val")
            for v in val if isinstance(val, (list, tuple)) else [val]:
                if isinstance(v, torch.Tensor) and v.device.type != "cuda":
                    return f"{node.name} ({node.target}) produces a tensor on {v.device}"
    return None


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _sync_reason(node: fx.Node) -> str | None:
    target = node.target
    if target in SYNC_OPS:
        return f"{node.name} ({target}) synchronizes with the CPU"
    if target == aten.repeat_interleave.Tensor and node.kwargs.get("output_size") is None:
        return f"{node.name} ({target}) without output_size synchronizes with the CPU"
    if target in _MASK_INDEXING and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
        for idx in node.args[1]:
            val = idx.meta.get("val") if isinstance(idx, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8):
                return f"{node.name} ({target}) indexes with a boolean mask, which synchronizes with the CPU"
    return None


def _random_reason(node: fx.Node) -> str | None:
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return None
    schema = target._schema
    if _argument(node, schema, "dropout_p") == 0:
        return None  # attention without dropout draws nothing
    gen = _argument(node, schema, "generator")
    if gen is not None:
        return (f"random op {node.name} ({target}): draws from an explicit torch.Generator; only the "
                "default CUDA generator advances between replays")
    if target._overloadpacket.__name__ not in GRAPH_SAFE_RANDOM:
        return (f"random op {node.name} ({target}): not known to draw from the default CUDA generator's "
                "philox stream, so a replay could repeat its numbers")
    return None


def _argument(node: fx.Node, schema: torch.FunctionSchema, name: str) -> object:
    """The value ``node`` passes for argument ``name`` (its default when left out; None if no such argument)."""
    for i, sarg in enumerate(schema.arguments):
        if sarg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) and not sarg.kwarg_only else sarg.default_value
    return None


def _written_args(node: fx.Node) -> list[fx.Node]:
    """Graph values ``node`` writes to, from its schema's ``(a!)`` annotations."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out: list[fx.Node] = []
    for i, sarg in enumerate(schema.arguments):
        if sarg.alias_info is None or not sarg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(sarg.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _mutation_reason(node: fx.Node, root: dict[fx.Node, fx.Node]) -> str | None:
    # Writing an input's data is fine (in place if static, copied back if dynamic: see the
    # module docstring); changing its shape or strides is not repeated by a replay.
    target = node.target
    metadata = torch.Tag.inplace_view in getattr(target, "tags", ()) or target in (
        aten.resize_.default, aten.resize_as_.default) or getattr(target, "_overloadpacket", None) is aten.set_
    if not metadata:
        return None
    for v in _written_args(node):
        if v in root:
            return (f"input {root[v].name} has its shape or strides changed in place by {node.name} ({target}); "
                    "a replay would not repeat that")
    return None


def _may_alias_input(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


class CudaBackend:
    """What the runner asks of the device (a CPU stand-in replaces it in the tests)."""

    def capture(self, run: Callable[[list], object], inputs: list, device: torch.device) -> tuple[object, object]:
        """Record ``run(inputs)`` into a new graph without executing it: (graph, outputs).

        Every capture gets a private memory pool of its own (no ``pool=``): a pool shared with
        a graph that has been dropped while the caller still holds some of its outputs cannot
        be captured into again (the allocator asserts its use count is positive), and a fresh
        pool lets the dropped one be freed as soon as those outputs are."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            # thread_local: another thread's CUDA calls (a data loader pinning memory) must not
            # break the capture, nor the capture break them.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = run(list(inputs))
            torch.cuda.current_stream().wait_stream(stream)
        return graph, outputs

    def replay(self, graph: object, args: list) -> None:
        """Replay ``graph``; ``args`` are this call's inputs (the graph reads their addresses)."""
        graph.replay()  # type: ignore[attr-defined]

    def recover(self, device: torch.device) -> None:
        """After a failed capture. A capture that fails after it began leaves the default CUDA
        generator in capture mode, and every later random op outside a capture raises ("Offset
        increment outside graph capture"); a small capture that completes resets it."""
        torch.cuda.synchronize(device)
        try:
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    torch.empty(1, device=device).zero_()
                del graph
        except Exception:  # noqa: BLE001 - best effort; the program still runs uncaptured
            pass


@dataclass
class _Slot:
    """How one leaf of the program's output is handed to the caller after a replay."""

    kind: str  # value | input | alias | pool | same | empty
    value: object = None  # the non-tensor value, or the captured output tensor
    index: int = 0  # input index (input, alias), group index (pool), earlier slot (same)
    delta: int = 0  # alias: bytes from the input's first element to the output's


@dataclass
class _Group:
    """Outputs that share one storage of the graph's pool."""

    storage: torch.UntypedStorage
    members: list[int]  # slot indices
    ptr: int
    lo: int = 0  # byte range the members cover
    hi: int = 0
    baseline: int = 0  # reference count of the storage when only the runner holds it
    copy: bool = False


@dataclass
class _Graph:
    graph: object
    static_idx: list[int]
    static_ptrs: list[int]
    dynamic_idx: list[int]
    buffers: list[torch.Tensor]
    writeback: list[int]  # positions in dynamic_idx the graph mutates
    bump: list[int]  # static inputs the graph mutates (their versions are bumped per replay)
    slots: list[_Slot]
    groups: list[_Group]
    container: type | None  # tuple or list of leaves; None: a single leaf
    final: bool
    dyn_ptrs: list[int] = field(default_factory=list)
    same_calls: list[int] = field(default_factory=list)


class CudaGraphRunner:
    """Runs a boxed program uncaptured on its first call, captures it on the second, replays after."""

    def __init__(self, run: Callable[[list], object], title: str,
                 on_status: Callable[[str], None] | None = None, backend: CudaBackend | None = None) -> None:
        self.run = run
        self.title = title
        self.on_status = on_status
        self.backend = backend or CudaBackend()
        self.calls = 0
        self.captures = 0
        self.replays = 0
        self.uncaptured = 0  # calls after capture that ran uncaptured because outputs were still held
        self.g: _Graph | None = None
        self.prev_ptrs: list[int] | None = None
        self.demoted: set[int] = set()  # moved while read in place: copied in from now on
        self.copy_leaves: set[int] = set()  # output leaves handed out as copies from now on
        self.alive_last: set[int] = set()
        self.next_static: list[int] = []
        self.last_reason = ""
        self.disabled: str | None = None
        self.device = torch.device("cuda")
        self._set_status("waiting for the second call, which is captured and replayed after")

    def _set_status(self, text: str) -> None:
        self.status = text
        if self.on_status is not None:
            self.on_status(text)

    def __call__(self, args: list) -> object:
        self.calls += 1
        if self.disabled is not None:
            return self.run(args)
        if self.g is None:
            if self.prev_ptrs is None:
                self.prev_ptrs = [_ptr(a) for a in args]
                return self.run(args)
            return self._capture(args, "")
        why = self._check(args)
        if why is None:
            return self._replay(args)
        if not why:
            self.uncaptured += 1
            self._describe()
            return self.run(args)
        return self._capture(args, why)

    # -- deciding whether this call may replay ----------------------------------------------

    def _check(self, args: list) -> str | None:
        """None: replay. "": run uncaptured (outputs held). Otherwise: why to capture again (the
        inputs to read in place are left in ``self.next_static``)."""
        g = self.g
        assert g is not None
        if g.static_idx and [args[i].data_ptr() for i in g.static_idx] != g.static_ptrs:
            moved = [i for i, p in zip(g.static_idx, g.static_ptrs) if args[i].data_ptr() != p]
            self.demoted.update(moved)
            self.next_static = [i for i in g.static_idx if i not in self.demoted]
            return f"input {_few(moved)} moved"
        # Every group, copied ones too: an output handed out before its group became a copy
        # may still be held, and the replay would overwrite it.
        held = [k for k, grp in enumerate(g.groups) if _held(grp)]
        if held:
            for k in held:
                g.groups[k].copy = True
                self.copy_leaves.update(g.groups[k].members)
            again = set(held) & self.alive_last
            self.alive_last = set(held)
            if again:
                self.next_static = list(g.static_idx)
                return f"output {_few(sorted(m for k in again for m in g.groups[k].members))} of a replay still held"
            return ""
        self.alive_last = set()
        if g.final or not g.dynamic_idx or self.captures >= MAX_CAPTURES - 1:
            return None
        ptrs = [args[i].data_ptr() for i in g.dynamic_idx]
        g.same_calls = [n + 1 if p == q else 0 for n, p, q in zip(g.same_calls, ptrs, g.dyn_ptrs)]
        g.dyn_ptrs = ptrs
        ready = [i for i, n in zip(g.dynamic_idx, g.same_calls) if n >= PROMOTE_AFTER and i not in self.demoted]
        if ready:
            self.next_static = sorted(g.static_idx + ready)
            return f"input {_few(ready)} kept its address for {PROMOTE_AFTER} calls (now read in place)"
        return None

    # -- capture -------------------------------------------------------------------------------

    def _capture(self, args: list, why: str) -> object:
        self.g = None  # the old graph's outputs go back to the pool unless the caller holds them
        refs = list(args)
        args.clear()
        final = self.captures >= MAX_CAPTURES - 1
        tensors = [i for i, a in enumerate(refs) if isinstance(a, torch.Tensor)]
        if final:
            static = []
        elif why:  # decided by _check
            static = self.next_static
            self.last_reason = why
        else:  # first capture: what kept its address since the first call
            prev = self.prev_ptrs or []
            static = [i for i in tensors if i < len(prev) and refs[i].data_ptr() == prev[i]]
        try:
            self.g = self._record(refs, tensors, static, final)
            for grp in self.g.groups:  # measured here, where only the runner refers to outputs
                grp.baseline = torch._C._storage_Use_Count(grp.storage._cdata)
        except Exception as err:  # noqa: BLE001 - an uncapturable program still runs
            self.g = None
            self.disabled = f"{type(err).__name__}: {str(err)[:200]}"
            self._set_status(f"not captured: capture failed, running uncaptured: {self.disabled}")
            self.backend.recover(self.device)
            return self.run(refs)
        self._describe()
        return self._replay(refs)

    def _record(self, refs: list, tensors: list[int], static: list[int], final: bool) -> _Graph:
        statics = set(static)
        dynamic = [i for i in tensors if i not in statics]
        for i in dynamic:
            if torch._debug_has_internal_overlap(refs[i]) != 0:
                raise ValueError(f"input {i} moves between calls and has overlapping memory (an expanded "
                                 "tensor), so it cannot be copied into a static buffer")
        device = next((refs[i].device for i in tensors if refs[i].device.type == "cuda"),
                      refs[tensors[0]].device if tensors else torch.device("cuda"))
        # Buffers are ordinary tensors even under inference_mode: their version counters tell
        # which dynamic inputs the program writes.
        with torch.inference_mode(False):
            buffers = [torch.empty_strided(refs[i].shape, refs[i].stride(), dtype=refs[i].dtype,
                                           device=refs[i].device) for i in dynamic]
        if buffers:  # the replay right after copies again; this makes the buffers hold real inputs
            torch._foreach_copy_(buffers, [refs[i] for i in dynamic])
        inputs = list(refs)
        for i, buf in zip(dynamic, buffers):
            inputs[i] = buf
        before = [_version(x) for x in inputs]
        self.device = device
        self.captures += 1
        graph, outputs = self.backend.capture(self.run, inputs, device)
        after = [_version(x) for x in inputs]
        mutated = {i for i in tensors if before[i] is None or before[i] != after[i]}
        slots, groups, container = self._outputs(outputs, inputs, final)
        return _Graph(graph, static, [refs[i].data_ptr() for i in static], dynamic, buffers,
                      [k for k, i in enumerate(dynamic) if i in mutated],
                      [i for i in static if i in mutated and before[i] is not None],
                      slots, groups, container, final,
                      dyn_ptrs=[refs[i].data_ptr() for i in dynamic], same_calls=[0] * len(dynamic))

    def _outputs(self, outputs: object, inputs: list,
                 final: bool) -> tuple[list[_Slot], list[_Group], type | None]:
        if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "_fields"):
            container: type | None = type(outputs)
            leaves = list(outputs)
        else:
            container, leaves = None, [outputs]
        if any(isinstance(x, (tuple, list, dict)) for x in leaves):
            raise TypeError("nested program outputs")
        by_storage: dict[int, int] = {}
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.numel() > 0:
                by_storage.setdefault(x.untyped_storage()._cdata, i)
        slots: list[_Slot] = []
        groups: list[_Group] = []
        group_of: dict[int, int] = {}
        seen: dict[int, int] = {}
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                slots.append(_Slot("value", leaf))
                continue
            if id(leaf) in seen:
                slots.append(_Slot("same", index=seen[id(leaf)]))
                continue
            seen[id(leaf)] = j
            same_input = next((i for i, x in enumerate(inputs) if x is leaf), None)
            if same_input is not None:
                slots.append(_Slot("input", index=same_input))
                continue
            if leaf.numel() == 0:
                slots.append(_Slot("empty", leaf))  # no memory to hold
                continue
            storage = leaf.untyped_storage()
            owner = by_storage.get(storage._cdata)
            if owner is not None:
                slots.append(_Slot("alias", _meta(leaf), owner, leaf.data_ptr() - inputs[owner].data_ptr()))
                continue
            k = group_of.get(storage._cdata)
            if k is None:
                k = group_of[storage._cdata] = len(groups)
                groups.append(_Group(storage, [], storage.data_ptr(), lo=storage.nbytes()))
            grp = groups[k]
            grp.members.append(j)
            start = leaf.storage_offset() * leaf.element_size()
            span = (1 + sum((s - 1) * st for s, st in zip(leaf.shape, leaf.stride()))) * leaf.element_size()
            grp.lo, grp.hi = min(grp.lo, start - start % 16), max(grp.hi, start + span)
            slots.append(_Slot("pool", leaf, k))
        for grp in groups:
            grp.copy = final or any(m in self.copy_leaves for m in grp.members)
        return slots, groups, container

    # -- replay ----------------------------------------------------------------------------------

    def _replay(self, args: list) -> object:
        g = self.g
        assert g is not None
        refs = list(args)
        args.clear()
        if g.dynamic_idx:
            torch._foreach_copy_(g.buffers, [refs[i] for i in g.dynamic_idx])
        self.backend.replay(g.graph, refs)
        self.replays += 1
        if g.writeback:
            torch._foreach_copy_([refs[g.dynamic_idx[k]] for k in g.writeback], [g.buffers[k] for k in g.writeback])
        if g.bump:
            torch._C._autograd._unsafe_set_version_counter([refs[i] for i in g.bump],
                                                            [refs[i]._version + 1 for i in g.bump])
        leaves: list[object] = []
        copies: dict[int, dict[int, torch.Tensor]] = {}
        for j, s in enumerate(g.slots):
            kind = s.kind
            if kind == "pool":
                grp = g.groups[s.index]
                if grp.copy:
                    if s.index not in copies:
                        copies[s.index] = _copy_group(grp, g.slots)
                    leaves.append(copies[s.index][j])
                else:
                    leaves.append(s.value.detach())  # type: ignore[union-attr]
            elif kind == "value":
                leaves.append(s.value)
            elif kind == "input":
                leaves.append(refs[s.index])
            elif kind == "alias":
                leaves.append(_rebase(s.value, refs[s.index], s.delta))  # type: ignore[arg-type]
            elif kind == "same":
                leaves.append(leaves[s.index])
            else:  # empty
                t = s.value
                leaves.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))  # type: ignore[union-attr]
        if g.container is None:
            return leaves[0]
        return g.container(leaves)

    def _describe(self) -> None:
        g = self.g
        if g is None:
            return
        shared = sum(len(grp.members) for grp in g.groups if not grp.copy)
        copied = sum(len(grp.members) for grp in g.groups if grp.copy)
        parts = [f"captured ({self.captures} capture{'s' if self.captures > 1 else ''}, "
                 f"{'final: everything copied' if g.final else 'replayed from the next call'})",
                 f"{len(g.static_idx)} inputs read in place, {len(g.dynamic_idx)} copied in"]
        if g.writeback:
            parts.append(f"{len(g.writeback)} mutated copied input(s) written back after each replay")
        if g.bump:
            parts.append(f"{len(g.bump)} input(s) mutated in place")
        parts.append(f"outputs: {shared} handed out from the graph's memory, {copied} copied")
        if self.uncaptured:
            parts.append(f"{self.uncaptured} call(s) ran uncaptured while earlier outputs were held")
        if self.last_reason:
            parts.append(f"last recapture: {self.last_reason}")
        self._set_status("; ".join(parts))


def _held(grp: _Group) -> bool:
    # Anybody else holding the storage (a tensor, a view, autograd's saved tensors) raises its
    # reference count; a resize_ of a handed-out output would move it.
    return torch._C._storage_Use_Count(grp.storage._cdata) > grp.baseline or grp.storage.data_ptr() != grp.ptr


def _copy_group(grp: _Group, slots: list[_Slot]) -> dict[int, torch.Tensor]:
    """Copies of a group's outputs in one new storage (aliasing between them kept)."""
    first = slots[grp.members[0]].value
    assert isinstance(first, torch.Tensor)
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(grp.storage, grp.lo, (grp.hi - grp.lo,), (1,))
    storage = raw.clone().untyped_storage()
    out = {}
    for j in grp.members:
        t = slots[j].value
        assert isinstance(t, torch.Tensor)
        size = t.element_size()
        offset = (t.storage_offset() * size - grp.lo) // size
        out[j] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, offset, t.shape, t.stride())
    return out


def _rebase(captured: torch.Tensor, caller: torch.Tensor, delta: int) -> torch.Tensor:
    """The output that aliased an input during capture, as the same view of the caller's tensor."""
    size = captured.element_size()
    if captured.dtype == caller.dtype and delta % size == 0:
        return caller.as_strided(captured.shape, captured.stride(), caller.storage_offset() + delta // size)
    offset = (caller.storage_offset() * caller.element_size() + delta) // size
    return torch.empty(0, dtype=captured.dtype, device=caller.device).set_(
        caller.untyped_storage(), offset, captured.shape, captured.stride())


def _meta(t: torch.Tensor) -> torch.Tensor:
    """Shape, strides and dtype of ``t`` without holding its memory."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _ptr(a: object) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else 0


def _version(a: object) -> int | None:
    if not isinstance(a, torch.Tensor):
        return 0
    try:
        return a._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _few(items: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in items[:4])
    return f"{shown} (+{len(items) - 4} more)" if len(items) > 4 else shown
