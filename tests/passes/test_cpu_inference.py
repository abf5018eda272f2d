"""CPU inference: freezing, per-channel affine folding into convolutions, oneDNN library calls.

Every case compares with eager on fresh random inputs; batch-norm running statistics are
randomised so that folding them into the convolution is actually exercised.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ember
import ember.codegen.program as program_module
from ember.passes.cpu_library import available as onednn_available
from ember.runtime.frozen import FrozenValues

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _randomise_bn(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.2)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model.eval()


def _graphs(compiled: object) -> list:
    return compiled._ember_backend.log.graphs


def _placed(compiled: object, where: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in _graphs(compiled):
        for op, n in g.placement.get(where, {}).items():
            out[op] = out.get(op, 0) + n
    return out


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> None:
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item()
    assert err <= rtol * scale + 1e-6, f"max error {err:.3g} vs output scale {scale:.3g}"


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.head(y)  # a convolution's output returned as is: layout must match eager


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_models_match_eager(name: str) -> None:
    torch.manual_seed(0)
    model = _randomise_bn(getattr(torchvision.models, name)(num_classes=10))
    compiled = ember.compile(model)
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the frozen values
            x = torch.randn(2, 3, 64, 64)
            _close(compiled(x), model(x))
    library = _placed(compiled, "library")
    assert library.get("mkldnn._convolution_pointwise", 0) > 0
    assert _placed(compiled, "frozen"), "batch-norm folding should leave frozen ops"
    assert "aten.convolution" not in library  # every convolution went to oneDNN


BF16_NATIVE = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_bf16_autocast_models_match_eager_and_use_onednn_where_native(name: str) -> None:
    """bf16 autocast: convolutions (bf16 weights cast once from the frozen fp32 parameters) go to
    oneDNN with fused epilogues where the CPU has native bf16, else stay ATen calls; the output
    matches eager autocast within bf16 rounding (8 bits of mantissa, a few roundings deep)."""
    torch.manual_seed(0)
    model = _randomise_bn(getattr(torchvision.models, name)(num_classes=10))
    compiled = ember.compile(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            x = torch.randn(2, 3, 64, 64)
            got, want = compiled(x), model(x)
            assert got.dtype == want.dtype == torch.bfloat16
            _close(got.float(), want.float(), rtol=5e-2)
    library = _placed(compiled, "library")
    if BF16_NATIVE:
        assert library.get("mkldnn._convolution_pointwise", 0) > 0 and "aten.convolution" not in library
        assert library.get("mkldnn._linear_pointwise", 0) == {"resnet18": 1, "mobilenet_v3_small": 2}[name]
    else:
        assert "mkldnn._convolution_pointwise" not in library


def test_bert_matches_eager_and_uses_onednn_linear() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=500, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    compiled = ember.compile(model)
    with torch.no_grad():
        ids = torch.randint(0, 500, (2, 16))
        _close(compiled(ids).logits, model(ids).logits)
    library = _placed(compiled, "library")
    assert library.get("mkldnn._linear_pointwise", 0) >= 12  # q, k, v, out, two FFN per layer
    assert "aten.addmm" not in library


def test_output_layout_and_parameter_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    caches: list[FrozenValues] = []

    class Recorded(FrozenValues):
        def __init__(self) -> None:
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(program_module, "FrozenValues", Recorded)
    torch.manual_seed(0)
    model = _randomise_bn(ConvBlock())
    compiled = ember.compile(model, cache=False)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = compiled(x)
        _close(out, model(x))
        assert out.stride() == model(x).stride()  # eager's layout, not oneDNN's channels_last
        compiled(x)
        used = [c for c in caches if c.computed]
        assert len(used) == 1 and used[0].computed == 1  # computed once, reused after
        # In-place updates bump parameter versions: the next call recomputes the folded weights.
        model.conv1.weight.mul_(1.5)
        model.bn2.running_var.add_(0.25)
        _close(compiled(x), model(x))
        assert used[0].computed == 2
        model.load_state_dict(_randomise_bn(ConvBlock()).state_dict())
        _close(compiled(x), model(x))
        assert used[0].computed == 3
        model.conv2.bias = nn.Parameter(torch.randn(8))  # a new tensor at a new address
        _close(compiled(x), model(x))


def test_freeze_off_keeps_parameters_live() -> None:
    torch.manual_seed(0)
    model = _randomise_bn(ConvBlock())
    compiled = ember.compile(model, freeze=False)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        _close(compiled(x), model(x))
    assert not _placed(compiled, "frozen")
    assert "mkldnn._convolution_pointwise" not in _placed(compiled, "library")


class AffineChain(nn.Module):
    def __init__(self, ops: list[tuple[str, bool, bool]]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.ops = ops
        self.params = nn.ParameterList([nn.Parameter(torch.rand(6, 1, 1) + 0.5) for _ in ops])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        for (op, scalar, conv_first), p in zip(self.ops, self.params):
            other = 1.75 if scalar else p
            a, b = (y, other) if conv_first else (other, y)
            if op == "div" and not conv_first:
                a, b = y, other  # other / y is not affine; keep the chain foldable
            y = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op](a, b)
        return y


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "sub", "mul", "div"]), st.booleans(), st.booleans()),
                min_size=1, max_size=4))
def test_any_per_channel_affine_chain_folds_exactly(ops: list[tuple[str, bool, bool]]) -> None:
    torch._dynamo.reset()  # every example is a new frame for Dynamo, not a recompile of the last
    torch.manual_seed(0)
    model = AffineChain(ops).eval()
    compiled = ember.compile(model, cache=False)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        _close(compiled(x), model(x))
    library = _placed(compiled, "library")
    assert library.get("mkldnn._convolution_pointwise", 0) == 1
    # Nothing of the chain is left per call: it all went into the frozen weight and bias. (The one
    # copy left turns oneDNN's channels_last result back into eager's layout.)
    per_call = {**_placed(compiled, "fused-aten"), **_placed(compiled, "generated")}
    assert per_call == {"aten.clone": 1}


def test_device_option() -> None:
    model = ConvBlock().eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        _close(ember.compile(model, device="cpu")(x), model(x))
        with pytest.raises(Exception, match=r"device='cuda'.*is on cpu"):
            ember.compile(model, device="cuda")(x)
    with pytest.raises(ValueError, match="unknown device"):
        ember.compile(model, device="tpu")


# The seed suite through this path (training step, then inference): tests/models/test_seed_models.py.


class _PositionBiasMLP(nn.Module):
    """A bias computed from a buffer by a small MLP, parameters only (Swin V2's continuous
    position bias): the whole MLP is frozen, and its linears become oneDNN calls plus views."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1, 7, 7, 2))
        self.mlp = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 4, bias=False))
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.mlp(self.table).view(-1, 4).permute(1, 0).reshape(4, 49)
        return self.proj(x) + 16 * torch.sigmoid(bias).sum()


def test_parameter_only_mlp_lowered_to_library_calls_stays_frozen_whole() -> None:
    # The library lowering adds nodes (a linear's output view) after the parameters were marked:
    # unmarked, the frozen values' function read a name only the main program defined.
    torch.manual_seed(0)
    model = _PositionBiasMLP().eval()
    compiled = ember.compile(model, target="cpu")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 16)
            _close(compiled(x), model(x))
    assert any("frozen" in g.program for g in _graphs(compiled))
