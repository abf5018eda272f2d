"""The two project-defined benchmark nets, and the registry that serves the seed suite."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.bench import models
from ember.bench.nets import CycleGANGenerator, StyleTransferNet


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _modules(model: nn.Module, kind: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("net_cls", [CycleGANGenerator, StyleTransferNet])
def test_output_shape_and_backward(net_cls: type) -> None:
    torch.manual_seed(0)
    net = net_cls()
    x = torch.randn(1, 3, 64, 64, requires_grad=True)
    y = net(x)
    assert y.shape == (1, 3, 64, 64)
    assert torch.isfinite(y).all()
    y.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_cyclegan_matches_paper_layout() -> None:
    net = CycleGANGenerator()
    # The official repository prints 11.378 M parameters for this generator.
    assert abs(_count(net) - 11_378_000) < 2_000
    norms = _modules(net, nn.InstanceNorm2d)
    # 1 stem + 2 down + 9 blocks x 2 + 2 up
    assert len(norms) == 23
    assert all(not n.affine and not n.track_running_stats for n in norms)
    pads = _modules(net, nn.ReflectionPad2d)
    assert len(pads) == 2 + 9 * 2
    assert [p.padding for p in (pads[0], pads[-1])] == [(3, 3, 3, 3), (3, 3, 3, 3)]
    ups = _modules(net, nn.ConvTranspose2d)
    assert len(ups) == 2
    assert all(u.stride == (2, 2) and u.output_padding == (1, 1) for u in ups)
    assert isinstance(list(net.modules())[-1], nn.Tanh)
    assert torch.all(net(torch.randn(1, 3, 32, 32)).abs() <= 1)


def test_cyclegan_options() -> None:
    net = CycleGANGenerator(in_ch=1, out_ch=2, ngf=8, n_blocks=2)
    assert net(torch.randn(2, 1, 32, 32)).shape == (2, 2, 32, 32)
    assert len(_modules(net, nn.InstanceNorm2d)) == 1 + 2 + 2 * 2 + 2
    with pytest.raises(ValueError):
        CycleGANGenerator(n_blocks=-1)


def test_style_transfer_matches_paper_layout() -> None:
    net = StyleTransferNet()
    # pytorch/examples TransformerNet: 1,679,235 parameters.
    assert abs(_count(net) - 1_679_235) < 2_000
    norms = _modules(net, nn.InstanceNorm2d)
    assert len(norms) == 5 + 5 * 2
    assert all(n.affine for n in norms)
    pads = _modules(net, nn.ReflectionPad2d)
    convs = _modules(net, nn.Conv2d)
    assert len(pads) == len(convs) == 16  # every conv is reflection padded
    assert not _modules(net, nn.ConvTranspose2d)  # upsampling is nearest + conv
    assert convs[0].kernel_size == (9, 9) and convs[-1].kernel_size == (9, 9)
    assert convs[-1].out_channels == 3


def test_registry_matches_benchmarks_md() -> None:
    expected = {
        "resnet50": (128, 128), "bert": (64, 1), "vgg16": (64, 64), "mobilenet_v3": (128, 128),
        "densenet121": (64, 64), "resnet50v2": (64, 64), "cyclegan": (1, 1), "style_transfer": (4, 4),
    }
    for name, (train, infer) in expected.items():
        case = models.get_case(name)
        assert (case.batch_train, case.batch_infer) == (train, infer), name
    assert {"resnet18", "tiny_transformer"} <= set(models.list_cases())
    with pytest.raises(ValueError, match="known models"):
        models.get_case("no_such_model")


@pytest.mark.parametrize(
    "name, full_shape",
    [("resnet50", (3, 224, 224)), ("cyclegan", (3, 256, 256)), ("style_transfer", (3, 256, 256))],
)
def test_input_shapes(name: str, full_shape: tuple[int, ...]) -> None:
    case = models.get_case(name)
    gen = torch.Generator().manual_seed(0)
    (x,), _ = case.make_batch(2, torch.device("cpu"), gen, False)
    assert x.shape == (2, *full_shape)
    (xs,), _ = case.make_batch(2, torch.device("cpu"), gen, True)
    assert xs.shape == (2, 3, 64, 64)


def test_batches_rotate_and_are_random() -> None:
    case = models.get_case("bert")
    batches = models.make_batches(case, 2, torch.device("cpu"), small=False, count=3)
    assert len(batches) == 3
    (ids, mask), labels = batches[0]
    assert ids.shape == mask.shape == (2, 128) and labels.shape == (2,)
    assert not torch.equal(batches[0][0][0], batches[1][0][0])
    assert ids.min() > 0 and mask.all()
    image = models.make_batches(models.get_case("resnet18"), 2, torch.device("cpu"), small=True)
    assert all(b[0][0].abs().sum() > 0 for b in image)


@pytest.mark.parametrize("name", ["cyclegan", "style_transfer", "resnet18", "tiny_transformer"])
def test_small_cases_train_step(name: str) -> None:
    case = models.get_case(name)
    model = case.build(True)
    (inputs, target), *_ = models.make_batches(case, 2, torch.device("cpu"), small=True, count=1)
    loss = case.loss(model(*inputs), target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()


def test_primary_tensor() -> None:
    t = torch.ones(2)
    assert models.primary_tensor(t) is t
    assert models.primary_tensor((t, 1)) is t
    assert models.primary_tensor({"logits": t}) is t

    class Out:
        logits = t

    assert models.primary_tensor(Out()) is t
    with pytest.raises(TypeError):
        models.primary_tensor(3)


def test_missing_dependency_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(models.MissingDependencyError, match=r"'bert' needs transformers: pip install ember\[bench\]"):
        models.get_case("bert").build(True)
