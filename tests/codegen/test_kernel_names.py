"""A generated kernel's name says what it computes: ``ember_<kind>_<source ops>_<digest>``, the ops
before decomposition (``original_aten``) with data-moving ones left out, so a profiler's kernel
table reads like the model (``ember_red_layer_norm_backward_...``)."""

from __future__ import annotations

import torch
from core_helpers import log_of

import ember
from ember.codegen.kernel_source import op_summary


class NormGeluSoftmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(self.norm(x))).softmax(-1)


def test_kernel_names_list_their_source_ops() -> None:
    torch.manual_seed(0)
    model = NormGeluSoftmax()
    compiled = ember.compile(model, target="triton-interpret", cache=False)
    x = torch.randn(4, 32, requires_grad=True)
    compiled(x).sum().backward()
    names = {g.kind: sorted(g.kernel_sources) for g in log_of(compiled).graphs}
    forward, backward = " ".join(names["forward"]), " ".join(names["backward"])
    for op in ("layer_norm", "gelu", "softmax"):
        assert op in forward, names
    for op in ("layer_norm_backward", "gelu_backward", "softmax_backward"):
        assert op in backward, names
    for name in names["forward"] + names["backward"]:
        kind, digest = name.split("_")[1], name.rsplit("_", 1)[1]
        assert kind in {"pw", "tpw", "red"} or kind[:-1].isalpha(), name
        assert len(digest) == 16 and int(digest, 16) >= 0, name


def test_the_summary_leaves_out_data_movement_and_is_bounded() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.ops.aten.view.default, (x, [4])),
             graph.call_function(torch.ops.aten.mul.Tensor, (x, x)),
             graph.call_function(torch.ops.aten.exp.default, (x,)),
             graph.call_function(torch.ops.aten.exp.default, (x,))]
    assert op_summary(nodes) == "exp"
    many = [graph.call_function(op, (x,)) for op in (torch.ops.aten.native_layer_norm_backward.default,
                                                     torch.ops.aten._softmax_backward_data.default,
                                                     torch.ops.aten.gelu_backward.default,
                                                     torch.ops.aten.tanh.default)]
    summary = op_summary(many)
    assert summary.startswith("layer_norm_backward_softmax_backward") and "tanh" not in summary
    assert len(summary) <= 40 and summary == summary.strip("_")
