"""A FusedGroup -> ONE numba CPU kernel (a ``cfunc``) plus the data of this use of it.

Iteration space (as for Triton; planned in cpu_iteration_space.py): the group's reference shape
S, kept dims K and reduced dims D.
The loops walk S in the memory order of the group's largest tensor, and adjacent dims that are
contiguous in every tensor the kernel touches merge into one loop ("loop dims"), so a
contiguous NCHW pointwise chain is one flat loop. The innermost loop is the *vector loop*; LLVM
vectorises it (reductions too: sums are reassociated). Long float32 sums add float32 partial
sums per block and float64 across blocks, so they stay exact over millions of elements.
bfloat16 tensors are computed in float32 as in Triton kernels (cpu_dialect.py: loads widen, stores round).
Pointwise ops are the shared lowerings of codegen/lowering.py in the numba dialect; the reduction
loops are written by codegen/cpu_reductions.py.

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

from ember.codegen.cpu_dialect import CPU, POINTER, CpuValue, load_expr, store_expr
from ember.codegen.cpu_iteration_space import (
    Access,
    Loop,
    choose_layout,
    collect_accesses,
    loop_dims,
    loop_size,
)
from ember.codegen.cpu_reductions import CpuReductions, indent
from ember.codegen.kernel_source import (
    INSTANCE_MARKER,
    KernelSource,
    canonical_source,
    node_source,
    split_module,
)
from ember.codegen.kernel_writer import Scope
from ember.codegen.lowering import POINTWISE_LOWERINGS, value_dtype
from ember.schedule.dim_map import walked_dims
from ember.schedule.op_support import kernel_dtype_unsupported
from ember.schedule.plan import Dims, FusedGroup
from ember.schedule.rules import OpClass

aten = torch.ops.aten

COLUMN_BLOCK = 512  # most points per unit of column reductions (stack accumulators: runtime STACK_BLOCK)
POINTWISE_BLOCK = 8192  # most points per unit of pointwise groups (work granularity only)
SCRATCH = 2048  # reduced extents up to this are persistent (runtime SCRATCH)
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


class CpuWriter(CpuReductions):
    """One fused group -> one numba kernel and the data of this use of it."""

    dialect = CPU
    value_type = CpuValue

    def __init__(self, group: FusedGroup, config: dict[str, int] | None = None) -> None:
        super().__init__(group)
        # Tuned overrides (ember/tune/space.py): "blk" points per column unit, "threads", "chunk"
        # (units per piece of the parallel split; runtime/cpu_support.py drive_chunked).
        self.config = dict(config or {})
        self._check_supported()
        self.tensors = list(group.inputs) + list(group.outputs)
        self.accesses = collect_accesses(group, self.tensor_names)
        self.loops_x, self.loops_r = loop_dims(self.shape, self.reduced_dims, self.accesses)
        self.layout = choose_layout(self.loops_x, self.loops_r, self.accesses, self.reduced_dims)
        self.static: list[int] = []  # argv after the pointers: sizes, strides, scalars
        self.prologue: list[str] = []  # parameter reads at the top of the kernel
        self.stack_arrays: list[str] = []
        self.scalars: dict[tuple, CpuValue] = {}
        # Persistent rows (short reduced extent, as Triton's persistent reductions): costly values
        # computed in one loop over the row are kept in stack scratch for the later loops.
        rnumel = 1
        for lp in self.loops_r:
            rnumel *= self._size(lp)
        self.persistent = self.layout == "rows" and rnumel <= SCRATCH
        self.scratch: dict[fx.Node, str] = {}
        self.final_loop = False

    # -- what the generator covers ---------------------------------------------------------------
    def _check_supported(self) -> None:
        if self.group.selects:  # the planner keeps cat / slice_scatter on ATen for this target
            raise CpuUnsupported("no CPU lowering for cat / slice_scatter (range selects)")
        for n in list(self.group.nodes) + list(self.group.inputs):
            val = n.meta.get("val")
            why = kernel_dtype_unsupported("cpu", val.dtype) if isinstance(val, torch.Tensor) else ""
            if why:
                raise CpuUnsupported(why)
        for n in self.group.nodes:
            cls = self.group.classes[n]
            if cls == OpClass.POINTWISE and n.target not in POINTWISE_LOWERINGS:
                raise CpuUnsupported(f"no CPU lowering for {n.target}")
            if cls not in (OpClass.POINTWISE, OpClass.REDUCTION, OpClass.VIEW):
                raise CpuUnsupported(f"{n.target} is not a fusable op")

    # -- iteration space (cpu_iteration_space.py) ------------------------------------------------
    def _size(self, loop: Loop) -> int:
        return loop_size(self.shape, loop)

    @property
    def vector_loop(self) -> Loop | None:
        if self.layout == "rows":
            return self.loops_r[-1] if self.loops_r else None
        return self.loops_x[-1] if self.loops_x else None

    # -- parameters ------------------------------------------------------------------------------
    def _param(self, name: str, value: int, read: str | None = None) -> str:
        slot = len(self.tensors) + len(self.static)
        self.static.append(int(value))
        self.prologue.append(f"{name} = {read.format(f'a[{slot}]') if read else f'a[{slot}]'}")
        return name

    def _scalar(self, value: object, key: tuple) -> CpuValue:
        """A Python scalar of the graph: a kernel parameter (so the text does not depend on it),
        one per (node, argument) however many loops evaluate the node."""
        if isinstance(value, bool):
            return CpuValue("True" if value else "False", None, "bool")
        if key not in self.scalars:
            self.counter += 1
            if isinstance(value, float):
                bits = int(np.array(value, dtype=np.float64).view(np.int64))
                self.scalars[key] = CpuValue(self._param(f"c{self.counter}", bits, "_i64_as_f64({})"), None, "float")
            elif isinstance(value, int):
                self.scalars[key] = CpuValue(self._param(f"c{self.counter}", value), None, "int")
            else:
                raise CpuUnsupported(f"scalar argument {value!r}")
        return self.scalars[key]

    # -- index expressions -----------------------------------------------------------------------
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

    def _rlin(self) -> str:
        """The position in the row: the reduced loop coordinates as one linear index."""
        expr = self.loops_r[0].var
        for lp in self.loops_r[1:]:
            expr = f"({expr} * {lp.size_param} + {lp.var})"
        return expr

    # -- values (kernel_writer.KernelWriter) -----------------------------------------------------
    def _home(self, dims: Dims, scope: Scope) -> Scope:
        return scope if (self._walks_reduced(dims) or self.layout == "columns") else scope.x_scope

    def _load(self, node: fx.Node, dims: Dims, scope: Scope, home: Scope) -> CpuValue:
        target = self._home(dims, scope)  # by the loaded tensor's own dims
        key = ("load", node, dims)
        if key in target.cache:
            return target.cache[key]
        acc = next(a for a in self.accesses if a.node is node and a.dims == dims and not a.store)
        dtype = node.meta["val"].dtype
        var = self._tmp()
        target.lines.append(f"{var} = {load_expr(f'{acc.pointer}[{self._index(acc)}]', dtype)}")
        target.cache[key] = CpuValue(var, dtype)
        return target.cache[key]

    def _pointwise(self, node: fx.Node, scope: Scope, home: Scope) -> CpuValue:
        if node in self.scratch:  # computed in an earlier loop over this row
            var = self._tmp()
            home.lines.append(f"{var} = {self.scratch[node]}[{self._rlin()}]  # kept: {node_source(node)}")
            return CpuValue(var, node.meta["val"].dtype)
        result = super()._pointwise(node, scope, home)
        dtype = value_dtype(node)
        if (self.persistent and not self.final_loop and node.target in _COSTLY
                and self._walks_reduced(self.group.dims[node]) and dtype in (torch.float32, torch.float64)):
            self.counter += 1
            sc = f"sc{self.counter}"
            self.stack_arrays.append(f"{sc} = _scratch_{'f32' if dtype == torch.float32 else 'f64'}()")
            home.lines.append(f"{sc}[{self._rlin()}] = {result.expr}")
            self.scratch[node] = sc
        return result

    # -- stores ----------------------------------------------------------------------------------
    def _store(self, node: fx.Node, body: Scope) -> None:
        acc = next(a for a in self.accesses if a.node is node and a.store)
        val = self.value(node, body)
        expr = store_expr(val, node.meta["val"].dtype)
        dims = self.group.dims[node]
        covered = walked_dims(dims)
        walked = self.loops_x + (self.loops_r if self._walks_reduced(dims) else [])
        guards = []
        for lp in walked:
            if not covered.intersection(lp.members):  # a broadcast dim: store once
                var = "xi" if (self.layout == "columns" and lp is self.loops_x[-1]) else lp.var
                guards.append(f"{var} == 0")
        target = self._home(dims, body)
        line = f"{acc.pointer}[{self._index(acc)}] = {expr}"
        target.lines.append(f"if {' and '.join(guards)}:" if guards else line)
        if guards:
            target.lines.append("    " + line)

    # -- the kernel ------------------------------------------------------------------------------
    def write(self) -> KernelSource:
        self.unit = Scope()
        self.count_line = ""
        for lp in self.loops_x + self.loops_r:
            self._param(lp.size_param, self._size(lp))
        columns = self.layout == "columns"
        unit_head = self._unit_coordinates()
        for lv in self.levels():
            self._level([r for r in self.reductions if self.level[r] == lv])
        x_outputs = [n for n in self.group.outputs if not self._walks_reduced(self.group.dims[n])]
        full_outputs = [n for n in self.group.outputs if self._walks_reduced(self.group.dims[n])]
        if x_outputs:
            body = Scope(None if columns else self.unit)
            for n in x_outputs:
                self._store(n, body)
            if columns:
                self.unit.lines += self._nest(body, reduced=False, vector=True)
        if full_outputs:
            self.final_loop = True
            body = Scope(None if columns else self.unit)
            for n in full_outputs:
                self._store(n, body)
            self.unit.lines += self._nest(body, reduced=True, vector=columns)
        return self._assemble(unit_head)

    def _column_block(self) -> int:
        """Points of the innermost kept loop per unit: aim at 8 or more units along it (threads
        balance), within [64, COLUMN_BLOCK] for reductions and [1024, POINTWISE_BLOCK] otherwise."""
        if "blk" in self.config:
            return self.config["blk"]
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
        params_ptr = [f"{self.tensor_names[n]} = {POINTER[n.meta['val'].dtype]}(a[{i}])"
                      for i, n in enumerate(self.tensors)]
        shape = (f"layout {self.layout}; kept loops {[lp.members for lp in self.loops_x]}, "
                 f"reduced loops {[lp.members for lp in self.loops_r]} of S")
        body = (["a = _p_i64(argv)"] + params_ptr + self.prologue + self.prologue_extra
                + ([self.count_line] if self.count_line else []) + self.stack_arrays
                + ["for u in range(unit_lo, unit_hi):"] + indent(unit_head + self.unit.lines))
        text = (f"@cfunc(KERNEL_SIGNATURE, cache=True, error_model=\"numpy\", fastmath={FASTMATH})\n"
                f"def KERNEL_NAME(unit_lo, unit_hi, argv):\n    # {shape}\n"
                + "\n".join(indent(body)) + "\n")
        canonical = canonical_source(text)
        head = header()
        digest = hashlib.sha256((head + canonical).encode()).hexdigest()[:16]
        kernel_name = f"ember_cpu_{digest}"
        instance = {"kernel": kernel_name, "static": self.static, "units": units, "points": points,
                    "tensors": len(self.tensors)}
        for key in ("threads", "chunk"):  # tuned: thread count, units per piece dealt to threads in turn
            if key in self.config:
                instance[key] = self.config[key]
        trailer = INSTANCE_MARKER + json.dumps(instance, separators=(",", ":")) + "\n"
        name = f"{kernel_name}_{hashlib.sha256(trailer.encode()).hexdigest()[:8]}"
        ops = "\n".join(f"#   {node_source(n)}" for n in self.group.nodes)
        sizes = f"# S={list(self.shape)} reduced={sorted(self.reduced_dims)} units={units}\n"
        source = f"# source ops:\n{ops}\n{sizes}" + text.replace("KERNEL_NAME", kernel_name) + "\n" + trailer
        return KernelSource(name, source, digest, self.tensors, len(self.group.inputs), units, {"units": units}, head,
                            canonical.replace("KERNEL_NAME", kernel_name) + "\n" + trailer, backend="cpu")


def generate_cpu(group: FusedGroup, config: dict[str, int] | None = None) -> KernelSource:
    """The numba kernel for ``group``; raises CpuUnsupported (with the reason) for groups the
    generator does not cover, which then run op by op through ATen. ``config`` overrides the
    work-unit rules (a tuned configuration); the compiled module is the same for every config."""
    return CpuWriter(group, config).write()


__all__ = ["CpuUnsupported", "INSTANCE_MARKER", "generate_cpu", "split_module"]
