"""Whole-call programs (runtime/cudagraphs/whole_call.py) on the CPU stand-in of CUDA graphs: a
replay reruns the captured call on the capture's buffers and writes the captured outputs, so a
replay that should not have happened (a stale graph) gives the capture's answer, not eager's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ember
from ember.capture.dynamo_frames import FrameLocals, cache_entries

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from cudagraph_fakes import FakeGraphs  # noqa: E402


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.scale = 1.0  # a Python attribute forward reads: Dynamo guards it

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(y) * self.scale + shift


def _whole(model: nn.Module) -> tuple[nn.Module, object]:
    torch._dynamo.reset()
    compiled = ember.compile(model, whole_call=True, warm_start=False, target="aten")
    whole = compiled._ember_backend.whole_call
    whole.backend = FakeGraphs()
    return compiled, whole


def _agree(compiled: nn.Module, model: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    with torch.no_grad():
        out, ref = compiled(*args, **kwargs), model(*args, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    return out


def test_replays_match_eager_and_hand_out_copies() -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    compiled, whole = _whole(model)
    kept = [(_agree(compiled, model, x), x) for x in (torch.randn(2, 3, 8, 8) for _ in range(6))]
    assert whole.captures == 1 and whole.replays == 4, whole.describe()
    with torch.no_grad():
        for out, x in kept:  # a later replay overwrote none of them
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert "4 replayed" in whole.describe()


def test_changes_under_a_graph_run_the_normal_path_and_capture_again() -> None:
    torch.manual_seed(1)
    model = ConvNet().eval()
    compiled, whole = _whole(model)
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    replays = whole.replays
    model.scale = 2.0  # Dynamo's guard on the attribute fails
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    with torch.no_grad():
        model.fc.weight.mul_(3.0)  # in place: same address, new version
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    model.fc.weight = nn.Parameter(torch.randn(5, 8))  # replaced: a registration
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    model.fc.weight.data = torch.randn(5, 8)  # moved
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    text = whole.describe()
    assert whole.replays > replays
    for reason in ("guards of the captured frame fail", "changed in place", "was replaced", "moved"):
        assert reason in text, text


class Heads(nn.Module):
    """Several outputs in a dict: a transposed one, an integer one, a Python scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.fc(x)
        return {"y": y, "t": (y * 2).t(), "top": y.argmax(-1), "rows": 3, "z": torch.tanh(y)}


def test_several_outputs_are_copied_together_and_keep_their_layout() -> None:
    torch.manual_seed(7)
    model = Heads().eval()
    compiled, whole = _whole(model)
    kept = []
    for _ in range(6):
        x = torch.randn(5, 6)
        with torch.no_grad():
            out, ref = compiled(x), model(x)
        assert out.keys() == ref.keys() and out["rows"] == 3
        for key in ("y", "t", "top", "z"):
            assert out[key].dtype == ref[key].dtype and out[key].stride() == ref[key].stride(), key
            torch.testing.assert_close(out[key], ref[key], rtol=1e-4, atol=1e-5)
        kept.append((out, x))
    assert whole.replays == 4, whole.describe()
    with torch.no_grad():
        for out, x in kept:  # each call's outputs are its own: later replays overwrote none
            torch.testing.assert_close(out["z"], model(x)["z"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out["t"], model(x)["t"], rtol=1e-4, atol=1e-5)


class SlicedLayers(nn.Module):
    """Builds a module on every call, as Hugging Face's Llama does (``self.layers[: n]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.n = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.n]:
            x = torch.relu(layer(x))
        return x


def test_a_forward_that_builds_modules_compiles_once_and_replays() -> None:
    torch.manual_seed(8)
    model = SlicedLayers().eval()
    compiled, whole = _whole(model)
    for _ in range(6):
        _agree(compiled, model, torch.randn(4, 6))
    assert whole.replays == 4, whole.describe()
    assert len(cache_entries(type(model).forward)) == 1  # the registration count is no guard
    plain = torch.compile(SlicedLayers().eval(), backend="eager")  # nor for other compiled models
    with torch.no_grad():
        plain(torch.randn(4, 6))
        entries = len(cache_entries(SlicedLayers.forward))
        for _ in range(4):
            plain(torch.randn(4, 6))
    assert len(cache_entries(SlicedLayers.forward)) == entries


def test_call_forms_each_get_a_graph() -> None:
    torch.manual_seed(2)
    model = ConvNet().eval()
    compiled, whole = _whole(model)
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
        _agree(compiled, model, torch.randn(1, 3, 8, 8), shift=0.5)  # another shape, a keyword scalar
    assert len(whole.graphs) == 2 and whole.replays >= 2, whole.describe()


def test_gradients_on_run_the_normal_path() -> None:
    torch.manual_seed(3)
    model = ConvNet().eval()
    compiled, whole = _whole(model)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(4):
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        assert out.requires_grad
    assert whole.replays == 0 and "gradients are on" in whole.describe()


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent Python: a graph break, decided anew each call
            return y * 2
        return -y


class WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return self.fc(x)


class ReturnsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), x


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1.0)
        return self.fc(x) + self.calls


@pytest.mark.parametrize(("make", "reason"), [(Breaks, "graph break"), (WritesInput, "writes its inputs"),
                                              (ReturnsInput, "an output is (a view of) an input"),
                                              (CountsCalls, "writes the model's parameters or buffers")])
def test_refused_calls_stay_correct_and_say_why(make: type, reason: str) -> None:
    torch.manual_seed(4)
    model = make().eval()
    twin = make().eval()
    twin.load_state_dict(model.state_dict())
    compiled, whole = _whole(model)
    for k in range(5):
        x = torch.randn(3, 4) * (1 if k % 2 else -1)
        x_ref = x.clone()
        with torch.no_grad():
            out, ref = compiled(x), twin(x_ref)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x, x_ref)  # the caller's input written exactly as eager writes it
    assert whole.replays == 0 and reason in whole.describe(), whole.describe()


def test_hugging_face_model_outputs_and_config_flags() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(cfg).eval()
    compiled, whole = _whole(model)
    for _ in range(5):
        ids = torch.randint(0, 100, (1, 12))
        with torch.no_grad():
            out, ref = compiled(ids), model(ids)
        assert type(out) is type(ref)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    assert whole.replays >= 2, whole.describe()
    model.config.output_hidden_states = True  # read by forward: the output gains hidden_states
    for _ in range(4):
        ids = torch.randint(0, 100, (1, 12))
        with torch.no_grad():
            out, ref = compiled(ids), model(ids)
        assert len(out.hidden_states) == len(ref.hidden_states) == 3
        torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], rtol=1e-4, atol=1e-5)


def test_frame_locals_bind_like_the_call() -> None:
    def outer(func):  # a decorator's wrapper: *args, **kwargs and a closure variable
        def wrapper(self, *args, flag=True, **kwargs):
            return func(self, *args, **kwargs)
        return wrapper

    def forward(self, x, y=2, *rest, z=3, **extra):
        return x

    plain, wrapped = FrameLocals(forward), FrameLocals(outer(forward))
    assert plain("m", (1,), {}) == {"self": "m", "x": 1, "y": 2, "rest": (), "z": 3, "extra": {}}
    assert plain("m", (1, 5, 6, 7), {"z": 0, "w": 9}) == {"self": "m", "x": 1, "y": 5, "rest": (6, 7), "z": 0,
                                                          "extra": {"w": 9}}
    assert plain("m", (1,), {"y": 4}) == {"self": "m", "x": 1, "y": 4, "rest": (), "z": 3, "extra": {}}
    got = wrapped("m", (1, 2), {"k": 3})
    assert got == {"self": "m", "args": (1, 2), "flag": True, "kwargs": {"k": 3}, "func": forward}
    with pytest.raises(TypeError):
        plain("m", (), {})  # x missing: the forward's own call would raise too


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.split = False  # True: a graph break in the middle of forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.split:
            torch._dynamo.graph_break()
        return torch.relu(y) * 3


def test_a_frame_that_cannot_be_replayed_leaves_the_others_replayed() -> None:
    torch.manual_seed(6)
    model = Switch().eval()
    compiled, whole = _whole(model)
    for _ in range(4):
        _agree(compiled, model, torch.randn(3, 4))
    model.split = True
    for _ in range(5):
        _agree(compiled, model, torch.randn(3, 4))
    assert "graph break" in whole.describe() or "no compiled graph" in whole.describe(), whole.describe()
    replays = whole.replays
    model.split = False
    for _ in range(4):
        _agree(compiled, model, torch.randn(3, 4))
    assert whole.replays > replays and whole.disabled is None, whole.describe()


def test_the_compiled_module_keeps_its_hooks_and_state() -> None:
    torch.manual_seed(7)
    model = ConvNet().eval()
    compiled, whole = _whole(model)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert list(compiled.state_dict()) == [f"_orig_mod.{k}" for k in model.state_dict()]  # as torch.compile's
    for _ in range(4):
        _agree(compiled, model, torch.randn(2, 3, 8, 8))
    seen = []
    handle = compiled.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    _agree(compiled, model, torch.randn(2, 3, 8, 8))  # through OptimizedModule.__call__: the hook runs
    handle.remove()
    _agree(compiled, model, torch.randn(2, 3, 8, 8))
    assert seen == [torch.Size([2, 5])] and whole.replays >= 3, whole.describe()
