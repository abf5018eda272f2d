"""bfloat16 in Ember's generated CPU (numba) kernels, against eager PyTorch.

The kernels follow the Triton generator's semantics: values are float32 inside a kernel, loads
widen bfloat16 exactly, stores (and explicit casts to bfloat16) round to nearest even, and
reductions accumulate in float32 or wider. Ember therefore rounds once per kernel where eager
rounds after every op: outputs are compared with eager at bfloat16 tolerance AND with the float32
computation of the same function, where Ember must be at least about as exact as eager.

Covered: pointwise chains mixing bfloat16 and float32 with casts both ways, rounding bit for bit
(fixed ties, overflow, subnormals, and a hypothesis property over random float32 bit patterns),
NaN/inf propagation, row reductions (softmax, layer norm), column sums, batch-norm training
statistics, that bfloat16 groups really run as generated CPU kernels (ember.explain), and whole
small models under ``torch.autocast("cpu", dtype=torch.bfloat16)``, forward and backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cpu_fixtures import compiled_graphs, cpu_env, shared_cache  # noqa: F401 (fixtures, used by name)
from ember_check import layouts, make_input, shapes
from hypothesis import given, settings
from hypothesis import strategies as st

import ember
from ember import config

pytest.importorskip("numba")
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

BF16 = torch.bfloat16
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def _assert_generated(graphs: list) -> None:
    """Every graph compiled for the CPU target, with generated kernels and no group left on ATen."""
    assert graphs, "nothing was compiled"
    for g in graphs:
        assert g.error is None, f"{g.title}: {g.error}"
        assert g.target == "cpu", g.target
        assert not g.placement.get("fused-aten"), f"{g.title}: groups on ATen {dict(g.fallback_reasons)}"
    assert sum(g.kernels for g in graphs) >= 1, "no generated kernel"


def _as_float32(a: object) -> object:
    return a.float() if isinstance(a, torch.Tensor) and a.dtype == BF16 else a


def _outputs(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _rel_err(t: torch.Tensor, ref: torch.Tensor) -> float:
    finite = ref.isfinite()
    diff = (t.double() - ref.double())[finite]
    return (diff.norm() / ref.double()[finite].norm().clamp_min(1e-12)).item()


def _near(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())  # infinities and NaN where the other has them
    return same | ((a - b).abs() <= BF16_TOL["atol"] + BF16_TOL["rtol"] * b.abs())


def assert_near(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """Each element within bfloat16 tolerance of eager, or of the float32 computation where
    eager's rounding after every op lost more (a difference of rounded values cancels)."""
    ok = _near(got, want) | _near(got, exact)
    bad = (~ok).nonzero()[:4].tolist()
    assert not bad, (f"{what}: {int((~ok).sum())} of {ok.numel()} elements off, e.g. at {bad}: "
                     f"{[got[tuple(i)].item() for i in bad]} vs eager {[want[tuple(i)].item() for i in bad]}, "
                     f"float32 {[exact[tuple(i)].item() for i in bad]}")


def check_bf16(fn: Callable, args: Sequence[object], reference: Callable | None = None) -> Callable:
    """``fn(*args)`` eagerly and through Ember's CPU kernels: the same dtypes, NaN/inf at the
    same places, values within bfloat16 tolerance of eager, and (in norm) at least as close to the
    float32 computation (``reference``, by default ``fn`` on float32 copies of the bf16 args) as
    eager is, up to bfloat16 rounding."""
    torch._dynamo.reset()
    compiled = ember.compile(fn, target="cpu")
    got, want = _outputs(compiled(*args)), _outputs(fn(*args))
    ref = _outputs((reference or fn)(*[_as_float32(a) for a in args]))
    for i, (g, w, r) in enumerate(zip(got, want, ref)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert_near(g, w, r, f"output {i}")
        if r.is_floating_point():
            ember_err, eager_err = _rel_err(g, r), _rel_err(w, r)
            assert ember_err <= 1.5 * eager_err + 4e-3, f"output {i}: error vs float32 {ember_err:.3g} > eager {eager_err:.3g}"
    _assert_generated(compiled_graphs(compiled))
    return compiled


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == BF16 else t.view(torch.int32)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that a NaN only has to be a NaN (eager's vectorised and scalar
    conversions themselves write different NaN patterns)."""
    assert got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN positions differ"
    differ = (_bits(got) != _bits(want)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} values differ, e.g. {got[differ][:4]} vs {want[differ][:4]}"


# -- pointwise ---------------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_pointwise_chain_mixed_bf16_float32(data) -> None:
    shape = data.draw(shapes(max_rank=4, max_numel=2048))
    x = make_input(shape, dtype=BF16, **data.draw(layouts(shape)))
    y = make_input(shape, **data.draw(layouts(shape)))  # float32
    scale = data.draw(st.floats(-3, 3, allow_nan=False, width=32))

    def fn(x, y):
        h = torch.relu(x * scale + y.to(BF16)) - torch.sigmoid(x)  # bf16 ops; a cast down
        z = h.float() * y + torch.exp(x.float() * 0.5)  # casts up, float32 math
        return h, z, (z * 0.25).to(BF16) + x  # a float32 result cast down, then bf16 math

    check_bf16(fn, [x, y])


def test_unary_math_and_broadcast_scalars() -> None:
    x = torch.randn(37, 53).to(BF16) * 3
    w = torch.randn(53)  # float32 row, broadcast
    check_bf16(lambda x, w: (torch.tanh(x) * torch.erf(x), torch.sqrt(x.abs() + 1) * w, F.gelu(x), F.silu(x)),
               [x, w])


def _special_float32() -> torch.Tensor:
    """Exact ties (low half 0x8000) with even and odd kept bits, one ulp either side, the largest
    floats (which round to inf), subnormals, signed zeros and infinities, random values."""
    bits = []
    for hi in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0001, 0x0002, 0x7F7F, 0xFF7F, 0x4049, 0x0080):
        for lo in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            bits.append((hi << 16) | lo)
    bits += [0x7F7FFFFF, 0x00000001, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000]
    special = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    return torch.cat([special, torch.randn(203) * 100])


def test_cast_to_bf16_rounds_to_nearest_even_bit_for_bit() -> None:
    x = _special_float32()

    def fn(x):
        y = x * 1.0
        return y.to(BF16), y.to(BF16).to(torch.float32) * 1.0  # stored as bf16; rounded, then back

    compiled = ember.compile(fn, target="cpu")
    got = compiled(x)
    want = fn(x)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])
    assert got[0].view(torch.int16)[2].item() == 0x3F80  # 1 + half an ulp: tie to even (down)
    assert got[0].view(torch.int16)[7].item() == 0x3F82  # 0x3F81 + half an ulp: tie to even (up)
    _assert_generated(compiled_graphs(compiled))
    src = "\n".join(s for g in compiled_graphs(compiled) for s in g.kernel_sources.values())
    assert "_round_bf16(" in src and "_f32_to_bf16(" in src


_ROUNDING: list[Callable] = []


def _rounding_kernel() -> Callable:
    """One compiled cast kernel for every hypothesis example (a fixed size: no recompiles)."""
    if not _ROUNDING:
        _ROUNDING.append(ember.compile(lambda x: (x * 1.0).to(BF16), target="cpu"))
    return _ROUNDING[0]


@settings(max_examples=30, deadline=None)
@given(bits=st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=256, max_size=256))
def test_bf16_store_of_random_float32_bits_matches_torch(bits: list[int]) -> None:
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    assert_same_bits(_rounding_kernel()(x), (x * 1.0).to(BF16))


def test_nan_and_inf_propagate() -> None:
    x = torch.randn(16, 40).to(BF16)
    specials = [float("nan"), float("inf"), -float("inf")]
    for k, (i, j) in enumerate([(0, 3), (5, 0), (9, 39), (15, 17), (2, 2), (11, 30)]):
        x[i, j] = specials[k % 3]

    def fn(x):
        return (x * 2 + 1).relu(), torch.exp(x), x.amax(-1), x.amin(0), x.sum(0), torch.softmax(x, -1)

    compiled = check_bf16(fn, [x])
    got = compiled(x)
    assert got[2].isnan()[0] and got[3].isnan()[3] and got[5].isnan()[0].all()


# -- reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(6, 24, 96), (3, 3000)])
def test_softmax_rows(dims: tuple[int, ...]) -> None:
    """Short rows are persistent (exp kept in scratch); long rows loop (float64 blocks)."""
    x = torch.randn(*dims).to(BF16) * 3
    check_bf16(lambda x: (torch.softmax(x * 0.125, -1), torch.log_softmax(x, -1)), [x])


@pytest.mark.parametrize("param_dtype", [BF16, torch.float32])
def test_layer_norm(param_dtype: torch.dtype) -> None:
    x = torch.randn(4, 19, 192).to(BF16) * 2 + 0.5
    w, b = (torch.rand(192) + 0.5).to(param_dtype), torch.randn(192).to(param_dtype)
    if param_dtype == torch.float32:  # eager's layer norm wants one dtype: cast the input up as autocast does
        check_bf16(lambda x, w, b: F.layer_norm(x.float(), (192,), w, b).to(BF16), [x, w, b])
    else:
        check_bf16(lambda x, w, b: F.layer_norm(x, (192,), w, b), [x, w, b])


@pytest.mark.parametrize("batch", [7, 600])
def test_column_sums_over_batch(batch: int) -> None:
    """A [B, C] reduction over B: the kept dim is innermost in memory (column layout)."""
    x = (torch.randn(batch, 96) + 2).to(BF16)
    compiled = check_bf16(lambda x: (x.sum(0), x.mean(0), x.amax(0), (x.float() * x.float()).sum(0)), [x])
    assert any("layout columns" in s for g in compiled_graphs(compiled) for s in g.kernel_sources.values())


@pytest.mark.parametrize("memory", ["nchw", "channels_last"])
def test_batch_norm_training_statistics(memory: str) -> None:
    x = (torch.randn(6, 12, 9, 9) * 2 + 0.5).to(BF16)
    if memory == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = (torch.rand(12) + 0.5).to(BF16), torch.randn(12).to(BF16)

    def fn(x, w, b):
        return F.relu(F.batch_norm(x, None, None, w, b, training=True))

    compiled = check_bf16(fn, [x, w, b])
    layout = "rows" if memory == "nchw" else "columns"
    assert any(f"layout {layout}" in s for g in compiled_graphs(compiled) for s in g.kernel_sources.values())


@config.patch(target="cpu")
def test_bf16_groups_are_generated_cpu_kernels() -> None:
    """ember.explain on the CPU target: every bfloat16 group became a generated kernel (reading
    and writing 16-bit data), none ran op by op through ATen."""
    x = torch.randn(8, 64).to(BF16).requires_grad_()
    w = torch.randn(64).to(BF16)
    report = ember.explain(lambda x, w: torch.softmax(x * w, -1) + F.gelu(x), x, w)
    graphs = report.log.graphs
    _assert_generated(graphs)
    assert {g.kind for g in graphs} == {"forward", "backward"}
    sources = [s for g in graphs for s in g.kernel_sources.values()]
    assert all("_p_u16(" in s for s in sources), "a kernel without bfloat16 tensors"
    assert not any("bfloat16" in r for g in graphs for r in g.fallback_reasons)


# -- models under autocast ------------------------------------------------------------------------

class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(h.mean((2, 3)))


class _TransformerLayer(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ff1, self.ff2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (s.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for s in self.qkv(self.ln1(x)).split(d, -1))
        att = torch.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5, -1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


def _autocast_step(model: nn.Module, fn: Callable, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = fn(x)
    out.float().square().mean().backward()
    return out.detach().float()


@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_model_under_autocast_forward_backward(name: str) -> None:
    """Ember vs eager, both under bf16 autocast; each against the float32 model: output and every
    parameter gradient within bf16 tolerance of eager and at least about as close to float32."""
    torch.manual_seed(0)
    model, x = (_ConvNet(), torch.randn(4, 3, 12, 12)) if name == "convnet" else \
        (_TransformerLayer(), torch.randn(2, 16, 32))
    ref, eager, ours = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    compiled = ember.compile(ours, target="cpu")
    results = {"float32": _autocast_step(ref, ref, x, False), "eager": _autocast_step(eager, eager, x, True),
               "ember": _autocast_step(ours, compiled, x, True)}
    errors = {"output": (results["ember"], results["eager"], results["float32"])}
    for (pname, p), pe, pr in zip(ours.named_parameters(), eager.parameters(), ref.parameters()):
        errors[f"grad {pname}"] = (p.grad, pe.grad, pr.grad)
    for what, (got, want, exact) in errors.items():
        ember_err, eager_err = _rel_err(got, exact), _rel_err(want, exact)
        assert ember_err <= 1.5 * eager_err + 4e-3, f"{what}: error vs float32 {ember_err:.3g}, eager {eager_err:.3g}"
        assert _rel_err(got, want) < 3e-2, f"{what}: {_rel_err(got, want):.3g} from eager autocast"
    graphs = compiled_graphs(compiled)
    _assert_generated(graphs)
    assert {g.kind for g in graphs} >= {"forward", "backward"}
    sources = "\n".join(s for g in graphs for s in g.kernel_sources.values())
    assert "_bf16_to_f32(" in sources and "_f32_to_bf16(" in sources, "no bfloat16 tensor in any kernel"
