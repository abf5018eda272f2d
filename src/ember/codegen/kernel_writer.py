"""What the Triton and the numba kernel writers share: walking a fused group's values.

Both writers see a group the same way. Its reference shape (``shape``) splits into kept dims
and reduced dims; every member value walks some of them. A value that walks no reduced dim is
computed once per kept point, in the *x scope* of the code being written; the others inside the
loops over the reduced dims. ``value(node, scope)`` writes the lines that compute ``node`` (and,
first, what it reads) into the right scope once and returns it as a ``KernelValue``: views are
their source, reductions come from the writer's reduction code, pointwise ops from the shared
lowering table (codegen/lowering.py) spelled in the writer's dialect.

Each member's class (pointwise, reduction, view) is the plan's (``FusedGroup.classes``).

A range select (cat, slice_scatter; schedule/range_select.py) is a chain of selects over its
pieces; each piece is its tree of producers evaluated at shifted coordinates (one coordinate
expression per dim of each tree node, rewritten through views by ``source_coords``), whose loads
are masked to the piece's range. Writers that support it implement ``_load_at``.
"""

from __future__ import annotations

import torch.fx as fx

from ember.codegen.kernel_source import node_source
from ember.codegen.lowering import Dialect, KernelValue, lower_pointwise, value_dtype
from ember.schedule.dim_map import entry_dims, walked_dims
from ember.schedule.op_support import STRUCTURAL_ARGS
from ember.schedule.plan import Dims, FusedGroup
from ember.schedule.range_select import RANGE_SELECT_OPS, RangeSelect, select_of, source_coords
from ember.schedule.rules import OpClass, constant_value
from ember.schedule.steps import reduction_levels  # (tests import it from here too)


class Scope:
    """Lines and value cache of one loop body, or of the kernel's top level. ``x_scope`` is where
    values that walk no reduced dim are computed (the scope itself at the top level)."""

    def __init__(self, x_scope: Scope | None = None) -> None:
        self.lines: list[str] = []
        self.cache: dict = {}
        self.x_scope = x_scope if x_scope is not None else self


class KernelWriter:
    """The base of the Triton and the numba writers (see the module docstring)."""

    dialect: Dialect
    value_type: type[KernelValue] = KernelValue

    def __init__(self, group: FusedGroup) -> None:
        self.group = group
        self.shape = group.shape
        self.reduced_dims = set(group.rdims)
        self.tensor_names = {n: f"in{i}" for i, n in enumerate(group.inputs)}
        self.tensor_names.update({n: f"out{i}" for i, n in enumerate(group.outputs)})
        self.reductions = [n for n in group.nodes if group.classes[n] == OpClass.REDUCTION]
        self.level = reduction_levels(group)
        self.counter = 0

    def _tmp(self) -> str:
        self.counter += 1
        return f"t{self.counter}"

    def _walks_reduced(self, dims: Dims) -> bool:
        return bool(walked_dims(dims) & self.reduced_dims)

    def levels(self) -> list[int]:
        """The reduction levels of the group, in order."""
        return sorted({self.level[r] for r in self.reductions})

    # -- hooks of each writer ------------------------------------------------------------------
    def _home(self, dims: Dims, scope: Scope) -> Scope:
        """The scope that computes (and caches) a value walking ``dims``, seen from ``scope``."""
        raise NotImplementedError

    def _load(self, node: fx.Node, dims: Dims, scope: Scope, home: Scope) -> KernelValue:
        """The group input ``node`` read along ``dims`` for a value computed in ``home``."""
        raise NotImplementedError

    def _scalar(self, value: object, key: tuple) -> KernelValue:
        """A Python scalar of the graph; ``key`` (node, argument) says which."""
        raise NotImplementedError

    def _reduced_value(self, node: fx.Node, scope: Scope, home: Scope) -> KernelValue:
        """Reduction ``node``'s result, as the writer's reduction code computed it."""
        raise NotImplementedError

    # -- values --------------------------------------------------------------------------------
    def value(self, node: fx.Node, scope: Scope) -> KernelValue:
        """Member ``node``'s value, written once into the scope that computes it."""
        home = self._home(self.group.dims[node], scope)
        if node in home.cache:
            return home.cache[node]
        cls = self.group.classes[node]
        if node in self.group.selects:
            result = self._select_value(node, scope, home)
        elif cls == OpClass.VIEW:
            result = self.value(node.args[0], scope)
        elif cls == OpClass.REDUCTION:
            result = self._reduced_value(node, scope, home)
        else:
            result = self._pointwise(node, scope, home)
        home.cache[node] = result
        return result

    def _operands(self, node: fx.Node, scope: Scope, home: Scope) -> list[KernelValue]:
        """The arguments of pointwise ``node``: member values, loads, constants and scalars."""
        ops = []
        structural = STRUCTURAL_ARGS.get(node.target, frozenset())
        input_dims = self.group.input_dims[node]
        for i, a in enumerate(node.args):
            if isinstance(a, fx.Node):
                if a in self.group.dims:
                    ops.append(self.value(a, scope))
                elif a in input_dims:
                    ops.append(self._load(a, input_dims[a], scope, home))
                else:  # a constant step, inlined
                    ops.append(self._scalar(constant_value(a), (a,)))
            elif a is None:
                ops.append(self.value_type("None", None))
            elif isinstance(a, (bool, int, float)) and i not in structural:
                ops.append(self._scalar(a, (node, i)))
            else:
                ops.append(self.value_type(repr(a), None))
        return ops

    def _pointwise(self, node: fx.Node, scope: Scope, home: Scope) -> KernelValue:
        ops = self._operands(node, scope, home)
        var = self._tmp()
        home.lines.append(f"{var} = {lower_pointwise(node, ops, self.dialect)}  # {node_source(node)}")
        return self.value_type(var, node.meta["val"].dtype)

    def _reduced_operand(self, node: fx.Node, scope: Scope) -> KernelValue:
        """The value reduction ``node`` reduces, in ``scope``."""
        src = node.args[0]
        if src in self.group.dims:
            return self.value(src, scope)
        return self._load(src, self.group.input_dims[node][src], scope, scope)

    # -- range selects -------------------------------------------------------------------------
    def _coord_expr(self, s: int | None) -> str:
        """The coordinate of group dim ``s`` at the current point ("0" for size-1 dims)."""
        raise NotImplementedError

    def _entry_coord(self, entry: int | tuple[int, ...] | None) -> str:
        """A member dim's coordinate: its S dim's, or its run's read row-major."""
        run = entry_dims(entry)
        if len(run) <= 1:
            return self._coord_expr(run[0] if run else None)
        expr = self._coord_expr(run[0])
        for s in run[1:]:
            expr = f"({expr} * {self.shape[s]} + {self._coord_expr(s)})"
        return expr

    def _load_at(self, node: fx.Node, coords: list[str], cond: str, home: Scope) -> KernelValue:
        """Group input ``node`` at ``coords`` (one expression per dim), where ``cond`` holds."""
        raise NotImplementedError

    def _select_value(self, node: fx.Node, scope: Scope, home: Scope) -> KernelValue:
        sel: RangeSelect = self.group.selects[node]
        dt = value_dtype(node)
        coords = [self._entry_coord(e) for e in self.group.dims[node]]
        c, size = coords[sel.dim], node.meta["val"].shape[sel.dim]
        values, conds = [], []
        for p in sel.pieces:
            shifted = list(coords)
            shifted[sel.dim] = c if p.lo == 0 else f"({c} - {p.lo})"
            cond = " & ".join(([f"({c} >= {p.lo})"] if p.lo > 0 else []) + ([f"({c} < {p.hi})"] if p.hi < size else []))
            values.append(self._tree_value(node, sel, p.root, shifted, cond, scope, home))
            conds.append(cond)
        if sel.base is not None:
            base = self._tree_operand(node, sel.base, coords, "", scope, home, leaf_of_tree=False)
            result = base.as_(dt)
            for v, cond in zip(values, conds):
                result = self.dialect.select(cond, v.as_(dt), result) if cond else v.as_(dt)
        else:
            result = self._piece_selects(values, sel.pieces, c, dt)
        return self._assign(result, node, home)

    def _tree_operand(self, select: fx.Node, a: fx.Node, coords: list[str], cond: str, scope: Scope,
                      home: Scope, leaf_of_tree: bool = True) -> KernelValue:
        """A value a piece reads that its tree does not compute: a member (the base only), a load
        at ``coords`` or an inlined constant."""
        if a in self.group.dims:
            return self.value(a, scope)
        if a in self.group.input_dims[select]:
            if not leaf_of_tree:
                return self._load(a, self.group.input_dims[select][a], scope, home)
            return self._load_at(a, coords, cond, home)
        return self._scalar(constant_value(a), (a,))

    def _tree_value(self, select: fx.Node, sel: RangeSelect, n: fx.Node, coords: list[str], cond: str,
                    scope: Scope, home: Scope) -> KernelValue:
        """Tree node (or leaf) ``n`` of a piece at ``coords``."""
        if n not in sel.tree:
            return self._tree_operand(select, n, coords, cond, scope, home)
        key = ("tree", n, tuple(coords), cond)
        if key in home.cache:
            return home.cache[key]
        if n.target in RANGE_SELECT_OPS:  # a cat inlined into the piece: its own select, at these coordinates
            result = self._nested_select(select, sel, n, coords, cond, scope, home)
        elif self.group.classes[n] == OpClass.VIEW:
            src = n.args[0]
            result = self._tree_value(select, sel, src, source_coords(n, src, coords, "0", _affine), cond, scope, home)
        else:
            ops = []
            structural = STRUCTURAL_ARGS.get(n.target, frozenset())
            for i, a in enumerate(n.args):
                if isinstance(a, fx.Node):
                    sub = source_coords(n, a, coords, "0", _affine) if a.meta["val"].dim() else []
                    ops.append(self._tree_value(select, sel, a, sub, cond, scope, home))
                elif a is None:
                    ops.append(self.value_type("None", None))
                elif isinstance(a, (bool, int, float)) and i not in structural:
                    ops.append(self._scalar(a, (n, i)))
                else:
                    ops.append(self.value_type(repr(a), None))
            var = self._tmp()
            home.lines.append(f"{var} = {lower_pointwise(n, ops, self.dialect)}  # {node_source(n)}")
            result = self.value_type(var, n.meta["val"].dtype)
        home.cache[key] = result
        return result


    def _nested_select(self, select: fx.Node, sel: RangeSelect, n: fx.Node, coords: list[str], cond: str,
                       scope: Scope, home: Scope) -> KernelValue:
        """Tree node ``n``, a cat, at ``coords``: each of its pieces at shifted coordinates, its
        loads masked to the outer piece's range and its own, joined by selects."""
        inner = select_of(n)
        dt = value_dtype(n)
        c, size = coords[inner.dim], n.meta["val"].shape[inner.dim]
        values = []
        for p in inner.pieces:
            shifted = list(coords)
            shifted[inner.dim] = c if p.lo == 0 else f"({c} - {p.lo})"
            own = ([f"({c} >= {p.lo})"] if p.lo > 0 else []) + ([f"({c} < {p.hi})"] if p.hi < size else [])
            values.append(self._tree_value(select, sel, p.root, shifted, " & ".join(([cond] if cond else []) + own),
                                           scope, home))
        return self._assign(self._piece_selects(values, inner.pieces, c, dt), n, home)

    def _piece_selects(self, values: list, pieces: list, c: str, dt: object) -> str:
        """The value of the piece whose range holds coordinate ``c``: a chain of selects, last piece
        first (a cat's pieces are contiguous, so ``c < hi`` picks among the earlier ones)."""
        result = values[-1].as_(dt)
        for v, p in zip(values[-2::-1], pieces[-2::-1]):
            result = self.dialect.select(f"({c} < {p.hi})", v.as_(dt), result)
        return result

    def _assign(self, result: str, node: fx.Node, home: Scope) -> KernelValue:
        var = self._tmp()
        home.lines.append(f"{var} = {result}  # {node_source(node)}")
        return self.value_type(var, node.meta["val"].dtype)


def _affine(c: str, start: int, step: int) -> str:
    """The coordinate ``start + step * c``, as short as it can be written."""
    if c == "0":
        return str(start)
    scaled = c if step == 1 else f"{step} * {c}"
    return scaled if start == 0 else f"({start} + {scaled})"
