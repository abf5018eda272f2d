"""channels_last for convolutional graphs (passes/layout.py) and the generated kernels that run
on channels_last tensors (memory-order pointwise tiles, channel-contiguous reduction tiles,
split reductions), through Triton's interpreter on small shapes, against eager: outputs,
parameter gradients, input gradients, and the strides the caller sees.
"""

from __future__ import annotations

import ast
import copy

import pytest
import torch
from ember_check import assert_close, kernel_text, make_input, strict_env
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ember
from ember import config
from ember.passes import layout
from ember.report.explain import explain_with

nn = torch.nn


class Block(nn.Module):
    """A ResNet basic block with a stem: conv-bn-relu, conv-bn + residual, relu, pooled head."""

    def __init__(self, cin: int = 3, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(cin, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 1, stride=2, bias=False), nn.BatchNorm2d(2 * c))
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)) + x)
        y = torch.relu(self.down(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


class FlattenHead(nn.Module):
    """A VGG-like net: conv-relu-maxpool, then a flatten of a channels_last activation (a view
    that must become a copy) into a linear layer; also returns a 4-D activation. The pooling
    overlaps its windows (ResNet's stem pooling: Ember's own kernels, ops/max_pool.py) and
    the returned activation needs a conversion back to eager's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = nn.functional.max_pool2d(torch.relu(self.conv(x)), 3, 2, 1)
        return self.fc(torch.flatten(y, 1)), y * 2.0


def _train_step(model: nn.Module, x: torch.Tensor, **options: object) -> tuple[object, list, object, object]:
    """Outputs, parameter gradients, input gradient and the compiled model, Ember vs eager."""
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, target="triton-interpret", **options)
    results = []
    for m, fn in ((ref, ref), (model, compiled)):
        xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        out = fn(xi)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        loss = sum((o * torch.randn(o.shape)).sum() for o in outs)
        loss.backward()
        results.append((outs, [p.grad for p in m.parameters()], xi.grad, [b.clone() for b in m.buffers()]))
    return results[0], results[1], compiled


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides wherever they matter (size-1 dims may have any stride)."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _compare(want: tuple, got: tuple, norm_rtol: float = 1e-4, rtol: float | None = None) -> None:
    (wo, wg, wx, wb), (go, gg, gx, gb) = want, got
    for o_w, o_g in zip(wo, go):
        assert_close(o_g, o_w, "output", rtol=rtol, norm_rtol=norm_rtol)
        assert _same_strides(o_g, o_w), f"output strides {o_g.stride()} vs eager {o_w.stride()}"
    for i, (a, b) in enumerate(zip(gg, wg)):
        assert_close(a, b, f"grad of parameter {i}", rtol=rtol, norm_rtol=norm_rtol)
        assert _same_strides(a, b), f"grad {i} strides {a.stride()} vs eager {b.stride()}"
    assert_close(gx, wx, "grad of input", rtol=rtol, norm_rtol=norm_rtol)
    assert _same_strides(gx, wx), (gx.stride(), wx.stride())
    for i, (a, b) in enumerate(zip(gb, wb)):
        assert_close(a, b, f"buffer {i}", rtol=rtol, norm_rtol=norm_rtol)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_resnet_block_training_matches_eager(memory_format: torch.memory_format) -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=memory_format)
    with strict_env():
        want, got, compiled = _train_step(model, x)
    _compare(want, got)
    graphs = {g.kind: g for g in compiled._ember_backend.log.graphs}
    fw, bw = graphs["forward"], graphs["backward"]
    assert fw.layout["convolutions"] == 4 and bw.layout["convolutions"] == 4
    # Forward: no weight is copied (the convolution takes it in channels_last internally); the
    # input only when it is not channels_last already. Nothing between convolutions converts, and
    # the logits are 2-D: no conversion back.
    assert not [c for c in fw.layout["conversions"] if "weight" in c], fw.layout["conversions"]
    inputs = [c for c in fw.layout["conversions"] if "activation" in c]
    assert len(inputs) == (1 if memory_format == torch.contiguous_format else 0), fw.layout["conversions"]
    assert not [c for c in fw.layout["conversions"] if "eager layout" in c]
    # Backward: compiled for the saved activations' channels_last strides; the 3x3 weight
    # gradients and an NCHW input's gradient (graph outputs the caller sees) go back to eager's layout.
    # (With a channels_last input eager's saved activations and gradients are channels_last already.)
    assert bool(bw.layout["synced_inputs"]) == (memory_format == torch.contiguous_format), bw.layout
    back = [c for c in bw.layout["conversions"] if "eager layout" in c]
    assert len(back) == (4 if memory_format == torch.contiguous_format else 0), bw.layout["conversions"]
    # The backward program expects the saved activations in channels_last (no copy at run time).
    for line in bw.program.splitlines():
        name, _, rest = line.strip().partition(" = _expect(")
        if rest and name in bw.layout["synced_inputs"]:
            strides = ast.literal_eval(rest.partition(", ")[2].rstrip(")") + ")")
            assert len(strides) == 4 and strides[1] == 1, line


def test_autocast_weight_casts_write_channels_last() -> None:
    # Under autocast each weight is cast to bf16 in the graph: that cast writes channels_last, so
    # cuDNN does not convert the weight on every forward and backward call. No extra copy.
    torch.manual_seed(0)
    with strict_env(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, compiled = _train_step(Block(), torch.randn(2, 3, 8, 8))
    _compare(want, got, norm_rtol=3e-2, rtol=2e-2)  # bf16: a few ulps
    graphs = {g.kind: g for g in compiled._ember_backend.log.graphs}
    fw, bw = graphs["forward"], graphs["backward"]
    cast = [c for c in fw.layout["conversions"] if "its cast writes it" in c]
    assert len(cast) == 3, fw.layout["conversions"]  # the 1x1 weight is channels_last already
    assert not [c for c in fw.layout["conversions"] + bw.layout["conversions"]
                if "weight" in c and c not in cast], (fw.layout, bw.layout)
    # The backward reads the saved bf16 weights in channels_last (no copy at run time).
    weights = [n.split(" ")[0] for n in cast]
    for line in bw.program.splitlines():
        name, _, rest = line.strip().partition(" = _expect(")
        if rest and name in weights:
            strides = ast.literal_eval(rest.partition(", ")[2].rstrip(")") + ")")
            assert strides[1] == 1, line


def test_user_visible_4d_output_keeps_eager_layout_and_flatten_copies() -> None:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(FlattenHead(), torch.randn(2, 3, 8, 8))
    _compare(want, got)
    fw = next(g for g in compiled._ember_backend.log.graphs if g.kind == "forward")
    assert any("eager layout" in c for c in fw.layout["conversions"]), fw.layout


def test_overlapping_pooling_saves_int8_positions_for_its_backward() -> None:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(FlattenHead(), torch.randn(2, 3, 8, 8))
    _compare(want, got)
    graphs = {g.kind: g for g in compiled._ember_backend.log.graphs}
    assert graphs["forward"].placement["fallback"]["ember.max_pool2d"] == 1
    # The backward reads the forward's positions: it neither pools again nor reads int64 indices.
    assert dict(graphs["backward"].placement["fallback"]) == {"ember.max_pool2d_backward": 1}
    assert "torch.int64" not in graphs["forward"].program


class TilingPoolHead(FlattenHead):
    """FlattenHead with VGG's 2x2 pooling, which Ember generates (capture/pooling.py) on the
    channels_last activations the layout pass makes."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(torch.flatten(y, 1)), y * 2.0


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_generated_pooling_under_the_layout_pass_matches_eager(memory_format: torch.memory_format) -> None:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(TilingPoolHead(), torch.randn(2, 3, 8, 8).to(memory_format=memory_format))
    _compare(want, got)
    for graph in compiled._ember_backend.log.graphs:
        assert not any("max_pool" in op for ops in graph.placement.values() for op in ops), graph.placement


class WindowPartition(nn.Module):
    """Swin's window partition after a patch-embedding convolution: the stem's NHWC output, a
    LayerNorm, then ``view -> permute -> contiguous -> view -> view`` into windows for a linear
    layer. Every reshape there is a view in eager."""

    def __init__(self, c: int = 8, window: int = 2) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Conv2d(3, c, 2, stride=2)
        self.norm = nn.LayerNorm(c)
        self.fc = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.embed(x).permute(0, 2, 3, 1))
        b, h, w, c = y.shape
        ws = self.window
        windows = y.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).contiguous()
        return self.fc(windows.view(-1, ws, ws, c).view(-1, ws * ws, c))


def test_window_partition_views_stay_views() -> None:
    # The merge into a 4-D [windows, ws, ws, c] tensor looks like a 4-D activation, but the
    # partition's copy is already contiguous: re-striding it as channels_last made the next view
    # a copy (ATen's copy kernel, twice per Swin block and pass) and the partition's own copy
    # write a transposed layout.
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(WindowPartition(), torch.randn(2, 3, 8, 8))
    _compare(want, got)
    for graph in compiled._ember_backend.log.graphs:
        assert "aten.reshape.default(" not in graph.program, graph.kind


class WindowReverse(WindowPartition):
    """The window partition, a projection, then Swin's window reverse on a copy of the
    projection's output (what a p=0 dropout decomposes to on some torch versions)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        windows = super().forward(x).clone()
        ws, c = self.window, windows.shape[-1]
        merged = windows.view(-1, 2, 2, ws, ws, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 2 * ws, 2 * ws, c)
        return torch.tanh(merged) * 3.0


def test_a_clone_that_keeps_its_layout_is_its_source() -> None:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(WindowReverse(), torch.randn(2, 3, 8, 8))
    _compare(want, got)
    fw = next(g for g in compiled._ember_backend.log.graphs if g.kind == "forward")
    # Two copies go: the model's own, and the contiguous copy of the stem's NHWC permute (the
    # layout pass makes the convolution's output channels_last, so the permute already is).
    assert dict((name, changed) for name, _s, changed in fw.passes)["remove_layout_preserving_clones"] == 2
    # The copies left: the stem's input into channels_last, the partition and the reverse.
    assert fw.placement["generated"]["aten.clone"] == 3, fw.placement


def test_option_off_keeps_nchw() -> None:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(Block(), torch.randn(2, 3, 8, 8), channels_last=False)
    _compare(want, got)
    assert all(not g.layout for g in compiled._ember_backend.log.graphs)


def test_inference_and_explain_report_conversions() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 3, 8, 8)
    with strict_env(), torch.no_grad():
        report = explain_with(model, (x,), target="triton-interpret")
        want = model(x)
        got = ember.compile(model, target="triton-interpret")(x)
    assert_close(got, want, norm_rtol=1e-4)
    assert report.layout_conversions() == 1  # the input
    text = str(report)
    assert "Memory layout" in text and "channels_last" in text
    assert report.as_dict()["layout_conversions"] == 1


def test_cpu_target_has_no_layout_pass() -> None:
    from ember.passes import PassContext, passes_for
    names = [p.__name__ for p in passes_for(PassContext("forward", "cpu", set()))]
    assert "channels_last_layout" not in names
    names = [p.__name__ for p in passes_for(PassContext("forward", "triton", set()))]
    assert "channels_last_layout" in names
    names = [p.__name__ for p in passes_for(PassContext("forward", "triton", set(), channels_last=False))]
    assert "channels_last_layout" not in names


def test_env_var_turns_layout_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.config import Options
    monkeypatch.setenv("EMBER_LAYOUT", "0")
    assert Options.from_env().channels_last is False
    monkeypatch.setenv("EMBER_LAYOUT", "1")
    assert Options.from_env().channels_last is True


class SqueezeExcite(nn.Module):
    """MobileNetV3's pieces: hardswish, a depthwise conv, a squeeze-excite gate ([N, C, 1, 1]
    broadcast over the activation), a residual add, and a flattened head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, c, 1),
                                nn.Hardsigmoid())
        self.fc = nn.Linear(c * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dw(x)
        y = y * self.se(y) + x
        return self.fc(torch.flatten(nn.functional.max_pool2d(y, 2), 1))


@pytest.mark.parametrize("model,autocast", [(Block, False), (Block, True), (FlattenHead, False),
                                           (SqueezeExcite, False)])
@config.patch(layout_min_activation_to_weight=0.0)
def test_the_incremental_sweep_gives_the_program_a_full_rerun_gives(model: type[nn.Module], autocast: bool) -> None:
    # Metadata re-run only where an input's changed, pointwise strides without a fake dispatch:
    # every node must end with the strides that re-running each one through the fake mode gives,
    # so both compile to the same program, forward and backward (under autocast, the weight
    # casts that the pass makes write channels_last).
    programs = []
    for incremental in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with config.patch(layout_incremental=incremental), torch.autocast("cpu", dtype=torch.bfloat16,
                                                                           enabled=autocast):
            _, _, compiled = _train_step(model(), torch.randn(2, 3, 8, 8), cache=False)
        programs.append([g.program.split("\n", 1)[1] for g in compiled._ember_backend.log.graphs])  # no title
        assert any(g.layout.get("conversions") for g in compiled._ember_backend.log.graphs)
    assert len(programs[0]) == 2 and programs[0] == programs[1]


@pytest.mark.slow
def test_torchvision_resnet18_small_training_matches_eager() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    exact = _train_step_float64(copy.deepcopy(model), x)
    # At 32x32 resnet18's weights outweigh its activations: force the layout to test it.
    with strict_env(), config.patch(layout_min_activation_to_weight=0.0):
        # Batch 4: at batch 2 the last stage normalises 2 values per channel and even eager's
        # fp32 rounding flips ReLU masks (see tests/models/test_seed_models.py).
        want, got, compiled = _train_step(model, x)
    assert any(g.layout.get("conversions") for g in compiled._ember_backend.log.graphs)
    # Summation order differs between layouts and kernels (conv1's weight gradient, |g| up to ~220,
    # is ~0.011 off float64 in eager fp32): each tensor's largest error against float64 may be at
    # most 4x eager's, or 1e-5 of its largest value; every layout must match eager's exactly.
    (wo, wg, wx, _), (go, gg, gx, _), (eo, eg, ex) = want, got, exact
    for what, a, b, ref in [("output", go[0], wo[0], eo), ("grad of input", gx, wx, ex),
                            *((f"grad {i}", x, y, r) for i, (x, y, r) in enumerate(zip(gg, wg, eg)))]:
        err, eager_err = ((t.double() - ref).abs().max().item() for t in (a, b))
        assert err <= max(4 * eager_err, 1e-5 * ref.abs().max().item()), f"{what}: error {err} vs eager's {eager_err}"
        assert _same_strides(a, b), f"{what}: strides {a.stride()} vs eager {b.stride()}"


def _train_step_float64(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
    """_train_step's eager step in float64: the output, parameter gradients and input gradient."""
    model = model.double()
    xi = x.double().requires_grad_(True)
    out = model(xi)
    torch.manual_seed(1)
    (out * torch.randn(out.shape).double()).sum().backward()
    return out, [p.grad for p in model.parameters()], xi.grad


# -- generated kernels on channels_last tensors -------------------------------------------------

@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 4), c=st.integers(1, 9), h=st.integers(1, 6), w=st.integers(1, 6),
       channels_last=st.booleans(), relu=st.booleans(), reduce=st.sampled_from(["sum", "amax", "amin", "mean"]))
def test_split_batch_norm_and_reductions_match_eager(split_reductions: None, n: int, c: int, h: int, w: int,
                                                     channels_last: bool, relu: bool, reduce: str) -> None:
    """Batch norm forward and backward plus a plain per-channel reduction, with every looped
    reduction split into chunks (partials in a workspace, then combined)."""
    assume(n * h * w > 1)  # eager's batch norm needs two values per channel
    layout = "channels_last" if channels_last else "contiguous"
    x = make_input((n, c, h, w), layout, requires_grad=True)
    weight, bias = torch.randn(c, requires_grad=True), torch.randn(c, requires_grad=True)
    op = getattr(torch, reduce)

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = nn.functional.batch_norm(x, None, None, weight, bias, training=True)
        return (torch.relu(y) if relu else y), op(x * 1.5, (0, 2, 3))

    with strict_env(looped=True):
        compiled = ember.compile(fn, target="triton-interpret")
        want, got = fn(x, weight, bias), compiled(x, weight, bias)
        for g, wv in zip(got, want):
            assert_close(g, wv, norm_rtol=1e-5)
            assert _same_strides(g, wv)
        cot = torch.randn(want[0].shape)
        gw = torch.autograd.grad(want[0], (x, weight, bias), cot)
        gg = torch.autograd.grad(got[0], (x, weight, bias), cot)
        for a, b in zip(gg, gw):
            assert_close(a, b, norm_rtol=1e-4)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_resnet_block_with_split_reductions(split_reductions: None, memory_format: torch.memory_format) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=memory_format)
    with strict_env(looped=True):
        want, got, compiled = _train_step(Block(), x)
    _compare(want, got)
    assert "ember_part1_" in kernel_text(compiled)


class PaddedConvs(nn.Module):
    """Style-transfer-like layers: reflection (or replication) padding before each convolution,
    instance norm and ReLU between them."""

    def __init__(self, pad: type[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(pad(2), nn.Conv2d(3, 6, 5), nn.InstanceNorm2d(6, affine=True), nn.ReLU(),
                                  pad((1, 2, 0, 1)), nn.Conv2d(6, 4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _padded_conv_graphs(pad: type[nn.Module]) -> dict:
    torch.manual_seed(0)
    with strict_env():
        want, got, compiled = _train_step(PaddedConvs(pad), torch.randn(2, 3, 9, 7))
    _compare(want, got)
    graphs = {g.kind: g for g in compiled._ember_backend.log.graphs}
    # Conversions: the (smaller) input of the first padding, and the incoming gradient; none between layers.
    fw, bw = graphs["forward"].layout["conversions"], graphs["backward"].layout["conversions"]
    assert [c.split(" ")[0] for c in fw if "-> channels_last" in c] == ["primals_1"], fw
    assert [c.split(" ")[0] for c in bw if "-> channels_last" in c] == ["tangents_1"], bw
    return graphs


def test_replication_padding_runs_over_the_nhwc_view_without_copies() -> None:
    # ATen's 2-D padding ops and their backward run as the 3-D ops over the NHWC view of
    # channels_last tensors: same values and gradients as eager, and no conversions around them.
    graphs = _padded_conv_graphs(nn.ReplicationPad2d)
    for kind, n in (("forward", 2), ("backward", 1)):
        # Every padding but the first's backward (it reads the NCHW input as its shape).
        g = graphs[kind]
        suffix = "" if kind == "forward" else "_backward"
        rewritten = [c for c in g.layout["conversions"] if "3-D form over the NHWC view" in c]
        assert len(rewritten) == n, g.layout["conversions"]
        fallback = g.placement["fallback"]
        assert fallback[f"aten.replication_pad3d{suffix}"] == n and fallback.get(f"aten.replication_pad2d{suffix}", 0) \
            == 2 - n, fallback


def test_reflection_padding_runs_in_embers_kernels_in_the_layout_it_is_given() -> None:
    # Ember's gather kernels (ops/reflection_pad.py) take channels_last as it is: no ATen
    # padding op is left and nothing is converted around the padded layers.
    graphs = _padded_conv_graphs(nn.ReflectionPad2d)
    for kind in ("forward", "backward"):
        fallback = graphs[kind].placement["fallback"]
        suffix = "" if kind == "forward" else "_backward"
        assert fallback.get(f"ember.reflection_pad2d{suffix}") == 2, fallback
        assert not [op for op in fallback if op.startswith("aten.reflection")], fallback


@pytest.mark.parametrize("target,args", [
    (torch.ops.aten.select.int, (2, 1)), (torch.ops.aten.select.int, (-1, -2)), (torch.ops.aten.select.int, (0, 0)),
    (torch.ops.aten.unsqueeze.default, (2,)), (torch.ops.aten.unsqueeze.default, (-1,)),
    (torch.ops.aten.unsqueeze.default, (4,)), (torch.ops.aten.permute.default, ([0, 2, 3, 1],)),
    (torch.ops.aten.alias.default, ()),
])
def test_simple_views_get_atens_strides_without_a_dispatch(target, args) -> None:
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        base = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)[:, :, 1:]  # offset, NHWC strides
        want = target(base, *args)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = base
    node = graph.call_function(target, (x, *args))
    with mode:
        stale = torch.empty_strided(tuple(want.shape), tuple(reversed(range(1, want.dim() + 1))))  # any strides
    got = layout._view_val(node, stale, mode)
    assert got is not None and got.shape == want.shape
    assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
    assert got.untyped_storage()._cdata == base.untyped_storage()._cdata  # still a view of its base


class WideConvs(nn.Module):
    """Convolution weights far larger than their batch-1 activations."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x))).relu()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_weights_count_against_channels_last_only_where_converted_per_call(autocast: bool) -> None:
    # fp32: cuDNN would convert each NCHW weight on every call, outweighing the activations: NCHW
    # kept. Under autocast the weights are casts, which write channels_last themselves: converted.
    torch.manual_seed(0)
    model = WideConvs().eval()
    x = torch.randn(1, 3, 4, 4)
    with strict_env(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = model(x)
        compiled = ember.compile(model, target="triton-interpret")
        got = compiled(x)
    assert_close(got.float(), want.float(), norm_rtol=3e-2 if autocast else 1e-4)
    layout_record = next(g for g in compiled._ember_backend.log.graphs if g.kind == "inference").layout
    if autocast:
        assert "skipped" not in layout_record
        assert sum("its cast writes it" in c for c in layout_record["conversions"]) == 2, layout_record
    else:
        assert "NCHW kept" in layout_record["skipped"], layout_record
