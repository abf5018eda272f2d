"""The shared op-lowering table (codegen/lowering.py) and the planner's op support table
(schedule/op_support.py): one list of ops for both, stages import only earlier stages, code
generators take each member's class from the plan, and reductions of bool and narrow integer
tensors start from identities of their own dtype on every target.

The semantics of each op in each dialect are tested against eager by test_pointwise.py (Triton)
and test_cpu_kernels.py / test_cpu_bf16.py (numba).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from ember_check import strict_env
from torch.fx.experimental.proxy_tensor import make_fx

import ember
import ember.schedule.plan
from ember.capture.decompositions import decomposition_table
from ember.codegen.cpu_dialect import CPU
from ember.codegen.lowering import POINTWISE_LOWERINGS, KernelValue, reduction_identity
from ember.codegen.triton_dialect import TRITON
from ember.schedule import op_support
from ember.schedule.plan import plan_graph


def test_the_lowering_table_holds_exactly_the_supported_ops() -> None:
    assert set(POINTWISE_LOWERINGS) == set(op_support.POINTWISE_OPS)
    assert all(callable(fn) for fn in POINTWISE_LOWERINGS.values())
    assert op_support.KERNEL_DTYPES["cpu"] <= op_support.KERNEL_DTYPES["triton"] == op_support.FUSABLE_DTYPES


def test_schedule_imports_no_later_stage() -> None:
    """Whether an op fuses is the planner's decision, not a code generator's table: schedule/
    imports only itself and the stage-free helpers."""
    folder = Path(ember.schedule.plan.__file__).parent
    allowed = {"ember.schedule", "ember.graph_utils"}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("ember"):
                    assert any(name == a or name.startswith(a + ".") for a in allowed), f"{path.name} imports {name}"


def test_fused_groups_carry_the_plans_classes() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(x * 2.0, -1) + w).unsqueeze(0).relu().sum(-1)

    gm = make_fx(fn, decomposition_table=decomposition_table())(torch.randn(4, 8), torch.randn(8))
    plan = plan_graph(gm.graph)
    groups = plan.fused()
    assert groups
    for group in groups:
        assert list(group.classes) == group.nodes
        assert all(group.classes[n] == plan.classes[n][0] for n in group.nodes)


@pytest.mark.parametrize("dialect", [TRITON, CPU], ids=["triton", "cpu"])
def test_literals_of_each_dialect(dialect: object) -> None:
    one = dialect.literal(1.0, torch.float32)
    assert float(eval(one, {"np": __import__("numpy")})) == 1.0
    for kind, dtype in [("max", torch.float32), ("min", torch.float64), ("max", torch.int8), ("min", torch.uint8)]:
        ident = reduction_identity(kind, dtype)
        text = dialect.literal(ident, dtype)
        value = eval(text, {"np": __import__("numpy")})
        assert float(value) == float(ident), (text, ident)
    # A bool reduction starts from False (max) or True (min), not from an int64 extreme.
    assert reduction_identity("max", torch.bool) is False and reduction_identity("min", torch.bool) is True
    assert KernelValue("x", torch.bfloat16).dtype == torch.float32  # values compute in float32


def _bool_and_int_reductions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return a.amax(1), a.amin(0), b.amax(1), b.amin(1), (b * 3).amax(0)


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
def test_bool_and_narrow_int_reductions_match_eager(looped: bool) -> None:
    """A row of all-False bools reduces to False (an int64 identity once made it True)."""
    a = torch.rand(5, 37) > 0.7
    a[1], a[2] = False, True
    b = torch.randint(-100, 100, (5, 37), dtype=torch.int32).to(torch.int8)
    with strict_env(looped=looped):
        compiled = ember.compile(_bool_and_int_reductions, target="triton-interpret", cache=False)
        for got, want in zip(compiled(a, b), _bool_and_int_reductions(a, b)):
            assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
        (graph,) = compiled._ember_backend.log.graphs
        assert set(graph.placement) == {"generated"}, dict(graph.placement)
