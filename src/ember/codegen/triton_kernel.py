"""A FusedGroup -> the source of ONE Triton kernel.

Iteration space: the group's reference shape S, split into kept dims (walked by ``xindex``)
and reduced dims (walked by ``rindex``), each in memory order (codegen/triton_tiles.py).
Pointwise groups use 1-D tiles ``[XBLOCK]``; reduction groups use 2-D tiles
``[XBLOCK, RBLOCK]``. A value that walks no reduced dim lives in the *x domain*
(``[XBLOCK, 1]``), the others in the *full domain*.

Reductions are *persistent* when the reduced extent fits one block: every value is
computed once, in registers. Otherwise the kernel runs one loop over the reduced dims per
reduction level (a reduction whose input needs another reduction's result is one level up),
and a last loop computes and stores the full-domain outputs (codegen/triton_reductions.py).
Shapes and strides are baked in: the program checks the strides of tensors it did not allocate
itself. Pointwise ops are the shared lowerings of codegen/lowering.py in the Triton dialect.
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.fx as fx

from ember.codegen.kernel_source import (
    KernelSource,
    canonical_source,
    launch_kernels,
    node_source,
    op_summary,
)
from ember.codegen.kernel_writer import Scope
from ember.codegen.lowering import KernelValue, compute_dtype, value_dtype
from ember.codegen.triton_dialect import TL_DTYPE, TRITON, TritonValue, literal
from ember.codegen.triton_reductions import TritonReductions
from ember.codegen.triton_tiles import Split, next_pow2, order_dims, plan_split, transposed_dims
from ember.config import settings
from ember.schedule.dim_map import dim_strides, reduction_keepdim, walked_dims
from ember.schedule.plan import Dims, FusedGroup

aten = torch.ops.aten

# Helpers a kernel may call. A module holds only those its kernel names: Triton builds a
# JITFunction (reading its source back from the file) for every @triton.jit in the module each
# time a process loads it, which for five unused helpers was most of a warm first call's load.
# Reductions go through the builtin tl.reduce with _sum/_max/_min (max/min propagate NaN as torch
# does); float sums use tl.standard._sum_combine (triton_reductions.combine_fn).
_HELPERS_GPU = {
    "_round_to_bf16": """@triton.jit
def _round_to_bf16(x):
    return x.to(tl.bfloat16).to(tl.float32)
""",
    "_round_to_fp16": """@triton.jit
def _round_to_fp16(x):
    return x.to(tl.float16).to(tl.float32)
""",
    "_sum": """@triton.jit
def _sum(a, b):
    return a + b
""",
    "_max": """@triton.jit
def _max(a, b):
    return tl.where((a > b) | (a != a), a, b)
""",
    "_min": """@triton.jit
def _min(a, b):
    return tl.where((a < b) | (a != a), a, b)
""",
}
# Triton's interpreter truncates float32 -> bfloat16; round to nearest even by hand so the
# interpreter computes exactly what the GPU computes. Float max and min reductions go through
# Triton's combine functions there (numpy's speed), NaN put back (triton_reductions.reduce_rows).
_HELPERS_INTERPRET = {**_HELPERS_GPU, "_round_to_bf16": """@triton.jit
def _round_to_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)
""", "_max_rows": """@triton.jit
def _max_rows(x):
    nans = tl.reduce((x != x).to(tl.float32), 1, tl.standard._sum_combine)
    return tl.where(nans > 0, tl.reduce(x, 1, tl.standard._sum_combine), tl.reduce(x, 1, tl.standard._elementwise_max))
""", "_min_rows": """@triton.jit
def _min_rows(x):
    nans = tl.reduce((x != x).to(tl.float32), 1, tl.standard._sum_combine)
    return tl.where(nans > 0, tl.reduce(x, 1, tl.standard._sum_combine), tl.reduce(x, 1, tl.standard._elementwise_min))
"""}
_IMPORTS = "import triton\nimport triton.language as tl\n"


def module_header(body: str, interpret: bool) -> str:
    """The imports and the helpers ``body`` calls, in a fixed order."""
    helpers = _HELPERS_INTERPRET if interpret else _HELPERS_GPU
    used = [src for name, src in helpers.items() if re.search(rf"\b{name}\b", body)]
    return "\n\n".join([_IMPORTS, *used]).rstrip("\n") + "\n"


class TritonWriter(TritonReductions):
    """One fused group -> one Triton kernel (or, for a split reduction's ``phase``, one of the
    kernels that write and combine its partial results)."""

    dialect = TRITON
    value_type = TritonValue

    def __init__(self, group: FusedGroup, interpret: bool, phase: tuple[str, int] | None = None,
                 config: dict[str, int] | None = None) -> None:
        super().__init__(group)
        self.interpret = interpret
        self.blocks = settings()  # the block-size settings
        # Tuned overrides of the block-size rules (ember/tune/space.py): XBLOCK, RBLOCK (looped
        # reductions only), SPLIT_PROGRAMS, STORE_TILES, num_warps, num_stages. Empty: the rules below.
        self.config = dict(config or {})
        shape = self.shape
        # A pointwise group that reads a transposed input walks that input's stride-1 dim as the
        # second axis of a 2-D tile (codegen/triton_tiles.transposed_dims): no reduction runs over it.
        self.tile_dims = transposed_dims(group) if not group.rdims and self.blocks.transpose_tile > 0 else []
        if self.tile_dims:
            self.reduced_dims = set(self.tile_dims)
        reduced = self.reduced_dims
        # Walked in the memory order of the group's largest tensor (codegen/triton_tiles.py).
        tiling = order_dims(group, [d for d in range(len(shape)) if d not in reduced and shape[d] != 1],
                            [d for d in sorted(reduced) if shape[d] != 1])
        self.kept_order, self.reduced_order, self.x_contiguous = tiling.kept, tiling.reduced, tiling.x_contiguous
        self.xnumel = 1
        for d in self.kept_order:
            self.xnumel *= shape[d]
        self.rnumel = 1
        for d in self.reduced_order:
            self.rnumel *= shape[d]
        self.is_reduction = bool(self.reduced_order)
        rblock = next_pow2(self.rnumel)
        # A channel-contiguous tile needs many channels per row: persistent only for short rows.
        self.persistent = (not self.is_reduction) or (rblock <= self.blocks.persistent_rblock_max and not (
            self.x_contiguous and not interpret and rblock > self.blocks.xcontig_persistent_rmax))
        self.split = Split(1, self.rnumel, 1)
        if self.tile_dims:
            self.persistent = False  # (the block rule reads it) then: one block holds the row
            self.xblock, self.rblock = self._blocks()
            self.persistent = self.rnumel <= self.rblock
            if not self.persistent:  # one tile per program (a 2-D grid), not a loop along the row
                self.split = Split(-(-self.rnumel // self.rblock), self.rblock, 1)
        elif self.is_reduction:
            self.xblock, self.rblock = self._blocks()
            # The workspace holds float32 partials: float32 reductions only.
            if not self.persistent and all(value_dtype(r) == torch.float32 for r in self.reductions):
                target = (self.blocks.interpret_split_target_programs if interpret
                          else self.blocks.split_target_programs)
                target = self.config.get("SPLIT_PROGRAMS", target)
                self.split = plan_split(self.xnumel, self.rnumel, self.xblock, self.rblock, target)
        # None: the kernel that stores the outputs; ("part", L): level-L partials of each chunk;
        # ("comb", L): level-L results from the partials, once per x (the workspace's result rows).
        self.phase = phase
        # Full-size outputs that no reduction of the group feeds are stored by the first reduction
        # loop, which computes them anyway (a Linear's input gradient beside its bias gradient):
        # a last loop would compute them again and a split reduction's storing kernel read the
        # inputs a second time.
        self.early_stores = [n for n in group.outputs if self.blocks.store_before_reductions and self.reductions
                             and not self.persistent and self.level[n] == 0
                             and self._walks_reduced(group.dims[n])]
        final_loops = any(self._walks_reduced(group.dims[n]) for n in group.outputs if n not in self.early_stores)
        # Programs per x block: every chunk for partials and full-domain stores, else one.
        self.grid_split = self.split.split if ((phase is not None and phase[0] == "part") or final_loops) else 1
        # Without full-domain stores the storing kernel runs one program per x block, so it combines
        # the last level's partials itself: one kernel launch fewer than a combining kernel would
        # take (a bias or LayerNorm weight gradient is one such group).
        self.combines_last_level = self.split.split > 1 and not final_loops
        # The storing kernel of a split reduction with full-size outputs loads the combined results,
        # so nothing ties its programs to the reduction's chunks: ``split_store_tiles`` tiles each
        # (closer to a pointwise kernel's parallelism; a 3,072-row chunk per program looped 48 times
        # and ran at about 70% of Inductor's pointwise kernels for batch norm's normalise and input
        # gradient).
        self.loop_chunk = self.split.chunk
        tiles = self.config.get("STORE_TILES", self.blocks.split_store_tiles)
        if phase is None and final_loops and self.split.split > 1 and tiles > 0:
            self.loop_chunk = min(self.split.chunk, tiles * self.rblock)
            self.grid_split = -(-self.rnumel // self.loop_chunk)
        if phase is not None and phase[0] == "comb":
            self.grid_split = 1
            sblock = min(next_pow2(self.split.split), 4096)
            self.split = Split(self.split.split, self.split.chunk, sblock)
            self.xblock = max(1, min(next_pow2(self.xnumel), 4096 // sblock))

    # -- index expressions ---------------------------------------------------------------------
    def _coord(self, s: int) -> str:
        return f"{'r' if s in self.reduced_dims else 'x'}_{s}"

    def _coord_lines(self, dims: list[int], index: str, numel: int) -> list[str]:
        lines = []
        inner = 1
        for pos in range(len(dims) - 1, -1, -1):
            s = dims[pos]
            size = self.shape[s]
            expr = index if inner == 1 else f"({index} // {inner})"
            if inner * size < numel:
                expr = f"{expr} % {size}"
            lines.append(f"{self._coord(s)} = {expr}")
            inner *= size
        return lines[::-1]

    def _offset(self, node: fx.Node, dims: Dims) -> str:
        stride_of: dict[int, int] = {}
        for s, stride in dim_strides(dims, node.meta["val"].stride(), self.shape):
            if self.shape[s] != 1:
                # A group dim walked twice (a diagonal) steps by both strides at once.
                stride_of[s] = stride_of.get(s, 0) + stride
        kept = self._merged_terms(self.kept_order, "xindex", self.xnumel, stride_of)
        reduced = self._merged_terms(self.reduced_order, "rindex", self.rnumel, stride_of)
        return " + ".join(kept + reduced + ([] if kept else ["0 * xindex"]))  # keeps every load block-shaped

    def _merged_terms(self, order: list[int], index: str, numel: int, stride_of: dict[int, int]) -> list[str]:
        """Address terms of the dims in ``order`` (walked by ``index``): neighbouring dims that
        are contiguous in this tensor (outer stride = inner stride x inner size) form one term
        of ``index`` itself, so a channels_last activation walked over N, H, W costs one multiply
        instead of three divisions (integer division dominates a memory-bound kernel's issue
        slots). A run of one dim keeps its coordinate variable."""
        terms: list[str] = []
        inner = 1  # elements of ``order`` inside the current position
        pos = len(order) - 1
        while pos >= 0:
            s = order[pos]
            if s not in stride_of:
                inner *= self.shape[s]
                pos -= 1
                continue
            stride, run, size = stride_of[s], [s], self.shape[s]
            while pos - len(run) >= 0:
                outer = order[pos - len(run)]
                if outer not in stride_of or stride_of[outer] != stride_of[run[-1]] * self.shape[run[-1]]:
                    break
                run.append(outer)
                size *= self.shape[outer]
            if len(run) == 1:
                expr = self._coord(s)
            else:
                expr = index if inner == 1 else f"({index} // {inner})"
                if inner * size < numel:
                    expr = f"({expr} % {size})"
            terms.append(expr if stride == 1 else f"{expr} * {stride}")  # stride 0 too: keeps the block shape
            inner *= size
            pos -= len(run)
        return terms

    def _mask(self, full: bool) -> str:
        return "xmask & rmask" if full else "xmask"

    def _block_shape(self, full: bool) -> str:
        if not self.is_reduction:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if full else "[XBLOCK, 1]"

    # -- values (kernel_writer.KernelWriter) ---------------------------------------------------
    def _home(self, dims: Dims, scope: Scope) -> Scope:
        return scope if (self._walks_reduced(dims) or self.persistent) else scope.x_scope

    def _load(self, node: fx.Node, dims: Dims, scope: Scope, home: Scope) -> TritonValue:
        key = ("load", node, dims)
        if key in home.cache:
            return home.cache[key]
        dtype = node.meta["val"].dtype
        var = self._tmp()
        expr = (f"tl.load({self.tensor_names[node]} + ({self._offset(node, dims)}), "
                f"{self._mask(self._walks_reduced(dims))}, other=0)")
        if compute_dtype(dtype) != dtype:
            expr += ".to(tl.float32)"
        home.lines.append(f"{var} = {expr}")
        home.cache[key] = TritonValue(var, dtype)
        return home.cache[key]

    def _coord_expr(self, s: int | None) -> str:
        return "0" if s is None or self.shape[s] == 1 else self._coord(s)

    def _load_at(self, node: fx.Node, coords: list[str], cond: str, home: Scope) -> TritonValue:
        """A range select's piece reading ``node`` at shifted coordinates (pointwise groups only:
        the planner keeps selects out of reductions), masked to the piece's range."""
        key = ("load_at", node, tuple(coords), cond)
        if key in home.cache:
            return home.cache[key]
        val = node.meta["val"]
        terms = [c if st == 1 else f"{c} * {st}" for c, st, size in zip(coords, val.stride(), val.shape)
                 if size != 1 and st != 0 and c != "0"]
        if not any("x_" in t for t in terms):
            terms.append("0 * xindex")  # keeps every load block-shaped
        mask = "xmask" + (f" & {cond}" if cond else "")
        var = self._tmp()
        expr = f"tl.load({self.tensor_names[node]} + ({' + '.join(terms)}), {mask}, other=0)"
        if compute_dtype(val.dtype) != val.dtype:
            expr += ".to(tl.float32)"
        home.lines.append(f"{var} = {expr}")
        home.cache[key] = TritonValue(var, val.dtype)
        return home.cache[key]

    def _scalar(self, value: object, key: tuple) -> TritonValue:
        return TritonValue(literal(value), None)

    def _operands(self, node: fx.Node, scope: Scope, home: Scope) -> list[KernelValue]:
        ops = super()._operands(node, scope, home)
        if ops and all(o.dtype is None for o in ops if o.expr != "None"):
            # Only literals (a fill, a scalar): the first becomes a block so the result is one.
            first = next(i for i, o in enumerate(ops) if o.expr != "None")
            dt = value_dtype(node)
            shape = self._block_shape(self._walks_reduced(self.group.dims[node]))
            ops[first] = TritonValue(f"tl.full({shape}, {ops[first].as_(dt)}, {TL_DTYPE[dt]})", dt)
        return ops

    # -- stores --------------------------------------------------------------------------------
    def _store(self, node: fx.Node, scope: Scope) -> None:
        dims = self.group.dims[node]
        full = self._walks_reduced(dims)
        op = self.value(node, scope)
        dtype = node.meta["val"].dtype
        covered = walked_dims(dims)
        walked = self.kept_order + (self.reduced_order if full else [])
        mask = self._mask(full)
        for s in walked:
            if s not in covered:
                mask += f" & ({self._coord(s)} == 0)"  # broadcast dims: store once
        if not full and self.grid_split > 1:
            mask += " & (sid == 0)"  # a split kernel's x-domain values: one chunk stores them
        val = op.as_(compute_dtype(dtype))
        if op.dtype is None:
            val = f"tl.full({self._block_shape(full)}, {val}, {TL_DTYPE[compute_dtype(dtype)]})"
        if dtype == torch.bfloat16:
            val = f"_round_to_bf16({val}).to(tl.bfloat16)"
        elif dtype != compute_dtype(dtype):
            val = f"({val}).to({TL_DTYPE[dtype]})"
        self._home(dims, scope).lines.append(
            f"tl.store({self.tensor_names[node]} + ({self._offset(node, dims)}), {val}, {mask})")

    # -- the kernel ----------------------------------------------------------------------------
    def write(self) -> KernelSource:
        body: list[str] = []
        if self.is_reduction:
            if self.grid_split > 1:
                body.append("pid = tl.program_id(0)")
                body.append(f"sid = pid % {self.grid_split}")
                body.append(f"xindex = (pid // {self.grid_split}) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
                body.append(f"rstart = sid * {self.loop_chunk}")
            else:
                body.append("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
            body.append(f"xmask = xindex < {self.xnumel}")
            body += self._coord_lines(self.kept_order, "xindex", self.xnumel)
            body.append("rbase = tl.arange(0, RBLOCK)[None, :]")
            body += self._reduction_body()
            meta = {"XBLOCK": self.xblock, "RBLOCK": self.rblock}
        else:
            blocks = self.blocks
            xblock = min(next_pow2(self.xnumel), self.config.get(
                "XBLOCK", blocks.pointwise_xblock if not self.interpret else blocks.interpret_tile_elements))
            body.append("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)")
            body.append(f"xmask = xindex < {self.xnumel}")
            body += self._coord_lines(self.kept_order, "xindex", self.xnumel)
            scope = Scope()
            for n in self.group.outputs:
                self._store(n, scope)
            body += scope.lines
            meta = {"XBLOCK": xblock}
        return self._assemble(body, meta)

    def _assemble(self, body: list[str], meta: dict[str, int]) -> KernelSource:
        """The kernel's source, name and launch data around its ``body`` lines."""
        tiles = meta["XBLOCK"] * meta.get("RBLOCK", 1)
        meta["num_warps"] = 8 if tiles >= 4096 else 4 if tiles >= 512 else 2 if tiles >= 128 else 1
        if self.tile_dims and self.blocks.transpose_warps:
            meta["num_warps"] = self.blocks.transpose_warps
        for knob in ("num_warps", "num_stages"):
            if knob in self.config:
                meta[knob] = self.config[knob]
        grid = -(-self.xnumel // meta["XBLOCK"]) * (self.grid_split if self.is_reduction else 1)
        args = list(self.group.inputs) + list(self.group.outputs)
        params = ", ".join(self.tensor_names[a] for a in args) + (", ws" if self.split.split > 1 and self.reductions
                                                                   else "")
        consts = "XBLOCK: tl.constexpr" + (", RBLOCK: tl.constexpr" if self.is_reduction else "")
        ops = "\n".join(f"#   {node_source(n)}" for n in self.group.nodes)
        split = "" if self.split.split == 1 else (
            f" split={self.split.split}x{self.split.chunk} "
            + (f"stores outputs, {self.loop_chunk} rows per program" if self.phase is None
               else f"{self.phase[0]} of level {self.phase[1]}"))
        text = (f"@triton.jit\ndef KERNEL_NAME({params}, {consts}):\n"
                f"    # S={list(self.shape)} "
                + (f"pointwise, r walks dims {self.tile_dims} (a transposed tensor's stride-1 run)"
                   if self.tile_dims else f"reduced={sorted(self.reduced_dims)}")
                + f" x={self.xnumel} r={self.rnumel}{split}\n"
                f"    # x order {self.kept_order} r order {self.reduced_order}"
                f"{' channel-contiguous' if self.x_contiguous and not self.tile_dims else ''}\n"
                + "\n".join("    " + line for line in body) + "\n")
        # Node names differ between graphs (and between blocks of one model); the kernel's identity
        # must not, so hash and compile the text with each line's node annotation reduced to its op.
        canonical = canonical_source(text)
        # The name says what the kernel computes (its source ops); they are hashed too, so one
        # digest never goes with two names.
        summary = op_summary(self.group.nodes)
        digest = hashlib.sha256((canonical + repr(meta) + str(self.interpret) + summary).encode()).hexdigest()[:16]
        kind = ("pw" if not self.is_reduction else "tpw" if self.tile_dims
                else "red" if self.phase is None else f"{self.phase[0]}{self.phase[1]}")
        name = f"ember_{kind}_{summary}_{digest}" if summary else f"ember_{kind}_{digest}"
        source = f"# source ops:\n{ops}\n" + text.replace("KERNEL_NAME", name)
        header = module_header(canonical, self.interpret)
        return KernelSource(name, source, digest, args, len(self.group.inputs), grid, meta, header,
                            canonical.replace("KERNEL_NAME", name))

    def _blocks(self) -> tuple[int, int]:
        xblock, rblock = self._rule_blocks()
        if "XBLOCK" in self.config:
            xblock = max(1, min(next_pow2(self.xnumel), self.config["XBLOCK"]))
        if "RBLOCK" in self.config and not self.persistent:  # persistent: one block holds the row
            rblock = self.config["RBLOCK"]
        return xblock, rblock

    def _rule_blocks(self) -> tuple[int, int]:
        xmax = next_pow2(self.xnumel)
        blocks = self.blocks
        if self.tile_dims:  # a square-ish tile: both sides of the transpose coalesce
            side = 1024 if self.interpret else blocks.transpose_tile  # the interpreter pays per program
            rblock = min(next_pow2(self.rnumel), side)
            elements = blocks.interpret_tile_elements if self.interpret else side * side
            return max(1, min(xmax, elements // rblock)), rblock
        if self.interpret:
            rblock = next_pow2(self.rnumel) if self.persistent else blocks.loop_rblock
            return max(1, min(xmax, blocks.interpret_tile_elements // rblock)), rblock
        if self.persistent:
            rblock = next_pow2(self.rnumel)
            xblock = blocks.tile_elements // rblock
            if self.x_contiguous:
                xblock = max(xblock, 32)  # 32 consecutive channels per row: coalesced
            return max(1, min(xmax, xblock)), rblock
        if self.x_contiguous:
            xblock = min(xmax, blocks.xcontig_xblock)
            return xblock, max(1, blocks.xcontig_tile // xblock)
        return 1, blocks.loop_rblock


def generate_triton(group: FusedGroup, interpret: bool = False, config: dict[str, int] | None = None) -> KernelSource:
    """The Triton kernel for ``group`` (with its partial-result kernels when the reduction is split);
    ``config`` overrides the block-size rules (a tuned configuration)."""
    writer = TritonWriter(group, interpret, config=config)
    ks = writer.write()
    if writer.split.split > 1 and writer.reductions:
        # Partials of every chunk, then one result row per reduction.
        ks.workspace = len(writer.reductions) * (writer.split.split + 1) * writer.xnumel
        last = writer.levels()[-1]
        ks.pre = [TritonWriter(group, interpret, phase=(step, lv), config=config).write()
                  for lv in writer.levels() for step in ("part", "comb")
                  if not (step == "comb" and lv == last and writer.combines_last_level)]
        for k in ks.pre:
            k.workspace = ks.workspace
    return ks


__all__ = ["generate_triton", "KernelSource", "launch_kernels", "reduction_keepdim"]
