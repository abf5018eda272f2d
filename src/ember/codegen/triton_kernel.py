"""A FusedGroup -> the source of ONE Triton kernel.

Iteration space: the group's reference shape S, split into kept dims K (walked by
``xindex``) and reduced dims D (walked by ``rindex``). Pointwise groups use 1-D tiles
``[XBLOCK]``; reduction groups use 2-D tiles ``[XBLOCK, RBLOCK]``. A value that walks
no D dim lives in the *x domain* (``[XBLOCK, 1]``), the others in the *full domain*.

Reductions are *persistent* when the reduced extent fits one block: every value is
computed once, in registers. Otherwise the kernel runs one loop over D per reduction
level (a reduction whose input needs another reduction's result is one level up), and a
last loop computes and stores the full-domain outputs. Shapes and strides are baked in:
the program checks the strides of tensors it did not allocate itself.
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from ember.codegen.kernel_source import KernelSource, canonical_source, launch_kernels, node_source
from ember.codegen.triton_ops import POINTWISE_OPS, TL_DTYPE, Operand, compute_dtype, literal
from ember.codegen.triton_tiles import Split, next_pow2, order_dims, plan_split
from ember.config import settings
from ember.schedule.plan import FusedGroup, reduction_dims, reduction_keepdim
from ember.schedule.rules import OpClass, classify, constant_value

aten = torch.ops.aten

# Block-size rules: the settings persistent_rblock_max ... interpret_split_target_programs
# (ember/config.py); tests lower them with config.patch to exercise the looped path on small shapes.
_BLOCK_SETTINGS = ("persistent_rblock_max", "loop_rblock", "tile_elements", "pointwise_xblock",
                   "interpret_tile_elements", "xcontig_xblock", "xcontig_tile", "xcontig_persistent_rmax",
                   "split_target_programs", "interpret_split_target_programs")


def tuning() -> tuple:
    """Every block-size setting (part of the compiled-program cache key: tests change them)."""
    now = settings()
    return tuple(getattr(now, name) for name in _BLOCK_SETTINGS)

# Reductions go through the builtin tl.reduce with these combine functions (max/min propagate
# NaN as torch does); float sums use tl.standard._sum_combine (see _KernelWriter._combine).
_COMBINE = '''

@triton.jit
def _sum(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min(a, b):
    return tl.where((a < b) | (a != a), a, b)
'''

HEADER_GPU = '''import triton
import triton.language as tl


@triton.jit
def _round_to_bf16(x):
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _round_to_fp16(x):
    return x.to(tl.float16).to(tl.float32)
''' + _COMBINE

# Triton's interpreter truncates float32 -> bfloat16; round to nearest even by hand so the
# interpreter computes exactly what the GPU computes.
HEADER_INTERPRET = '''import triton
import triton.language as tl


@triton.jit
def _round_to_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _round_to_fp16(x):
    return x.to(tl.float16).to(tl.float32)
''' + _COMBINE


_IDENTITY = {"sum": "0", "max": 'float("-inf")', "min": 'float("inf")'}
_INT_IDENTITY = {"sum": "0", "max": "-9223372036854775808", "min": "9223372036854775807"}


def _reduction_kind(node: fx.Node) -> str:
    return {aten.amax.default: "max", aten.amin.default: "min"}.get(node.target, "sum")


class _KernelWriter:
    def __init__(self, group: FusedGroup, interpret: bool, phase: tuple[str, int] | None = None) -> None:
        self.g = group
        self.interpret = interpret
        self.blocks = settings()  # the block-size settings
        self.S = group.shape
        self.D = set(group.rdims)
        # Walked in the memory order of the group's largest tensor (codegen/triton_tiles.py).
        tiling = order_dims(group, [d for d in range(len(self.S)) if d not in self.D and self.S[d] != 1],
                            [d for d in sorted(self.D) if self.S[d] != 1])
        self.K, self.R, self.x_contiguous = tiling.K, tiling.R, tiling.x_contiguous
        self.xnumel = 1
        for d in self.K:
            self.xnumel *= self.S[d]
        self.rnumel = 1
        for d in self.R:
            self.rnumel *= self.S[d]
        self.reduction = bool(self.R)
        self.arg_names: dict[fx.Node, str] = {}
        for i, n in enumerate(group.inputs):
            self.arg_names[n] = f"in{i}"
        for i, n in enumerate(group.outputs):
            self.arg_names[n] = f"out{i}"
        self.counter = 0
        rblock = next_pow2(self.rnumel)
        # A channel-contiguous tile needs many channels per row: persistent only for short rows.
        self.persistent = (not self.reduction) or (rblock <= self.blocks.persistent_rblock_max and not (
            self.x_contiguous and not interpret and rblock > self.blocks.xcontig_persistent_rmax))
        self.level = self._levels()
        self.reductions = [n for n in group.nodes if classify(n).cls == OpClass.REDUCTION]
        self.split = Split(1, self.rnumel, 1)
        if self.reduction:
            self.xblock, self.rblock = self._blocks()
            # The workspace holds float32 partials: float32 reductions only.
            if not self.persistent and all(compute_dtype(r.meta["val"].dtype) == torch.float32
                                           for r in self.reductions):
                blocks = self.blocks
                target = blocks.interpret_split_target_programs if interpret else blocks.split_target_programs
                self.split = plan_split(self.xnumel, self.rnumel, self.xblock, self.rblock, target)
        # None: the kernel that stores the outputs; ("part", L): level-L partials of each chunk;
        # ("comb", L): level-L results from the partials, once per x (the workspace's result rows).
        self.phase = phase
        final_loops = any(self._full(self.g.dims[n]) for n in self.g.outputs)
        # Programs per x block: every chunk for partials and full-domain stores, else one.
        self.grid_split = self.split.split if ((phase is not None and phase[0] == "part") or final_loops) else 1
        if phase is not None and phase[0] == "comb":
            self.grid_split = 1
            sblock = min(next_pow2(self.split.split), 4096)
            self.split = Split(self.split.split, self.split.chunk, sblock)
            self.xblock = max(1, min(next_pow2(self.xnumel), 4096 // sblock))

    # -- domains and levels --------------------------------------------------------------
    def _full(self, dims: tuple) -> bool:
        return any(d in self.D for d in dims if d is not None)

    def _levels(self) -> dict[fx.Node, int]:
        level: dict[fx.Node, int] = {}
        members = set(self.g.nodes)
        for n in self.g.nodes:
            deps = [level[a] for a in n.all_input_nodes if a in members]
            base = max(deps, default=0)
            level[n] = base + 1 if classify(n).cls == OpClass.REDUCTION else base
        return level

    # -- index expressions ---------------------------------------------------------------
    def _coord(self, s: int) -> str:
        return f"{'r' if s in self.D else 'x'}_{s}"

    def _coord_lines(self, dims: list[int], index: str, numel: int) -> list[str]:
        lines = []
        inner = 1
        for pos in range(len(dims) - 1, -1, -1):
            s = dims[pos]
            size = self.S[s]
            expr = index if inner == 1 else f"({index} // {inner})"
            if inner * size < numel:
                expr = f"{expr} % {size}"
            lines.append(f"{self._coord(s)} = {expr}")
            inner *= size
        return lines[::-1]

    def _offset(self, node: fx.Node, dims: tuple) -> str:
        strides = node.meta["val"].stride()
        terms = []
        for j, s in enumerate(dims):
            if s is None or self.S[s] == 1:
                continue
            st = strides[j]
            terms.append(self._coord(s) if st == 1 else f"{self._coord(s)} * {st}")
        full = self._full(dims)
        if not any(t.startswith("x_") for t in terms):
            terms.append("0 * xindex")  # keeps every load block-shaped
        if self.reduction and full is False:
            return " + ".join(terms)
        return " + ".join(terms)

    def _mask(self, full: bool) -> str:
        return "xmask & rmask" if full else "xmask"

    def _shape(self, full: bool) -> str:
        if not self.reduction:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if full else "[XBLOCK, 1]"

    # -- values --------------------------------------------------------------------------
    def _tmp(self) -> str:
        self.counter += 1
        return f"t{self.counter}"

    def _load(self, node: fx.Node, dims: tuple, out: list[str], cache: dict) -> Operand:
        key = ("load", node, dims)
        if key in cache:
            return cache[key]
        full = self._full(dims)
        dtype = node.meta["val"].dtype
        var = self._tmp()
        expr = f"tl.load({self.arg_names[node]} + ({self._offset(node, dims)}), {self._mask(full)}, other=0)"
        if compute_dtype(dtype) != dtype:
            expr += ".to(tl.float32)"
        out.append(f"{var} = {expr}")
        cache[key] = Operand(var, compute_dtype(dtype))
        return cache[key]

    def _constant(self, node: fx.Node) -> Operand:
        return Operand(literal(constant_value(node)), None)

    def value(self, node: fx.Node, scope: _Scope) -> Operand:
        dims = self.g.dims[node]
        full = self._full(dims)
        target_scope = scope if (full or self.persistent) else scope.outer
        cache, out = target_scope.cache, target_scope.lines
        if node in cache:
            return cache[node]
        cls = classify(node).cls
        if cls == OpClass.VIEW:
            result = self.value(node.args[0], scope)
        elif cls == OpClass.REDUCTION:
            result = self._reduce_persistent(node, scope) if self.persistent else scope.outer.cache[node]
        else:
            ops = []
            for a in node.args:
                if isinstance(a, fx.Node):
                    if a in self.g.dims:
                        ops.append(self.value(a, scope))
                    elif a in self.g.input_dims[node]:
                        ops.append(self._load(a, self.g.input_dims[node][a], out, cache))
                    else:
                        ops.append(self._constant(a))
                elif a is None:
                    ops.append(Operand("None", None))
                elif isinstance(a, (bool, int, float)):
                    ops.append(Operand(literal(a), None))
                else:
                    ops.append(Operand(repr(a), None))
            if ops and all(o.dtype is None for o in ops if o.expr != "None"):
                first = next(i for i, o in enumerate(ops) if o.expr != "None")
                dt = compute_dtype(node.meta["val"].dtype)
                ops[first] = Operand(f"tl.full({self._shape(full)}, {ops[first].as_(dt)}, {TL_DTYPE[dt]})", dt)
            expr = POINTWISE_OPS[node.target](node, ops)
            var = self._tmp()
            out.append(f"{var} = {expr}  # {node_source(node)}")
            result = Operand(var, compute_dtype(node.meta["val"].dtype))
        cache[node] = result
        return result

    def _reduce_input(self, node: fx.Node, scope: _Scope) -> tuple[str, torch.dtype]:
        src = node.args[0]
        out_dtype = compute_dtype(node.meta["val"].dtype)
        if src in self.g.dims:
            op = self.value(src, scope)
        else:
            op = self._load(src, self.g.input_dims[node][src], scope.lines, scope.cache)
        return op.as_(out_dtype), out_dtype

    def _finish(self, node: fx.Node, reduced: str) -> str:
        if node.target == aten.mean.dim:
            src_shape = node.args[0].meta["val"].shape
            count = 1
            for d in reduction_dims(node):
                count *= src_shape[d]
            return f"({reduced} * {literal(1.0 / count)})"
        return reduced

    def _identity(self, node: fx.Node, dtype: torch.dtype) -> str:
        kind = _reduction_kind(node)
        if dtype.is_floating_point:
            return _IDENTITY[kind]
        if kind == "sum" or dtype not in (torch.int32, torch.int16, torch.int8, torch.uint8):
            return _INT_IDENTITY[kind]
        info = torch.iinfo(dtype)  # narrower integers: the identity must fit the type
        return str(info.min if kind == "max" else info.max)

    @staticmethod
    def _combine(kind: str, dtype: torch.dtype) -> str:
        # Float sums use Triton's own combine function: the interpreter recognises it and sums
        # with numpy (pairwise, exact to fp32 rounding) instead of a sequential element loop,
        # which is both slow and loses digits on large tiles; on the GPU it is the same a + b.
        return "tl.standard._sum_combine" if kind == "sum" and dtype.is_floating_point else f"_{kind}"

    def _reduce_persistent(self, node: fx.Node, scope: _Scope) -> Operand:
        inp, dtype = self._reduce_input(node, scope)
        kind = _reduction_kind(node)
        var = self._tmp()
        masked = f"tl.where(xmask & rmask, {inp}, {self._identity(node, dtype)})"
        scope.lines.append(f"{var} = {self._finish(node, f'tl.reduce({masked}, 1, {self._combine(kind, dtype)})[:, None]')}  # {node_source(node)}")
        return Operand(var, dtype)

    # -- stores ----------------------------------------------------------------------------
    def _store(self, node: fx.Node, scope: _Scope) -> None:
        dims = self.g.dims[node]
        full = self._full(dims)
        op = self.value(node, scope)
        dtype = node.meta["val"].dtype
        covered = {d for d in dims if d is not None}
        walked = self.K + (self.R if full else [])
        mask = self._mask(full)
        for s in walked:
            if s not in covered:
                mask += f" & ({self._coord(s)} == 0)"  # broadcast dims: store once
        if not full and self.grid_split > 1:
            mask += " & (sid == 0)"  # a split kernel's x-domain values: one chunk stores them
        val = op.as_(compute_dtype(dtype))
        if op.dtype is None:
            val = f"tl.full({self._shape(full)}, {val}, {TL_DTYPE[compute_dtype(dtype)]})"
        if dtype == torch.bfloat16:
            val = f"_round_to_bf16({val}).to(tl.bfloat16)"
        elif dtype != compute_dtype(dtype):
            val = f"({val}).to({TL_DTYPE[dtype]})"
        target = scope if (full or self.persistent) else scope.outer
        target.lines.append(f"tl.store({self.arg_names[node]} + ({self._offset(node, dims)}), {val}, {mask})")

    # -- the kernel ------------------------------------------------------------------------
    def write(self) -> KernelSource:
        body: list[str] = []
        if self.reduction:
            xblock, rblock = self.xblock, self.rblock
            if self.grid_split > 1:
                body.append("pid = tl.program_id(0)")
                body.append(f"sid = pid % {self.grid_split}")
                body.append(f"xindex = (pid // {self.grid_split}) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
                body.append(f"rstart = sid * {self.split.chunk}")
            else:
                body.append("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
            body.append(f"xmask = xindex < {self.xnumel}")
            body += self._coord_lines(self.K, "xindex", self.xnumel)
            body.append("rbase = tl.arange(0, RBLOCK)[None, :]")
            body += self._reduction_body()
            meta = {"XBLOCK": xblock, "RBLOCK": rblock}
        else:
            blocks = self.blocks
            xblock = min(next_pow2(self.xnumel),
                         blocks.pointwise_xblock if not self.interpret else blocks.interpret_tile_elements)
            body.append("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)")
            body.append(f"xmask = xindex < {self.xnumel}")
            body += self._coord_lines(self.K, "xindex", self.xnumel)
            scope = _Scope(None)
            for n in self.g.outputs:
                self._store(n, scope)
            body += scope.lines
            meta = {"XBLOCK": xblock}
        tiles = meta["XBLOCK"] * meta.get("RBLOCK", 1)
        meta["num_warps"] = 8 if tiles >= 4096 else 4 if tiles >= 512 else 2 if tiles >= 128 else 1
        grid = -(-self.xnumel // meta["XBLOCK"]) * (self.grid_split if self.reduction else 1)
        args = list(self.g.inputs) + list(self.g.outputs)
        params = ", ".join(self.arg_names[a] for a in args) + (", ws" if self.split.split > 1 else "")
        consts = "XBLOCK: tl.constexpr" + (", RBLOCK: tl.constexpr" if self.reduction else "")
        ops = "\n".join(f"#   {node_source(n)}" for n in self.g.nodes)
        split = "" if self.split.split == 1 else (
            f" split={self.split.split}x{self.split.chunk} "
            + ("stores outputs" if self.phase is None else f"{self.phase[0]} of level {self.phase[1]}"))
        text = (f"@triton.jit\ndef KERNEL_NAME({params}, {consts}):\n"
                f"    # S={list(self.S)} reduced={sorted(self.D)} x={self.xnumel} r={self.rnumel}{split}\n"
                f"    # x order {self.K} r order {self.R}{' channel-contiguous' if self.x_contiguous else ''}\n"
                + "\n".join("    " + line for line in body) + "\n")
        # Node names differ between graphs (and between blocks of one model); the kernel's identity
        # must not, so hash and compile the text with each line's node annotation reduced to its op.
        canonical = canonical_source(text)
        digest = hashlib.sha256((canonical + repr(meta) + str(self.interpret)).encode()).hexdigest()[:16]
        kind = "pw" if not self.reduction else "red" if self.phase is None else f"{self.phase[0]}{self.phase[1]}"
        name = f"ember_{kind}_{digest}"
        source = f"# source ops:\n{ops}\n" + text.replace("KERNEL_NAME", name)
        header = HEADER_INTERPRET if self.interpret else HEADER_GPU
        return KernelSource(name, source, digest, args, len(self.g.inputs), grid, meta, header,
                            canonical.replace("KERNEL_NAME", name))

    def _blocks(self) -> tuple[int, int]:
        xmax = next_pow2(self.xnumel)
        blocks = self.blocks
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

    def _reduction_body(self) -> list[str]:
        root = _Scope(None)
        if self.persistent:
            root.lines.append("rindex = rbase")
            root.lines.append(f"rmask = rindex < {self.rnumel}")
            root.lines += self._coord_lines(self.R, "rindex", self.rnumel)
            for n in self.g.outputs:
                self._store(n, root)
            return root.lines
        reductions = self.reductions
        for lv in self.levels():
            at_level = [r for r in reductions if self.level[r] == lv]
            if self.split.split == 1:
                self._loop(root, at_level)
            elif self.phase == ("part", lv):
                self._loop(root, at_level, partial=True)
                return root.lines  # a partial kernel stops after its level
            elif self.phase == ("comb", lv):
                self._combine_partials(root, at_level)
                return root.lines
            else:
                self._load_results(root, at_level)
        full_outputs = [n for n in self.g.outputs if self._full(self.g.dims[n])]
        for n in self.g.outputs:
            if not self._full(self.g.dims[n]):
                self._store(n, root)
        if full_outputs:
            self._loop(root, [], full_outputs)
        return root.lines

    def levels(self) -> list[int]:
        return sorted({self.level[r] for r in self.reductions})

    def _ws_offset(self, r: fx.Node, chunk: str) -> str:
        j = self.reductions.index(r)
        return f"{j * self.split.split * self.xnumel} + {chunk} * {self.xnumel} + xindex"

    def _result_offset(self, r: fx.Node) -> str:
        j = self.reductions.index(r)
        return f"{len(self.reductions) * self.split.split * self.xnumel + j * self.xnumel} + xindex"

    def _load_results(self, root: _Scope, reductions: list[fx.Node]) -> None:
        """Reductions of a split group, as the combining kernels stored them."""
        for r in reductions:
            dtype = compute_dtype(r.meta["val"].dtype)
            var = self._tmp()
            root.lines.append(f"{var} = {self._finish(r, f'tl.load(ws + ({self._result_offset(r)}), xmask)')}"
                              f"  # {node_source(r)}")
            root.cache[r] = Operand(var, dtype)

    def _combine_partials(self, root: _Scope, reductions: list[fx.Node]) -> None:
        """Each reduction's result from the chunks' partials, stored once per x in the workspace
        (one small kernel, instead of every program of the next kernels combining them again)."""
        sblock = self.split.sblock
        for r in reductions:
            dtype = compute_dtype(r.meta["val"].dtype)
            kind, ident = _reduction_kind(r), self._identity(r, dtype)
            acc, part = self._tmp(), self._tmp()
            root.lines.append(f"{acc} = tl.full([XBLOCK, {sblock}], {ident}, {TL_DTYPE[dtype]})")
            root.lines.append(f"for s0 in range(0, {self.split.split}, {sblock}):")
            root.lines.append(f"    sidx = s0 + tl.arange(0, {sblock})[None, :]")
            root.lines.append(f"    {part} = tl.load(ws + ({self._ws_offset(r, 'sidx')}), xmask & (sidx < "
                              f"{self.split.split}), other={ident})")
            root.lines.append(f"    {self._accumulate(acc, part, kind)}")
            var = self._tmp()
            root.lines.append(f"{var} = tl.reduce({acc}, 1, {self._combine(kind, dtype)})[:, None]  # {node_source(r)}")
            root.lines.append(f"tl.store(ws + ({self._result_offset(r)}), {var}, xmask)")

    @staticmethod
    def _accumulate(acc: str, value: str, kind: str) -> str:
        if kind == "sum":
            return f"{acc} = {acc} + {value}"
        cmp = ">" if kind == "max" else "<"
        return f"{acc} = tl.where(({value} {cmp} {acc}) | ({value} != {value}), {value}, {acc})"

    def _loop(self, root: _Scope, reductions: list[fx.Node], stores: list[fx.Node] = (),
              partial: bool = False) -> None:
        inner = _Scope(root)
        inner.lines.append("rindex = roffset + rbase")
        inner.lines.append(f"rmask = rindex < {self.rnumel}")
        inner.lines += self._coord_lines(self.R, "rindex", self.rnumel)
        pre: list[str] = []
        accs = []
        for r in reductions:
            inp, dtype = self._reduce_input(r, inner)
            kind = _reduction_kind(r)
            acc = self._tmp()
            ident = self._identity(r, dtype)
            pre.append(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {TL_DTYPE[dtype]})")
            masked = f"tl.where(xmask & rmask, {inp}, {ident})"
            if kind != "sum":
                masked_var = self._tmp()
                inner.lines.append(f"{masked_var} = {masked}")
                masked = masked_var
            inner.lines.append(self._accumulate(acc, masked, kind))
            accs.append((r, acc, kind, dtype))
        for n in stores:
            self._store(n, inner)
        root.lines += pre
        if self.split.split > 1:  # this program's chunk of D
            root.lines.append(f"for roffset in range(rstart, rstart + {self.split.chunk}, RBLOCK):")
        else:
            root.lines.append(f"for roffset in range(0, {self.rnumel}, RBLOCK):")
        root.lines += ["    " + line for line in inner.lines]
        for r, acc, kind, dtype in accs:
            var = self._tmp()
            reduced = f"tl.reduce({acc}, 1, {self._combine(kind, dtype)})[:, None]"
            if partial:  # the chunk's partial result, combined by the next kernels
                root.lines.append(f"{var} = {reduced}  # partial {node_source(r)}")
                root.lines.append(f"tl.store(ws + ({self._ws_offset(r, 'sid')}), {var}, xmask)")
                continue
            root.lines.append(f"{var} = {self._finish(r, reduced)}  # {node_source(r)}")
            root.cache[r] = Operand(var, dtype)


class _Scope:
    """Lines and value cache of one loop body (or of the kernel's top level)."""

    def __init__(self, outer: _Scope | None) -> None:
        self.lines: list[str] = []
        self.cache: dict = {}
        self.outer = outer if outer is not None else self


def generate_triton(group: FusedGroup, interpret: bool = False) -> KernelSource:
    """The Triton kernel for ``group`` (with its partial-result kernels when the reduction is split)."""
    writer = _KernelWriter(group, interpret)
    ks = writer.write()
    if writer.split.split > 1:
        # Partials of every chunk, then one result row per reduction.
        ks.workspace = len(writer.reductions) * (writer.split.split + 1) * writer.xnumel
        ks.pre = [_KernelWriter(group, interpret, phase=(step, lv)).write()
                  for lv in writer.levels() for step in ("part", "comb")]
        for k in ks.pre:
            k.workspace = ks.workspace
    return ks


__all__ = ["generate_triton", "KernelSource", "launch_kernels", "reduction_keepdim"]
