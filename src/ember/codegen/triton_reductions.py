"""The reductions of a Triton kernel: the half of ``TritonWriter`` (codegen/triton_kernel.py)
that writes them.

Persistent reductions reduce a whole ``[XBLOCK, RBLOCK]`` tile of values kept in registers with
one ``tl.reduce``. Looped ones run one loop over the reduced dims per reduction level, each
accumulating ``[XBLOCK, RBLOCK]`` partial results that one ``tl.reduce`` combines after the loop;
a last loop computes and stores the outputs that walk the reduced dims and read a reduction's result
(those that read none are stored by the first loop, which computes them anyway). Split reductions (see
codegen/triton_tiles.py) run a level's loop over one chunk per program and store the chunk's
result in a float32 workspace (``("part", level)`` kernels); a small kernel combines each x's
chunks into one result row (``("comb", level)``), which the later kernels load. The last level's
chunks are combined by the kernel that stores the outputs where that kernel runs one program per
x block (no output walks the reduced dims).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.codegen.kernel_source import node_source
from ember.codegen.kernel_writer import KernelWriter, Scope
from ember.codegen.lowering import accumulate, reduction_identity, reduction_kind, value_dtype
from ember.codegen.triton_dialect import TL_DTYPE, TRITON, TritonValue, literal
from ember.codegen.triton_tiles import Split
from ember.schedule.dim_map import reduction_dims

aten = torch.ops.aten


def combine_fn(kind: str, dtype: torch.dtype) -> str:
    """The combine function ``tl.reduce`` takes for a reduction of ``kind`` over ``dtype``."""
    # Float sums use Triton's own combine function: the interpreter recognises it and sums
    # with numpy (pairwise, exact to fp32 rounding) instead of a sequential element loop,
    # which is both slow and loses digits on large tiles; on the GPU it is the same a + b.
    return "tl.standard._sum_combine" if kind == "sum" and dtype.is_floating_point else f"_{kind}"


def reduce_rows(value: str, kind: str, dtype: torch.dtype, interpret: bool) -> str:
    """The expression reducing the rows of the ``[XBLOCK, N]`` tile ``value``, as a column.

    On the interpreter every reduction goes through Triton's own combine functions, which it runs
    as numpy reductions (max and min NaN-ignoring: ``_max_rows``/``_min_rows`` give NaN back to a
    row holding one, as torch does; integer sums wrap to the type as the GPU's do); ours
    (``_sum``/``_max``/``_min``) it runs element by element, which made a softmax over a BERT's
    scores take minutes. The GPU compiles ours: the same answer, one pass."""
    if interpret and kind in ("max", "min"):
        if dtype.is_floating_point:
            return f"_{kind}_rows({value})[:, None]"
        return f"tl.reduce({value}, 1, tl.standard._elementwise_{kind})[:, None]"
    if interpret and kind == "sum":
        return f"tl.reduce({value}, 1, tl.standard._sum_combine)[:, None]"
    return f"tl.reduce({value}, 1, {combine_fn(kind, dtype)})[:, None]"


class TritonReductions(KernelWriter):
    """Reduction code of the Triton writer; the iteration space, loads and stores are
    ``TritonWriter``'s (codegen/triton_kernel.py)."""

    interpret: bool
    persistent: bool
    rnumel: int
    xnumel: int
    split: Split
    phase: tuple[str, int] | None
    reduced_order: list[int]
    combines_last_level: bool
    loop_chunk: int  # reduced-dim rows per program (``rstart`` on): the split's chunk, or the storing kernel's
    early_stores: list[fx.Node]  # full-size outputs the first level's loop stores

    def _coord_lines(self, dims: list[int], index: str, numel: int) -> list[str]:
        raise NotImplementedError

    def _store(self, node: fx.Node, scope: Scope) -> None:
        raise NotImplementedError

    # -- one reduction -------------------------------------------------------------------------
    def _reduced_value(self, node: fx.Node, scope: Scope, home: Scope) -> TritonValue:
        if self.persistent:
            return self._reduce_persistent(node, scope)
        return home.cache[node]  # the loop of its level stored it there

    def _reduce_input(self, node: fx.Node, scope: Scope) -> tuple[str, torch.dtype]:
        out_dtype = value_dtype(node)
        return self._reduced_operand(node, scope).as_(out_dtype), out_dtype

    def _finish(self, node: fx.Node, reduced: str) -> str:
        if node.target == aten.mean.dim:
            src_shape = node.args[0].meta["val"].shape
            count = 1
            for d in reduction_dims(node):
                count *= src_shape[d]
            return f"({reduced} * {literal(1.0 / count)})"
        return reduced

    @staticmethod
    def _identity(node: fx.Node, dtype: torch.dtype) -> str:
        return literal(reduction_identity(reduction_kind(node), dtype))

    def _reduce_persistent(self, node: fx.Node, scope: Scope) -> TritonValue:
        inp, dtype = self._reduce_input(node, scope)
        var = self._tmp()
        masked = f"tl.where(xmask & rmask, {inp}, {self._identity(node, dtype)})"
        reduced = reduce_rows(masked, reduction_kind(node), dtype, self.interpret)
        scope.lines.append(f"{var} = {self._finish(node, reduced)}  # {node_source(node)}")
        return TritonValue(var, dtype)

    # -- the reduction part of the kernel body -------------------------------------------------
    def _reduction_body(self) -> list[str]:
        root = Scope()
        if self.persistent:
            root.lines.append("rindex = rbase")
            root.lines.append(f"rmask = rindex < {self.rnumel}")
            root.lines += self._coord_lines(self.reduced_order, "rindex", self.rnumel)
            for n in self.group.outputs:
                self._store(n, root)
            return root.lines
        levels = self.levels()
        for lv in levels:
            at_level = [r for r in self.reductions if self.level[r] == lv]
            early = self.early_stores if lv == levels[0] else []
            if self.split.split == 1:
                self._loop(root, at_level, early)
            elif self.phase == ("part", lv):
                self._loop(root, at_level, early, partial=True)
                return root.lines  # a partial kernel stops after its level
            elif self.phase == ("comb", lv):
                self._combine_partials(root, at_level)
                return root.lines
            elif self.combines_last_level and lv == self.levels()[-1]:
                self._combine_partials(root, at_level, into_cache=True)
            else:
                self._load_results(root, at_level)
        full_outputs = [n for n in self.group.outputs
                        if self._walks_reduced(self.group.dims[n]) and n not in self.early_stores]
        for n in self.group.outputs:
            if not self._walks_reduced(self.group.dims[n]):
                self._store(n, root)
        if full_outputs:
            self._loop(root, [], full_outputs)
        return root.lines

    def _ws_offset(self, r: fx.Node, chunk: str) -> str:
        j = self.reductions.index(r)
        return f"{j * self.split.split * self.xnumel} + {chunk} * {self.xnumel} + xindex"

    def _result_offset(self, r: fx.Node) -> str:
        j = self.reductions.index(r)
        return f"{len(self.reductions) * self.split.split * self.xnumel + j * self.xnumel} + xindex"

    def _load_results(self, root: Scope, reductions: list[fx.Node]) -> None:
        """Reductions of a split group, as the combining kernels stored them."""
        for r in reductions:
            var = self._tmp()
            root.lines.append(f"{var} = {self._finish(r, f'tl.load(ws + ({self._result_offset(r)}), xmask)')}"
                              f"  # {node_source(r)}")
            root.cache[r] = TritonValue(var, value_dtype(r))

    def _combine_partials(self, root: Scope, reductions: list[fx.Node], into_cache: bool = False) -> None:
        """Each reduction's result from the chunks' partials, stored once per x in the workspace
        (one small kernel, instead of every program of the next kernels combining them again), or,
        ``into_cache``, kept as the value the storing kernel's outputs read."""
        sblock = self.split.sblock
        for r in reductions:
            dtype = value_dtype(r)
            kind, ident = reduction_kind(r), self._identity(r, dtype)
            acc, part = self._tmp(), self._tmp()
            root.lines.append(f"{acc} = tl.full([XBLOCK, {sblock}], {ident}, {TL_DTYPE[dtype]})")
            root.lines.append(f"for s0 in range(0, {self.split.split}, {sblock}):")
            root.lines.append(f"    sidx = s0 + tl.arange(0, {sblock})[None, :]")
            root.lines.append(f"    {part} = tl.load(ws + ({self._ws_offset(r, 'sidx')}), xmask & (sidx < "
                              f"{self.split.split}), other={ident})")
            root.lines.append(f"    {acc} = {accumulate(TRITON, kind, acc, part, dtype)}")
            var = self._tmp()
            reduced = reduce_rows(acc, kind, dtype, self.interpret)
            if into_cache:
                root.lines.append(f"{var} = {self._finish(r, reduced)}  # {node_source(r)}")
                root.cache[r] = TritonValue(var, dtype)
                continue
            root.lines.append(f"{var} = {reduced}  # {node_source(r)}")
            root.lines.append(f"tl.store(ws + ({self._result_offset(r)}), {var}, xmask)")

    def _loop(self, root: Scope, reductions: list[fx.Node], stores: list[fx.Node] = (),
              partial: bool = False) -> None:
        """One loop over the reduced dims: accumulates ``reductions`` and stores ``stores``."""
        inner = Scope(root)
        inner.lines.append("rindex = roffset + rbase")
        inner.lines.append(f"rmask = rindex < {self.rnumel}")
        inner.lines += self._coord_lines(self.reduced_order, "rindex", self.rnumel)
        pre: list[str] = []
        accs = []
        for r in reductions:
            inp, dtype = self._reduce_input(r, inner)
            kind = reduction_kind(r)
            acc = self._tmp()
            ident = self._identity(r, dtype)
            pre.append(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {TL_DTYPE[dtype]})")
            masked = f"tl.where(xmask & rmask, {inp}, {ident})"
            if kind != "sum":
                masked_var = self._tmp()
                inner.lines.append(f"{masked_var} = {masked}")
                masked = masked_var
            inner.lines.append(f"{acc} = {accumulate(TRITON, kind, acc, masked, dtype)}")
            accs.append((r, acc, kind, dtype))
        for n in stores:
            self._store(n, inner)
        root.lines += pre
        if self.split.split > 1:  # this program's chunk of the reduced dims
            root.lines.append(f"for roffset in range(rstart, rstart + {self.loop_chunk}, RBLOCK):")
        else:
            root.lines.append(f"for roffset in range(0, {self.rnumel}, RBLOCK):")
        root.lines += ["    " + line for line in inner.lines]
        for r, acc, kind, dtype in accs:
            var = self._tmp()
            reduced = reduce_rows(acc, kind, dtype, self.interpret)
            if partial:  # the chunk's partial result, combined by the next kernels
                root.lines.append(f"{var} = {reduced}  # partial {node_source(r)}")
                root.lines.append(f"tl.store(ws + ({self._ws_offset(r, 'sid')}), {var}, xmask)")
                continue
            root.lines.append(f"{var} = {self._finish(r, reduced)}  # {node_source(r)}")
            root.cache[r] = TritonValue(var, dtype)
