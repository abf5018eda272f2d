"""A KernelPlan -> the source of a plain Python program that runs it.

The program is readable on purpose: every line carries the ATen op(s) it came from, buffers
are freed right after their last use, and library calls, fallbacks and kernel launches are
ordinary calls. ``exec`` of the text in the namespace ``Program.namespace`` gives ``run``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ember.codegen.input_writes import plan_input_writes
from ember.codegen.kernel_source import KernelSource
from ember.codegen.memory_plan import START, SlotKey, plan_memory, reuse_storage
from ember.config import settings
from ember.graph_utils import FOLDED_PREFIX, get_attr
from ember.runtime.frozen import FrozenValues
from ember.schedule.plan import FusedGroup, KernelPlan, Step
from ember.schedule.rules import constant_value

aten = torch.ops.aten

# Functional accumulating ops and their in-place forms (ProgramWriter._in_place_line).
_IN_PLACE = {aten.index_add.default: aten.index_add_.default, aten.index_put.default: aten.index_put_.default,
             aten.scatter_add.default: aten.scatter_add_.default}

_RESERVED = {"torch", "aten", "prims", "run", "args", "_empty", "_expect", "_consts", "operator", "_frozen",
             "_frozen_inputs", "_prepare", "_reuse", "_ws", "_bump", "_cast_all"}


@dataclass
class ProgramSource:
    text: str
    namespace: dict = field(default_factory=dict)
    attrs: dict[str, str] = field(default_factory=dict)  # namespace name -> graph attribute it holds


def base_namespace() -> dict:
    """The names every generated program uses besides its own kernels and constants."""
    return {"torch": torch, "aten": torch.ops.aten, "prims": torch.ops.prims, "operator": operator, "math": math,
            "_empty": torch.empty_strided, "_kernels": {}, "_frozen": FrozenValues(),
            "_reuse": reuse_storage, "_bump": bump_version, "_cast_all": cast_all}


def cast_all(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """The program's ``_cast_all``: ``[t.to(dtype) for t in tensors]`` (same strides) in one
    multi-tensor copy, a few kernels for all of them (schedule/batched_casts.py)."""
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    torch._foreach_copy_(out, list(tensors))
    return out


def bump_version(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The program's ``_bump``: a kernel stored ``value`` into the graph input ``t``
    (codegen/input_writes.py); ``t``'s version counter moves on as ATen's ``copy_`` would move it.
    ``value`` is another tensor only where ``_expect`` gave the kernel a copy of ``t``: copied back."""
    if value is t:
        torch._C._increment_version((t,))
    else:
        t.copy_(value)
    return t


class _Writer:
    def __init__(self, gm: fx.GraphModule, plan: KernelPlan, kernels: dict[int, KernelSource],
                 title: str) -> None:
        self.gm = gm
        self.plan = plan
        self.kernels = kernels  # step index -> kernel (fused groups that run generated code)
        self.title = title
        self.ns: dict = base_namespace()
        self.consts: list = []
        self.attrs: dict[str, str] = {}
        self.names: dict[fx.Node, str] = {}
        self.lines: list[str] = []

    def name(self, node: fx.Node) -> str:
        if node not in self.names:
            base = node.name
            self.names[node] = f"{base}_" if base in _RESERVED or base.startswith("ember_") else base
        return self.names[node]

    def const(self, value: object) -> str:
        self.consts.append(value)
        return f"_consts[{len(self.consts) - 1}]"

    def arg(self, a: object) -> str:
        if isinstance(a, fx.Node):
            return self.name(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, bool) or a is None or isinstance(a, int | str):
            return repr(a)
        if isinstance(a, float):
            if math.isnan(a) or math.isinf(a):
                return f"float('{a}')"
            return repr(a)
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, (torch.layout, torch.memory_format)):
            return str(a)
        if isinstance(a, torch._ops.OpOverload):  # an op handed to a higher-order op
            return _qualname(a)
        return self.const(a)

    def call(self, node: fx.Node, target: object = None) -> str:
        """``node``'s op as Python (``target`` in its place when given: an in-place twin)."""
        target = node.target if target is None else target
        if target is operator.getitem:
            return f"{self.arg(node.args[0])}[{node.args[1]!r}]"
        args = [self.arg(a) for a in node.args] + [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        return f"{_qualname(target)}({', '.join(args)})"

    def write(self, expect: set[fx.Node]) -> ProgramSource:
        graph = self.plan.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        # Kept writes into graph inputs, and those a kernel stores in place (codegen/input_writes.py).
        self.writes = plan_input_writes(self.plan, self.kernels, settings().input_writes_as_stores)
        self.memory = plan_memory(self.plan, self.kernels, output, frozenset(self.writes.stored))
        counts: dict[str, int] = {}
        for s in self.plan.steps:
            kind = "generated" if s.index in self.kernels else ("fused-aten" if s.kind == "fused" else s.kind)
            counts[kind] = counts.get(kind, 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        self.prelude: list[str] = []
        out = [f"# Ember program: {self.title}", f"# steps: {summary}", ""]
        body = []
        if placeholders:
            body.append(f"{', '.join(self.name(p) for p in placeholders)}, = args")
        body.append("args.clear()")
        for n in graph.nodes:
            if n.op == "get_attr" and n.target.startswith(FOLDED_PREFIX):
                # A value the cleanup pass folded: kept with the program (a cached program is
                # linked against the captured module, which has no such attribute).
                self.prelude.append(f"{self.name(n)} = {self.const(get_attr(self.gm, n.target))}")
            elif n.op == "get_attr":
                self.ns[self.name(n)] = get_attr(self.gm, n.target)
                self.attrs[self.name(n)] = n.target
        # A written input whose strides are checked keeps its own name: _expect may rebind the
        # name to a copy, and the write must reach the caller's tensor.
        self.written: dict[fx.Node, str] = {}
        for p in placeholders:
            if p in expect:
                if p in self.writes.targets():
                    self.written[p] = f"{self.name(p)}_written"
                    body.append(f"{self.written[p]} = {self.name(p)}")
                body.append(self._expect_line(p))
        body += self._del_line(START)
        self.emitted: set[fx.Node] = set()
        for step in self.plan.steps:
            if step.kind == "constant":
                continue  # materialised right before the first step that needs it
            body += self._constants_for(step)
            body += self._step_lines(step, expect)
            body += self._del_line((step.index, None))  # after a kernel launch or frozen call
        for a in output.all_input_nodes:
            if a in self.plan.constants and a not in self.emitted:
                body += self._constants_for(Step(-1, "output", [output]))
                break
        body.append(f"return {self.arg(output.args[0])}")
        out += self.prelude + ["def run(args):"] + ["    " + line for line in body]
        self.ns["_consts"] = self.consts
        return ProgramSource("\n".join(out) + "\n", self.ns, self.attrs)

    def _expect_line(self, node: fx.Node) -> str:
        val = node.meta["val"]
        return f"{self.name(node)} = _expect({self.name(node)}, {tuple(val.stride())})"

    def _constants_for(self, step: Step) -> list[str]:
        # Generated kernels inline constants; everything else reads them as tensors. They are
        # built from metadata alone, so they never wait on another step.
        if step.index in self.kernels:
            return []
        lines = []
        for n in step.nodes:
            for a in n.all_input_nodes:
                if a in self.plan.constants and a not in self.emitted:
                    self.emitted.add(a)
                    val = a.meta["val"]
                    lines.append(f"{self.name(a)} = _empty({tuple(val.shape)}, {tuple(val.stride())}, "
                                 f"dtype={val.dtype}, device={self.arg(val.device)})"
                                 f".fill_({self.arg(constant_value(a))})  # [constant] {_short(a)}")
        return lines

    def _del_line(self, key: SlotKey) -> list[str]:
        dead = self.memory.deleted_after(key)
        return [f"del {', '.join(self.name(n) for n in dead)}"] if dead else []

    def _step_lines(self, step: Step, expect: set[fx.Node]) -> list[str]:
        if step.index in self.kernels:
            return self._kernel_lines(step, self.kernels[step.index])
        if step.kind == "frozen":
            return self._frozen_lines(step)
        if step.kind == "foreach":
            return self._foreach_lines(step)
        lines = []
        if step.kind == "fused":
            ops = ", ".join(_short(n) for n in step.nodes)
            lines.append(f"# [fused via ATen: no code generation for this device] {ops}")
        for n in step.nodes:
            note = {"extern": "library", "fallback": f"fallback: {step.reason}", "view": "view",
                    "constant": "constant", "getitem": None, "fused": None}[step.kind]
            line = self._input_write_line(n) or self._in_place_line(n) or f"{self.name(n)} = {self.call(n)}"
            if note and n not in self.writes.elided:
                line += f"  # [{note}]"
            lines.append(line)
            if n in expect:
                lines.append(self._expect_line(n))
            lines += self._del_line((step.index, n))  # op by op, as eager frees
        return lines

    def _foreach_lines(self, step: Step) -> list[str]:
        """Casts of graph inputs in one multi-tensor copy (schedule/batched_casts.py)."""
        dtype = step.nodes[0].meta["val"].dtype
        outs = ", ".join(self.name(n) for n in step.nodes)
        ins = ", ".join(self.name(n.args[0]) for n in step.nodes)
        return [f"# [foreach] {step.reason}",
                f"{outs}, = _cast_all(({ins},), {dtype})"]

    def _in_place_line(self, n: fx.Node) -> str | None:
        """An accumulating op into a fill made for it alone (a gradient's ``zeros.index_add``)
        adds in place: the functional op would copy the fill first, a second pass over it."""
        twin = _IN_PLACE.get(n.target)
        base = n.args[0] if n.args else None
        if twin is None or base not in self.plan.constants or len(base.users) != 1:
            return None
        return f"{self.name(n)} = {self.call(n, twin)}"

    def _input_write_line(self, n: fx.Node) -> str | None:
        """A kept ``copy_`` into a graph input: nothing to copy if a kernel stored the value there."""
        p = self.writes.elided.get(n)
        if p is not None:
            value = n.args[1]
            return (f"{self.name(n)} = _bump({self.written.get(p, self.name(p))}, {self.name(value)})  # [input "
                    f"write: stored in place by the kernel of step {self.plan.step_of[value].index}]")
        if n in self.writes.copies and n.args[0] in self.written:
            args = ", ".join([self.written[n.args[0]], *(self.arg(a) for a in n.args[1:])])
            return f"{self.name(n)} = aten.copy_.default({args})"
        return None

    def _frozen_lines(self, step: Step) -> list[str]:
        """``_prepare``: the parameter-only values, as a function of its own; ``run`` calls it
        through ``_frozen``, which recomputes only when a parameter's address or version changed."""
        members = set(step.nodes)
        params = list(dict.fromkeys(a for n in step.nodes for a in n.all_input_nodes
                                    if a not in members and a.op == "placeholder"))
        outs = _frozen_outputs(step)
        body = []
        for n, dead in zip(step.nodes, _frozen_dead_after(step, outs)):
            body.append(f"{self.name(n)} = {self.call(n)}")
            if dead:  # freed as soon as read: kept values and transients would interleave in the cache
                body.append(f"del {', '.join(self.name(d) for d in dead)}")
        ret = ", ".join(self.name(n) for n in outs)
        self.prelude += [f"def _prepare({', '.join(self.name(p) for p in params)}):",
                         f"    # {len(step.nodes)} ops computed from parameters only",
                         *("    " + line for line in body), f"    return ({ret}{',' if len(outs) == 1 else ''})", ""]
        target = f"{ret}{',' if len(outs) == 1 else ''}"
        placeholders = [n for n in self.plan.graph.nodes if n.op == "placeholder"]
        self.prelude += [f"_frozen_inputs = ({''.join(f'{placeholders.index(p)}, ' for p in params)})",
                         "",
                         "def refresh_frozen(args, addresses_known=False):",
                         "    # run's _frozen call, without running the program: before a CUDA-graph replay,",
                         "    # which runs none of run's host code. True: the values moved (capture again).",
                         "    # addresses_known: the replay's check found every parameter where it was.",
                         "    return _frozen.refresh(_prepare, [args[i] for i in _frozen_inputs], addresses_known)",
                         "",
                         "refresh_frozen.inputs = _frozen_inputs", ""]
        return [f"{target} = _frozen(_prepare, {', '.join(self.name(p) for p in params)})"
                f"  # [frozen] {len(step.nodes)} ops, recomputed when a parameter changes"]

    def _kernel_lines(self, group: FusedGroup, ks: KernelSource) -> list[str]:
        self.ns.setdefault("_kernels", {})
        lines = [f"# [generated {ks.name}] {len(group.nodes)} ops: {', '.join(_short(n) for n in group.nodes)}"]
        for n in group.outputs:
            val = n.meta["val"]
            dev = self.arg(val.device)
            if n in self.writes.stored:
                lines.append(f"{self.name(n)} = {self.name(self.writes.stored[n])}  # [input write] stored into "
                             "the graph input directly")
                continue
            dead = self.memory.reuse.get(n)
            if dead is not None:
                lines.append(f"{self.name(n)} = _reuse({self.name(dead)}, {tuple(val.shape)}, {tuple(val.stride())})"
                             f"  # [reuse] storage of {self.name(dead)}: dead, same {val.dtype}, "
                             f"{self.memory.nbytes[n]} bytes")
                continue
            lines.append(f"{self.name(n)} = _empty({tuple(val.shape)}, {tuple(val.stride())}, "
                         f"dtype={val.dtype}, device={dev})")
        args = ", ".join(self.name(a) for a in ks.args)
        if ks.backend == "cpu":
            lines.append(f"{ks.name}({args})")
            return lines
        if ks.workspace:  # a split reduction: partial results, then the kernel that combines them
            dev = self.arg(group.outputs[0].meta["val"].device)
            lines.append(f"_ws = _empty(({ks.workspace},), (1,), dtype=torch.float32, device={dev})"
                         f"  # [workspace] {len(ks.pre)} partial-result kernel(s)")
            args += ", _ws"
        for k in ks.launch_order():
            meta = ", ".join(f"{name}={v}" for name, v in k.meta.items())
            lines.append(f"{k.name}[({k.grid},)]({args}, {meta})")
        if ks.workspace:
            lines.append("del _ws")
        return lines


def _frozen_outputs(step: Step) -> list[fx.Node]:
    members = set(step.nodes)
    return [n for n in step.nodes if any(u not in members for u in n.users)]


def _frozen_dead_after(step: Step, outs: list[fx.Node]) -> list[list[fx.Node]]:
    """Per node of ``_prepare``, the values that are not returned and that no later node reads.
    Without freeing them, a cast that only feeds a concatenation (the query, key and value weights
    of ``merge_sibling_matmuls``) stays allocated until ``_prepare`` returns, between the values
    kept for the model's life: bert-base left 40 MiB of such gaps in the caching allocator."""
    kept = set(outs)
    index = {n: i for i, n in enumerate(step.nodes)}
    dead: list[list[fx.Node]] = [[] for _ in step.nodes]
    for n in step.nodes:
        if n in kept:
            continue
        readers = [index[u] for u in n.users if u in index]
        dead[max(readers, default=index[n])].append(n)
    return dead


def _qualname(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet = target._overloadpacket.__name__
        return f"{'aten' if ns == 'aten' else 'prims' if ns == 'prims' else 'torch.ops.' + ns}.{packet}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        # Activation checkpointing's dropout: ``run_and_save_rng_state`` in the forward (the RNG
        # state it ran with), ``run_with_rng_state`` in the recompute, so both draw one mask.
        return f"torch.ops.higher_order.{target.name()}"
    # Python's own functions on sizes (``operator.ge`` of a data-dependent size in a check,
    # ``torch.sym_max``, ``math.ceil``): by their module's name, which the namespace holds.
    name = getattr(target, "__name__", "")
    for module, prefix in ((operator, "operator"), (torch, "torch"), (math, "math")):
        if name and getattr(module, name, None) is target:
            return f"{prefix}.{name}"
    raise TypeError(f"cannot name {target!r}")


def _short(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def generate_program(gm: fx.GraphModule, plan: KernelPlan, kernels: dict[int, KernelSource], title: str,
                     expect: set[fx.Node]) -> ProgramSource:
    """The program for ``plan``; ``kernels`` maps step index -> generated kernel."""
    return _Writer(gm, plan, kernels, title).write(expect)
