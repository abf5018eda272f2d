"""Ember's core ATen table against torch's: the same decompositions, without walking the namespace."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_module_simplified

from ember.capture import decompositions


def _has_cpp_composite(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def test_core_table_is_torchs_without_the_entries_that_run_the_ops_own_composite_kernel() -> None:
    ours, torchs = decompositions.core_aten_table(), dict(core_aten_decompositions())
    assert set(ours) <= set(torchs)
    assert all(ours[op] is torchs[op] for op in ours)
    left_out = [op for op in torchs if op not in ours]
    assert left_out, "torch's table walks the namespace; nothing left out means the comparison is void"
    # Every entry left out only runs the C++ composite kernel the dispatcher runs anyway.
    assert [op for op in left_out if not _has_cpp_composite(op)] == []


class _Mixed(nn.Module):
    """Ops whose decompositions come through composite kernels: linear, norms, softmax, gelu,
    einsum, upsampling (nearest and nearest-exact), padding, std, cdist, attention."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm, self.conv = nn.Linear(16, 32), nn.LayerNorm(32), nn.Conv2d(3, 4, 3)
        self.group_norm = nn.GroupNorm(2, 4)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.norm(self.linear(x))).softmax(-1)
        y = y + torch.einsum("bi,bj->bij", y, y).sum(1)
        z = self.group_norm(F.interpolate(self.conv(img), scale_factor=2.0))
        z = F.interpolate(z, scale_factor=1.5, mode="nearest-exact").flatten(1).mean(1, keepdim=True)
        z = F.pad(z, (1, 1)).norm(dim=-1, keepdim=True)
        q = y[:, None, None]
        a = F.scaled_dot_product_attention(q, q, q)
        return y.sum(-1) + z.sum(-1) + a.sum() + torch.cdist(y, y).sum() + y.std()


def _graphs(table: dict, train: bool) -> list[str]:
    torch.manual_seed(0)
    model = _Mixed().train(train)
    x, img = torch.randn(4, 16, requires_grad=train), torch.randn(4, 3, 8, 8)
    codes: list[str] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        codes.append(gm.code)
        return gm

    def backend(gm: torch.fx.GraphModule, example_inputs: list):  # noqa: ANN202
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep, decompositions=table)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    if train:
        compiled(x, img).sum().backward()
    else:
        with torch.no_grad():
            compiled(x, img)
    return codes


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_traced_graphs_are_the_same_with_either_table(monkeypatch: pytest.MonkeyPatch, train: bool) -> None:
    ours = _graphs(decompositions.decomposition_table(cpu_inference=not train), train)
    monkeypatch.setattr(decompositions, "core_aten_table", lambda: dict(core_aten_decompositions()))
    torchs = _graphs(decompositions.decomposition_table(cpu_inference=not train), train)
    assert len(ours) == (2 if train else 1)
    assert ours == torchs
    assert "aten.index.Tensor" in ours[0]  # both upsamplings decomposed, by either table
