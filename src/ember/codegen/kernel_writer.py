"""What the Triton and the numba kernel writers share: walking a fused group's values.

Both writers see a group the same way. Its reference shape (``shape``) splits into kept dims
and reduced dims; every member value walks some of them. A value that walks no reduced dim is
computed once per kept point, in the *x scope* of the code being written; the others inside the
loops over the reduced dims. ``value(node, scope)`` writes the lines that compute ``node`` (and,
first, what it reads) into the right scope once and returns it as a ``KernelValue``: views are
their source, reductions come from the writer's reduction code, pointwise ops from the shared
lowering table (codegen/lowering.py) spelled in the writer's dialect.

Each member's class (pointwise, reduction, view) is the plan's (``FusedGroup.classes``).
"""

from __future__ import annotations

import torch.fx as fx

from ember.codegen.kernel_source import node_source
from ember.codegen.lowering import Dialect, KernelValue, lower_pointwise
from ember.schedule.op_support import STRUCTURAL_ARGS
from ember.schedule.plan import Dims, FusedGroup
from ember.schedule.rules import OpClass, constant_value


class Scope:
    """Lines and value cache of one loop body, or of the kernel's top level. ``x_scope`` is where
    values that walk no reduced dim are computed (the scope itself at the top level)."""

    def __init__(self, x_scope: Scope | None = None) -> None:
        self.lines: list[str] = []
        self.cache: dict = {}
        self.x_scope = x_scope if x_scope is not None else self


def reduction_levels(group: FusedGroup) -> dict[fx.Node, int]:
    """How many reductions lie on the longest path into each member (itself included): a
    reduction that reads another reduction's result runs one level (one loop nest) later."""
    level: dict[fx.Node, int] = {}
    members = set(group.nodes)
    for n in group.nodes:
        base = max((level[a] for a in n.all_input_nodes if a in members), default=0)
        level[n] = base + 1 if group.classes[n] == OpClass.REDUCTION else base
    return level


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
        return any(d in self.reduced_dims for d in dims if d is not None)

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
        if cls == OpClass.VIEW:
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
