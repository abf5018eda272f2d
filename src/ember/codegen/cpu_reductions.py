"""The reductions of a numba CPU kernel: the half of ``CpuWriter`` (codegen/cpu_kernel.py) that
writes the loop nests over the reduced dims and their accumulators.

Per reduction level one loop nest over the reduced loops. Rows (a reduced dim innermost) keep
scalar accumulators per unit and finish them after the nest; columns (a kept dim innermost)
keep one accumulator per point of the unit's column block, in stack arrays, and run the vector
loop inside the reduced loops. Long float32 sums add float32 partial sums per block and
float64 across blocks, so they stay exact over millions of elements.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.codegen.cpu_dialect import CPU, NP_DTYPE, POINTER, CpuValue, typed
from ember.codegen.cpu_iteration_space import Loop
from ember.codegen.kernel_source import node_source
from ember.codegen.kernel_writer import KernelWriter, Scope
from ember.codegen.lowering import accumulate, reduction_identity, reduction_kind, value_dtype

aten = torch.ops.aten

ACC_BLOCK = 4096  # long float32 row sums: elements per float32 block (64 per lane) before float64
COLUMN_ACC_BLOCK = 128  # float32 column sums: rows per float32 block before float64


def indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


class CpuReductions(KernelWriter):
    """Reduction code of the CPU writer; the iteration space, parameters, loads and stores are
    ``CpuWriter``'s (codegen/cpu_kernel.py)."""

    layout: str
    loops_r: list[Loop]
    persistent: bool
    unit: Scope  # the work unit's top level, where accumulators start and finish
    stack_arrays: list[str]
    count_line: str

    # -- one reduction -------------------------------------------------------------------------
    def _acc_dtype(self, node: fx.Node) -> tuple[torch.dtype, str]:
        """The accumulator's dtype and the reduction's kind."""
        dtype = value_dtype(node)  # bfloat16 accumulates in float32 (or float64)
        kind = reduction_kind(node)
        if kind == "sum" and dtype == torch.float32 and not self.persistent:
            # Long or column-wise float32 sums accumulate in float64; a persistent row (<= SCRATCH
            # values, summed in vector lanes) stays within float32 rounding of ATen in float32.
            return torch.float64, kind
        return dtype, kind

    def _identity(self, node: fx.Node) -> str:
        acc_dt, kind = self._acc_dtype(node)
        return typed(reduction_identity(kind, acc_dt), acc_dt)

    def _accumulate(self, node: fx.Node, acc: str, v: str) -> str:
        acc_dt, kind = self._acc_dtype(node)
        return accumulate(CPU, kind, acc, v, acc_dt)

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

    def _reduce_input(self, node: fx.Node, body: Scope, widen: bool = True) -> str:
        """The reduced value in the reduction's dtype, or (``widen``) in its accumulator's."""
        dtype = value_dtype(node)
        acc_dt, _ = self._acc_dtype(node)
        v = self._reduced_operand(node, body).as_(dtype)
        return v if (acc_dt == dtype or not widen) else f"{NP_DTYPE[acc_dt]}({v})"

    def _reduced_value(self, node: fx.Node, scope: Scope, home: Scope) -> CpuValue:
        var = self.unit.cache[("acc", node)]
        dtype = node.meta["val"].dtype
        if self.layout == "rows":
            return CpuValue(var, dtype)  # finished scalar, computed after its level's loop
        out = self._tmp()
        home.lines.append(f"{out} = {self._finish(node, f'{var}[xi - lo]')}  # {node_source(node)}")
        return CpuValue(out, dtype)

    # -- loops ---------------------------------------------------------------------------------
    def _nest(self, body: Scope, reduced: bool, vector: bool, blocked: tuple = ()) -> list[str]:
        """``body`` inside the reduced loops (outermost first) and/or the vector loop. ``blocked``
        = (block size, init lines, flush lines): the innermost reduced loop runs in blocks whose
        float32 partial sums are zeroed before and added to the float64 totals after each block."""
        lines = body.lines or ["pass"]
        if vector:
            lines = ["for xi in range(lo, hi):"] + indent(lines)
        loops = self.loops_r if reduced else []
        for i in range(len(loops) - 1, -1, -1):
            lp = loops[i]
            if blocked and i == len(loops) - 1:
                size, init, flush = blocked
                start = f"{lp.var}b"
                lines = (init + [f"for {lp.var} in range({start}, min({start} + {size}, {lp.size_param})):"]
                         + indent(lines) + flush)
                lines = [f"for {start} in range(0, {lp.size_param}, {size}):"] + indent(lines)
            else:
                lines = [f"for {lp.var} in range({lp.size_param}):"] + indent(lines)
        return lines

    def _level(self, reductions: list[fx.Node]) -> None:
        """One loop nest that accumulates ``reductions`` (one level) for the unit."""
        columns = self.layout == "columns"
        body = Scope(None if columns else self.unit)
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
                    body.lines.append(f"{acc}[xi - lo] = {self._accumulate(r, f'{acc}[xi - lo]', v)}"
                                      f"  # {node_source(r)}")
            else:
                self.unit.lines.append(f"{acc} = {self._identity(r)}")
                if block:
                    init.append(f"{blk} = np.float32(0.0)")
                    flush.append(f"{acc} = {acc} + np.float64({blk})")
                    body.lines.append(f"{blk} = {blk} + {v}  # {node_source(r)}")
                else:
                    body.lines.append(f"{acc} = {self._accumulate(r, acc, v)}  # {node_source(r)}")
            self.unit.cache[("acc", r)] = acc
        blocked = ((COLUMN_ACC_BLOCK if columns else ACC_BLOCK), init, flush) if init else ()
        self.unit.lines += self._nest(body, reduced=True, vector=columns, blocked=blocked)
        if not columns:
            for r in reductions:
                acc = self.unit.cache[("acc", r)]
                var = self._tmp()
                self.unit.lines.append(f"{var} = {self._finish(r, acc)}  # {node_source(r)}")
                self.unit.cache[("acc", r)] = var
