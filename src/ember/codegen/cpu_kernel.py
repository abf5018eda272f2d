"""A FusedGroup -> ONE numba CPU kernel (a ``cfunc``) plus the data of this use of it.

Iteration space (as for Triton; planned in cpu_iteration_space.py): the group's reference shape
S, kept dims K and reduced dims D.
The loops walk S in the memory order of the group's largest tensor, and adjacent dims that are
contiguous in every tensor the kernel touches merge into one loop ("loop dims"), so a
contiguous NCHW pointwise chain is one flat loop. The innermost loop is the *vector loop*; LLVM
vectorises it (reductions too: sums are reassociated). Long float32 sums add float32 partial
sums per block and float64 across blocks, so they stay exact over millions of elements.
bfloat16 tensors are computed in float32 as in Triton kernels (cpu_ops.py: loads widen, stores round).

Layouts:
  rows     a reduced dim is innermost in memory (softmax, layer norm, batch-norm statistics of
           NCHW tensors): one work unit per kept point; per reduction level one loop nest over
           the reduced dims with scalar accumulators, then a loop that stores the full outputs.
           Rows of up to ``SCRATCH`` points are *persistent* (as Triton's persistent reductions):
           exp/erf/tanh... values are kept in stack scratch for the later loops, not recomputed.
  columns  a kept dim is innermost (pointwise groups; sums over the batch of a [B, C] tensor,
           channels-last statistics): one work unit per block of (up to ``COLUMN_BLOCK``) points of the
           innermost kept dim, accumulators in stack arrays, reduced loops outside the vector loop.
Work units are split over threads by the driver (runtime/cpu_support.py).

The kernel text is independent of sizes, strides and scalar constants: they are read from the
kernel's int64 argument vector (float constants as bit patterns), so all layers of a model with
the same op structure and memory-order pattern share one compiled kernel. Only a unit stride of
the vector loop is written into the text (LLVM needs it to vectorise). The module is named by a
hash of its text; ``KernelSource.name`` adds a hash of this use's data, which the module source
carries in a trailing ``# ember-cpu-instance:`` line (runtime/kernels.py turns it into a launcher).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from ember.codegen import cpu_ops
from ember.codegen.cpu_iteration_space import (
    Access,
    Loop,
    choose_layout,
    collect_accesses,
    loop_dims,
    loop_size,
    reduction_levels,
)
from ember.codegen.cpu_ops import NP_DTYPE, POINTER, Value, typed, value_dtype
from ember.codegen.kernel_source import KernelSource, canonical_source, node_source
from ember.schedule.plan import FusedGroup
from ember.schedule.rules import OpClass, classify, constant_value

aten = torch.ops.aten

INSTANCE_MARKER = "# ember-cpu-instance: "
COLUMN_BLOCK = 512  # most points per unit of column reductions (stack accumulators: runtime STACK_BLOCK)
POINTWISE_BLOCK = 8192  # most points per unit of pointwise groups (work granularity only)
SCRATCH = 2048  # reduced extents up to this are persistent (runtime SCRATCH)
ACC_BLOCK = 4096  # long float32 row sums: elements per float32 block (64 per lane) before float64
COLUMN_ACC_BLOCK = 128  # float32 column sums: rows per float32 block before float64
# Values worth a store and a load rather than computing again in a later loop over the row.
_COSTLY = {aten.exp.default, aten.log.default, aten.erf.default, aten.tanh.default, aten.sigmoid.default,
           aten.sin.default, aten.cos.default}
FASTMATH = '{"reassoc", "nsz", "contract"}'  # never nnan/ninf: NaN and inf behave as in torch
_SUPPORT = Path(__file__).resolve().parents[1] / "runtime" / "cpu_support.py"


class CpuUnsupported(Exception):
    """The group stays on the ATen path; the message says why."""


_DIGEST: list[str] = []


def _support_digest() -> str:
    if not _DIGEST:
        _DIGEST.append(hashlib.sha256(_SUPPORT.read_bytes()).hexdigest()[:12])
    return _DIGEST[0]


def header() -> str:
    return ("import math\n\nimport numpy as np\nfrom numba import cfunc\n\n"
            "from ember.runtime.cpu_support import *  # noqa: F403\n"
            f"# cpu_support {_support_digest()}: kernels are renamed when their helpers change\n")


class _Body:
    """Lines and value cache of one loop body, or of a unit's top level (``xbody`` is where
    values that walk no reduced dim are computed: the unit for rows, the body itself for columns)."""

    def __init__(self, xbody: _Body | None = None) -> None:
        self.lines: list[str] = []
        self.cache: dict = {}
        self.xbody = xbody if xbody is not None else self


class _CpuWriter:
    def __init__(self, group: FusedGroup) -> None:
        self.g = group
        self.S = group.shape
        self.D = set(group.rdims)
        self._check_supported()
        self.tensors = list(group.inputs) + list(group.outputs)
        self.pointer = {n: f"in{i}" for i, n in enumerate(group.inputs)}
        self.pointer.update({n: f"out{i}" for i, n in enumerate(group.outputs)})
        self.accesses = collect_accesses(group, self.pointer)
        self.loops_x, self.loops_r = loop_dims(self.S, self.D, self.accesses)
        self.reductions = [n for n in group.nodes if classify(n).cls == OpClass.REDUCTION]
        self.layout = choose_layout(self.loops_x, self.loops_r, self.accesses, self.D)
        self.static: list[int] = []  # argv after the pointers: sizes, strides, scalars
        self.prologue: list[str] = []  # parameter reads at the top of the kernel
        self.counter = 0
        self.level = reduction_levels(group)
        self.stack_arrays: list[str] = []
        self.scalars: dict[tuple, Value] = {}
        # Persistent rows (short reduced extent, as Triton's persistent reductions): costly values
        # computed in one loop over the row are kept in stack scratch for the later loops.
        rnumel = 1
        for lp in self.loops_r:
            rnumel *= self._size(lp)
        self.persistent = self.layout == "rows" and rnumel <= SCRATCH
        self.scratch: dict[fx.Node, str] = {}
        self.final_loop = False

    # -- what the generator covers ----------------------------------------------------------
    def _check_supported(self) -> None:
        for n in list(self.g.nodes) + list(self.g.inputs):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype not in cpu_ops.SUPPORTED_DTYPES:
                raise CpuUnsupported(f"{val.dtype} tensors stay on the ATen path (no exact CPU kernel for them)")
        for n in self.g.nodes:
            cls = classify(n).cls
            if cls == OpClass.POINTWISE and n.target not in cpu_ops.CPU_POINTWISE_OPS:
                raise CpuUnsupported(f"no CPU lowering for {n.target}")
            if cls not in (OpClass.POINTWISE, OpClass.REDUCTION, OpClass.VIEW):
                raise CpuUnsupported(f"{n.target} is not a fusable op")

    # -- iteration space (cpu_iteration_space.py) -------------------------------------------
    def _size(self, loop: Loop) -> int:
        return loop_size(self.S, loop)

    @property
    def vector_loop(self) -> Loop | None:
        if self.layout == "rows":
            return self.loops_r[-1] if self.loops_r else None
        return self.loops_x[-1] if self.loops_x else None

    # -- parameters -------------------------------------------------------------------------
    def _param(self, name: str, value: int, read: str | None = None) -> str:
        slot = len(self.tensors) + len(self.static)
        self.static.append(int(value))
        self.prologue.append(f"{name} = {read.format(f'a[{slot}]') if read else f'a[{slot}]'}")
        return name

    def _scalar(self, value: object, key: tuple) -> Value:
        """A Python scalar of the graph: a kernel parameter (so the text does not depend on it),
        one per (node, argument) however many loops evaluate the node."""
        if isinstance(value, bool):
            return Value("True" if value else "False", None, "bool")
        if key not in self.scalars:
            self.counter += 1
            if isinstance(value, float):
                bits = int(np.array(value, dtype=np.float64).view(np.int64))
                self.scalars[key] = Value(self._param(f"c{self.counter}", bits, "_i64_as_f64({})"), None, "float")
            elif isinstance(value, int):
                self.scalars[key] = Value(self._param(f"c{self.counter}", value), None, "int")
            else:
                raise CpuUnsupported(f"scalar argument {value!r}")
        return self.scalars[key]

    def _tmp(self) -> str:
        self.counter += 1
        return f"t{self.counter}"

    # -- index expressions --------------------------------------------------------------------
    def _terms(self, acc: Access, loops: list[Loop], coord: dict[str, str]) -> list[str]:
        terms = []
        for loop in loops:
            st = acc.stride(loop)
            if st == 0:
                continue
            var = coord.get(loop.var, loop.var)
            if loop is self.vector_loop and st == 1:
                terms.append(var)  # unit stride in the text: LLVM vectorises contiguous access
            else:
                terms.append(f"{var} * {self._stride_param(acc, loop, st)}")
        return terms

    def _stride_param(self, acc: Access, loop: Loop, st: int) -> str:
        key = ("stride", id(acc), loop.var)
        if key not in self.unit.cache:
            self.counter += 1
            self.unit.cache[key] = self._param(f"st{self.counter}", st)
        return self.unit.cache[key]

    def _row_loops(self) -> list[Loop]:
        """Kept loops whose coordinate is fixed per unit."""
        return self.loops_x if self.layout == "rows" else self.loops_x[:-1]

    def _index(self, acc: Access) -> str:
        """Offset of ``acc`` at the current point: the per-unit base plus the loop terms."""
        key = ("base", id(acc))
        if key not in self.unit.cache:
            terms = self._terms(acc, self._row_loops(), {})
            base = None
            if terms:
                self.counter += 1
                base = f"b{self.counter}"
                self.unit.lines.append(f"{base} = {' + '.join(terms)}")
            self.unit.cache[key] = base
        base = self.unit.cache[key]
        inner = self._terms(acc, [lp for lp in self.loops_x if lp not in self._row_loops()] + self.loops_r,
                            {self.loops_x[-1].var: "xi"} if self.layout == "columns" and self.loops_x else {})
        parts = ([base] if base else []) + inner
        return " + ".join(parts) if parts else "0"

    def _walks_r(self, dims: tuple) -> bool:
        return any(d in self.D for d in dims if d is not None)

    # -- values -------------------------------------------------------------------------------
    def _load(self, node: fx.Node, dims: tuple, body: _Body) -> Value:
        target = body if (self._walks_r(dims) or self.layout == "columns") else body.xbody
        key = ("load", node, dims)
        if key in target.cache:
            return target.cache[key]
        acc = next(a for a in self.accesses if a.node is node and a.dims == dims and not a.store)
        dtype = node.meta["val"].dtype
        var = self._tmp()
        target.lines.append(f"{var} = {cpu_ops.load_expr(f'{acc.pointer}[{self._index(acc)}]', dtype)}")
        target.cache[key] = Value(var, dtype)
        return target.cache[key]

    def value(self, node: fx.Node, body: _Body) -> Value:
        dims = self.g.dims[node]
        target = body if (self._walks_r(dims) or self.layout == "columns") else body.xbody
        if node in target.cache:
            return target.cache[node]
        if node in self.scratch:  # computed in an earlier loop over this row
            var = self._tmp()
            target.lines.append(f"{var} = {self.scratch[node]}[{self._rlin()}]  # kept: {node_source(node)}")
            target.cache[node] = Value(var, node.meta["val"].dtype)
            return target.cache[node]
        cls = classify(node).cls
        if cls == OpClass.VIEW:
            result = self.value(node.args[0], body)
        elif cls == OpClass.REDUCTION:
            result = self._reduced_value(node, target)
        else:
            ops = []
            structural = cpu_ops.STRUCTURAL_ARGS.get(node.target, set())
            for i, a in enumerate(node.args):
                if isinstance(a, fx.Node):
                    if a in self.g.dims:
                        ops.append(self.value(a, body))
                    elif a in self.g.input_dims[node]:
                        ops.append(self._load(a, self.g.input_dims[node][a], body))
                    else:
                        ops.append(self._scalar(constant_value(a), (a,)))
                elif a is None:
                    ops.append(Value("None", None))
                elif isinstance(a, (bool, int, float)) and i not in structural:
                    ops.append(self._scalar(a, (node, i)))
                else:
                    ops.append(Value(repr(a), None))
            var = self._tmp()
            target.lines.append(f"{var} = {cpu_ops.lower_pointwise(node, ops)}  # {node_source(node)}")
            result = Value(var, node.meta["val"].dtype)
            dtype = value_dtype(node)
            if (self.persistent and not self.final_loop and node.target in _COSTLY and self._walks_r(dims)
                    and dtype in (torch.float32, torch.float64)):
                self.counter += 1
                sc = f"sc{self.counter}"
                self.stack_arrays.append(f"{sc} = _scratch_{'f32' if dtype == torch.float32 else 'f64'}()")
                target.lines.append(f"{sc}[{self._rlin()}] = {var}")
                self.scratch[node] = sc
        target.cache[node] = result
        return result

    def _rlin(self) -> str:
        """The position in the row: the reduced loop coordinates as one linear index."""
        expr = self.loops_r[0].var
        for lp in self.loops_r[1:]:
            expr = f"({expr} * {lp.size_param} + {lp.var})"
        return expr

    # -- reductions -----------------------------------------------------------------------------
    def _acc_dtype(self, node: fx.Node) -> tuple[torch.dtype, str]:
        dtype = value_dtype(node)  # bfloat16 accumulates in float32 (or float64)
        kind = {aten.amax.default: "max", aten.amin.default: "min"}.get(node.target, "sum")
        if kind == "sum" and dtype == torch.float32 and not self.persistent:
            # Long or column-wise float32 sums accumulate in float64; a persistent row (<= SCRATCH
            # values, summed in vector lanes) stays within float32 rounding of ATen in float32.
            return torch.float64, kind
        return dtype, kind

    def _identity(self, node: fx.Node) -> str:
        acc_dt, kind = self._acc_dtype(node)
        if kind == "sum":
            return typed(0, acc_dt)
        if acc_dt.is_floating_point:
            return f"{NP_DTYPE[acc_dt]}({'-' if kind == 'max' else ''}np.inf)"
        info = torch.iinfo(acc_dt) if acc_dt != torch.bool else None
        if info is None:
            return "False" if kind == "max" else "True"
        return typed(info.min if kind == "max" else info.max, acc_dt)

    def _combine(self, node: fx.Node, acc: str, v: str) -> str:
        acc_dt, kind = self._acc_dtype(node)
        if kind == "sum":
            return f"{acc} + {v}"
        if acc_dt.is_floating_point:
            return f"_f{kind}({acc}, {v})"
        return f"({v} if {v} {'>' if kind == 'max' else '<'} {acc} else {acc})"

    def _finish(self, node: fx.Node, acc: str) -> str:
        dtype = value_dtype(node)
        if node.target == aten.mean.dim:
            if "rcount" not in self.unit.cache:
                sizes = " * ".join(lp.size_param for lp in self.loops_r)
                self.count_line = f"rcount = np.float64({sizes})"
                self.unit.cache["rcount"] = True
            return f"{NP_DTYPE[dtype]}({acc} / rcount)"
        acc_dt, _ = self._acc_dtype(node)
        return acc if acc_dt == dtype else f"{NP_DTYPE[dtype]}({acc})"

    def _reduce_input(self, node: fx.Node, body: _Body, widen: bool = True) -> str:
        """The reduced value in the reduction's dtype, or (``widen``) in its accumulator's."""
        src = node.args[0]
        dtype = value_dtype(node)
        if src in self.g.dims:
            op = self.value(src, body)
        else:
            op = self._load(src, self.g.input_dims[node][src], body)
        acc_dt, _ = self._acc_dtype(node)
        v = op.as_(dtype)
        return v if (acc_dt == dtype or not widen) else f"{NP_DTYPE[acc_dt]}({v})"

    def _reduced_value(self, node: fx.Node, target: _Body) -> Value:
        var = self.unit.cache[("acc", node)]
        dtype = node.meta["val"].dtype
        if self.layout == "rows":
            return Value(var, dtype)  # finished scalar, computed after its level's loop
        out = self._tmp()
        target.lines.append(f"{out} = {self._finish(node, f'{var}[xi - lo]')}  # {node_source(node)}")
        return Value(out, dtype)

    # -- loops --------------------------------------------------------------------------------
    def _nest(self, body: _Body, reduced: bool, vector: bool, blocked: tuple = ()) -> list[str]:
        """``body`` inside the reduced loops (outermost first) and/or the vector loop. ``blocked``
        = (block size, init lines, flush lines): the innermost reduced loop runs in blocks whose
        float32 partial sums are zeroed before and added to the float64 totals after each block."""
        lines = body.lines or ["pass"]
        if vector:
            lines = ["for xi in range(lo, hi):"] + _indent(lines)
        loops = self.loops_r if reduced else []
        for i in range(len(loops) - 1, -1, -1):
            lp = loops[i]
            if blocked and i == len(loops) - 1:
                size, init, flush = blocked
                start = f"{lp.var}b"
                lines = (init + [f"for {lp.var} in range({start}, min({start} + {size}, {lp.size_param})):"]
                         + _indent(lines) + flush)
                lines = [f"for {start} in range(0, {lp.size_param}, {size}):"] + _indent(lines)
            else:
                lines = [f"for {lp.var} in range({lp.size_param}):"] + _indent(lines)
        return lines

    def _level(self, reductions: list[fx.Node]) -> None:
        columns = self.layout == "columns"
        body = _Body(None if columns else self.unit)
        init: list[str] = []
        flush: list[str] = []
        for r in reductions:
            acc_dt, kind = self._acc_dtype(r)
            # A long float32 sum: float32 partial sums per block (full vector width, no
            # conversions), float64 across blocks (exact over millions of elements).
            block = kind == "sum" and acc_dt == torch.float64 and value_dtype(r) == torch.float32
            v = self._reduce_input(r, body, widen=not block)
            self.counter += 1
            acc = f"acc{self.counter}"
            blk = f"{acc}b"
            if columns:
                self.stack_arrays.append(f"{acc} = _stack_{POINTER[acc_dt][3:]}()")
                self.unit.lines += ["for xi in range(lo, hi):", f"    {acc}[xi - lo] = {self._identity(r)}"]
                if block:
                    self.stack_arrays.append(f"{blk} = _stack_f32()")
                    init += ["for xi in range(lo, hi):", f"    {blk}[xi - lo] = np.float32(0.0)"]
                    flush += ["for xi in range(lo, hi):",
                              f"    {acc}[xi - lo] = {acc}[xi - lo] + np.float64({blk}[xi - lo])"]
                    body.lines.append(f"{blk}[xi - lo] = {blk}[xi - lo] + {v}  # {node_source(r)}")
                else:
                    body.lines.append(f"{acc}[xi - lo] = {self._combine(r, f'{acc}[xi - lo]', v)}  # {node_source(r)}")
            else:
                self.unit.lines.append(f"{acc} = {self._identity(r)}")
                if block:
                    init.append(f"{blk} = np.float32(0.0)")
                    flush.append(f"{acc} = {acc} + np.float64({blk})")
                    body.lines.append(f"{blk} = {blk} + {v}  # {node_source(r)}")
                else:
                    body.lines.append(f"{acc} = {self._combine(r, acc, v)}  # {node_source(r)}")
            self.unit.cache[("acc", r)] = acc
        blocked = ((COLUMN_ACC_BLOCK if columns else ACC_BLOCK), init, flush) if init else ()
        self.unit.lines += self._nest(body, reduced=True, vector=columns, blocked=blocked)
        if not columns:
            for r in reductions:
                acc = self.unit.cache[("acc", r)]
                var = self._tmp()
                self.unit.lines.append(f"{var} = {self._finish(r, acc)}  # {node_source(r)}")
                self.unit.cache[("acc", r)] = var

    def _store(self, node: fx.Node, body: _Body) -> None:
        acc = next(a for a in self.accesses if a.node is node and a.store)
        val = self.value(node, body)
        expr = cpu_ops.store_expr(val, node.meta["val"].dtype)
        covered = {d for d in self.g.dims[node] if d is not None}
        walked = self.loops_x + (self.loops_r if self._walks_r(self.g.dims[node]) else [])
        guards = []
        for lp in walked:
            if not covered.intersection(lp.members):  # a broadcast dim: store once
                var = "xi" if (self.layout == "columns" and lp is self.loops_x[-1]) else lp.var
                guards.append(f"{var} == 0")
        target = body if (self._walks_r(self.g.dims[node]) or self.layout == "columns") else body.xbody
        line = f"{acc.pointer}[{self._index(acc)}] = {expr}"
        target.lines.append(f"if {' and '.join(guards)}:" if guards else line)
        if guards:
            target.lines.append("    " + line)

    # -- the kernel ---------------------------------------------------------------------------
    def write(self) -> KernelSource:
        self.unit = _Body()
        self.count_line = ""
        for lp in self.loops_x + self.loops_r:
            self._param(lp.size_param, self._size(lp))
        columns = self.layout == "columns"
        unit_head = self._unit_coordinates()
        for lv in sorted({self.level[r] for r in self.reductions}):
            self._level([r for r in self.reductions if self.level[r] == lv])
        x_outputs = [n for n in self.g.outputs if not self._walks_r(self.g.dims[n])]
        full_outputs = [n for n in self.g.outputs if self._walks_r(self.g.dims[n])]
        if x_outputs:
            body = _Body(None if columns else self.unit)
            for n in x_outputs:
                self._store(n, body)
            if columns:
                self.unit.lines += self._nest(body, reduced=False, vector=True)
        if full_outputs:
            self.final_loop = True
            body = _Body(None if columns else self.unit)
            for n in full_outputs:
                self._store(n, body)
            self.unit.lines += self._nest(body, reduced=True, vector=columns)
        return self._assemble(unit_head)

    def _column_block(self) -> int:
        """Points of the innermost kept loop per unit: aim at 8 or more units along it (threads
        balance), within [64, COLUMN_BLOCK] for reductions and [1024, POINTWISE_BLOCK] otherwise."""
        cap, floor = (COLUMN_BLOCK, 64) if self.loops_r else (POINTWISE_BLOCK, 1024)
        want = -(-self._size(self.loops_x[-1]) // 8)
        return max(min(cap, -(-want // 16) * 16), floor)

    def _unit_coordinates(self) -> list[str]:
        """Lines that turn the unit number ``u`` into kept coordinates (and the column block)."""
        lines = []
        rows = self._row_loops()
        self.prologue_extra = []
        rem = "u"
        if self.layout == "columns":
            if self.loops_x:
                last = self.loops_x[-1].size_param
                self._param("blk", self._column_block())
                self.prologue_extra = [f"nblk = ({last} + blk - 1) // blk"]
                lines += ["row = u // nblk", "lo = (u - row * nblk) * blk", f"hi = min(lo + blk, {last})"]
            else:  # a 0-d iteration space: one point
                lines += ["row = u", "lo = 0", "hi = 1"]
            rem = "row"
        for i in range(len(rows) - 1, -1, -1):
            lp = rows[i]
            if i == 0:
                lines.append(f"{lp.var} = {rem}")
            else:
                lines.append(f"{lp.var} = {rem} % {lp.size_param}")
                lines.append(f"rem = {rem} // {lp.size_param}")
                rem = "rem"
        return lines

    def units(self) -> int:
        rows = 1
        for lp in self._row_loops():
            rows *= self._size(lp)
        if self.layout == "columns" and self.loops_x:
            rows *= -(-self._size(self.loops_x[-1]) // self._column_block())
        return rows

    def _assemble(self, unit_head: list[str]) -> KernelSource:
        points = 1
        for lp in self.loops_x + self.loops_r:
            points *= self._size(lp)
        units = self.units()  # a reduction over an empty extent still stores its identity
        params_ptr = [f"{self.pointer[n]} = {POINTER[n.meta['val'].dtype]}(a[{i}])" for i, n in enumerate(self.tensors)]
        shape = (f"layout {self.layout}; kept loops {[lp.members for lp in self.loops_x]}, "
                 f"reduced loops {[lp.members for lp in self.loops_r]} of S")
        body = (["a = _p_i64(argv)"] + params_ptr + self.prologue + self.prologue_extra
                + ([self.count_line] if self.count_line else []) + self.stack_arrays
                + ["for u in range(unit_lo, unit_hi):"] + ["    " + line for line in unit_head + self.unit.lines])
        text = (f"@cfunc(KERNEL_SIGNATURE, cache=True, error_model=\"numpy\", fastmath={FASTMATH})\n"
                f"def KERNEL_NAME(unit_lo, unit_hi, argv):\n    # {shape}\n"
                + "\n".join("    " + line for line in body) + "\n")
        canonical = canonical_source(text)
        head = header()
        digest = hashlib.sha256((head + canonical).encode()).hexdigest()[:16]
        kernel_name = f"ember_cpu_{digest}"
        instance = {"kernel": kernel_name, "static": self.static, "units": units, "points": points,
                    "tensors": len(self.tensors)}
        trailer = INSTANCE_MARKER + json.dumps(instance, separators=(",", ":")) + "\n"
        name = f"{kernel_name}_{hashlib.sha256(trailer.encode()).hexdigest()[:8]}"
        ops = "\n".join(f"#   {node_source(n)}" for n in self.g.nodes)
        sizes = f"# S={list(self.S)} reduced={sorted(self.D)} units={units}\n"
        source = f"# source ops:\n{ops}\n{sizes}" + text.replace("KERNEL_NAME", kernel_name) + "\n" + trailer
        return KernelSource(name, source, digest, self.tensors, len(self.g.inputs), units, {"units": units}, head,
                            canonical.replace("KERNEL_NAME", kernel_name) + "\n" + trailer, backend="cpu")


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


def generate_cpu(group: FusedGroup) -> KernelSource:
    """The numba kernel for ``group``; raises CpuUnsupported (with the reason) for groups the
    generator does not cover, which then run op by op through ATen."""
    return _CpuWriter(group).write()


def split_module(text: str) -> tuple[str, dict]:
    """A CPU kernel's module source -> (the shared kernel module, this use's data)."""
    shared, marker, trailer = text.rpartition(INSTANCE_MARKER)
    if not marker:
        raise ValueError("not a CPU kernel module (no instance line)")
    return shared.rstrip("\n") + "\n", json.loads(trailer)


__all__ = ["CpuUnsupported", "INSTANCE_MARKER", "generate_cpu", "split_module"]
