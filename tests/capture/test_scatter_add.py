"""Accumulating index writes (a bias table's and an embedding's backward) become ``index_add``
on GPU targets: same gradients as eager, and the sort-based ops gone from the program."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import ember
from ember import config


class BiasTable(nn.Module):
    """swin_t's relative position bias: a table gathered by a fixed index with repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(13, 3))
        self.register_buffer("index", torch.randint(0, 13, (36,)))
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table[self.index].view(6, 6, 3).permute(2, 0, 1)
        return self.proj((x + bias).permute(1, 2, 0)).tanh()


class Tokens(nn.Module):
    def __init__(self, padding_idx: int | None, rows: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(rows, 8, padding_idx=padding_idx)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).relu())


def _placed_ops(compiled: nn.Module) -> Counter:
    ops: Counter = Counter()
    for g in compiled._ember_backend.log.graphs:
        for kind, counts in g.placement.items():
            for op, n in counts.items():
                ops[(kind, op)] += n
    return ops


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _programs(compiled: nn.Module) -> str:
    return "\n".join(g.program for g in compiled._ember_backend.log.graphs)


def _check(model: nn.Module, x: torch.Tensor) -> tuple[Counter, str]:
    torch._dynamo.reset()
    eager, ours = model, copy.deepcopy(model)
    with config.patch(strict=True):
        compiled = ember.compile(ours, target="triton-interpret", cache=False)
        out, grads = _train_step(compiled, x)
    ref_out, ref_grads = _train_step(eager, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    return _placed_ops(compiled), _programs(compiled)


def test_a_bias_tables_gradient_is_one_index_add() -> None:
    torch.manual_seed(0)
    ops, program = _check(BiasTable(), torch.randn(3, 6, 6))
    names = {op for _, op in ops}
    assert "aten.index_add" in names
    assert "aten.index_put" not in names
    # Into a zero fill made for it alone: in place, no copy of the fill first.
    assert "aten.index_add_.default(" in program


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_an_embeddings_gradient_is_one_index_add(padding_idx: int | None) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 20, (4, 9))
    ids[0, :3] = 3  # the padding row, repeated: its gradient stays zero
    ops, _ = _check(Tokens(padding_idx), ids)
    names = {op for _, op in ops}
    assert "aten.index_add" in names
    assert "aten.embedding_dense_backward" not in names


def test_deterministic_mode_keeps_the_sorting_ops() -> None:
    torch.manual_seed(2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ops, _ = _check(BiasTable(), torch.randn(3, 6, 6))
    finally:
        torch.use_deterministic_algorithms(False)
    names = {op for _, op in ops}
    assert "aten.index_add" not in names


def test_many_indices_per_row_keep_the_sorting_op() -> None:
    """A token-type embedding: every index 0, thousands of adds into one row; atomic adds would
    queue on it, so the sort-based op stays."""
    torch.manual_seed(3)
    ids = torch.zeros(4, 40, dtype=torch.long)
    ids[1, 5] = 1
    names = {op for _, op in _check(Tokens(None, rows=2), ids)[0]}
    assert "aten.embedding_dense_backward" in names
    assert "aten.index_add" not in names
