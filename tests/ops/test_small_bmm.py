"""Batched products of small unaligned matrices through Ember's Triton kernel (ops/small_bmm.py,
passes/small_bmm.py), run by Triton's interpreter on CPU tensors: the kernel against ATen's bmm
over sizes, strides (transposed and broadcast operands) and dtypes; the rule; torchvision's Swin
window attention trained through ``ember.compile`` against eager; the compile jobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.models.swin_transformer import ShiftedWindowAttention

import ember
from ember import config
from ember.ops import small_bmm


def _operand(shape: tuple[int, int, int], transposed: bool, broadcast: bool, dtype: torch.dtype,
             g: torch.Generator) -> torch.Tensor:
    b, r, c = shape
    base = torch.randn(1 if broadcast else b, *((c, r) if transposed else (r, c)), generator=g).to(dtype)
    t = base.transpose(1, 2) if transposed else base
    return t.expand(b, r, c)


@st.composite
def products(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    b, m, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 70)), draw(st.integers(1, 70)), draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    a = _operand((b, m, k), draw(st.booleans()), draw(st.booleans()), dtype, g)
    bm = _operand((b, k, n), draw(st.booleans()), draw(st.booleans()), dtype, g)
    return a, bm


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    got = small_bmm.small_bmm(a, b)
    exact = torch.bmm(a.double(), b.double())
    assert got.dtype == a.dtype and got.shape == exact.shape and got.is_contiguous()
    # float32 sums rounded once: within one unit in the last place of the dtype (the interpreter
    # truncates bfloat16, so one whole unit; rounding would give half).
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[a.dtype]
    scale = a.double().abs().bmm(b.double().abs())
    err = (got.double() - exact).abs()
    assert bool((err <= ulp * exact.abs() + 1e-5 * scale + 1e-6).all()), float((err - ulp * exact.abs()).max())


@settings(max_examples=40, deadline=None)
@given(products())
def test_kernel_matches_bmm(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    _check(*case)


@pytest.mark.parametrize("m,k,n", [(49, 32, 49), (49, 49, 32), (32, 49, 49), (100, 200, 70), (128, 256, 9)])
def test_window_attention_sizes_and_two_tiles_a_side(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k + n)
    _check(torch.randn(3, m, k, generator=g).bfloat16(), torch.randn(3, k, n, generator=g).bfloat16())


@pytest.mark.parametrize("why", ["aligned", "float32", "mixed", "too_wide", "too_deep", "two_dims", "empty",
                                 "symbolic"])
def test_what_the_rule_does_not_take_stays_cublas(why: str) -> None:
    a, b = torch.empty(4, 49, 32, dtype=torch.bfloat16), torch.empty(4, 32, 49, dtype=torch.bfloat16)
    assert small_bmm.takes(a, b)
    if why == "aligned":  # cuBLAS's vector kernels take it
        a, b = torch.empty(4, 48, 32, dtype=torch.bfloat16), torch.empty(4, 32, 56, dtype=torch.bfloat16)
    elif why == "float32":
        a, b = a.float(), b.float()
    elif why == "mixed":
        b = b.half()
    elif why == "too_wide":
        a = torch.empty(4, 129, 32, dtype=torch.bfloat16)
    elif why == "too_deep":
        a, b = torch.empty(4, 49, 65, dtype=torch.bfloat16), torch.empty(4, 65, 49, dtype=torch.bfloat16)
    elif why == "two_dims":
        a, b = a[0], b[0]
    elif why == "empty":
        a, b = torch.empty(0, 49, 32, dtype=torch.bfloat16), torch.empty(0, 32, 49, dtype=torch.bfloat16)
    else:  # a dynamic batch: a fake tensor with a symbolic size
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        mode = FakeTensorMode(shape_env=ShapeEnv())
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC])
        a, b = (mode.from_tensor(t, symbolic_context=context) for t in (a, b))
        assert not isinstance(a.shape[0], int)
    assert not small_bmm.takes(a, b)


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_swin_window_attention_trains_like_eager() -> None:
    # torchvision's shifted window attention, bfloat16 weights: 7x7 windows of 49 tokens, heads of 8.
    torch.manual_seed(6)
    reference = ShiftedWindowAttention(16, [7, 7], [3, 3], num_heads=2)
    eager = ShiftedWindowAttention(16, [7, 7], [3, 3], num_heads=2).bfloat16()
    model = ShiftedWindowAttention(16, [7, 7], [3, 3], num_heads=2).bfloat16()
    eager.load_state_dict(reference.state_dict())
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 14, 14, 16)
    want, want_grads = _train_step(reference, x)
    bf16, bf16_grads = _train_step(eager, x.bfloat16())
    with config.patch(small_bmm=True):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        got, got_grads = _train_step(compiled, x.bfloat16())
    # Ember's bfloat16 step stays as close to float32 eager as eager's bfloat16 step, within 3x.
    for g, b, w in zip([got, *got_grads], [bf16, *bf16_grads], [want, *want_grads]):
        eager_err = (b.float() - w).abs().max().item()
        assert (g.float() - w).abs().max().item() <= 3 * eager_err + 1e-3
    programs = {g.kind: g.program for g in compiled._ember_backend.log.graphs}
    calls = [programs[kind].count("torch.ops.ember.small_bmm.default") for kind in ("forward", "backward")]
    assert calls == [2, 4]


def test_the_switch_keeps_every_product_on_cublas() -> None:
    from ember.passes import PassContext, passes_for

    def names() -> list[str]:
        return [p.__name__ for p in passes_for(PassContext("backward", "triton", set()))]

    with config.patch(small_bmm=True):
        assert "generate_small_bmms" in names()
    with config.patch(small_bmm=False):
        assert "generate_small_bmms" not in names()


def test_the_compile_jobs_follow_the_graphs_shapes() -> None:
    from torch._subclasses import FakeTensorMode

    from ember.runtime import precompile

    with FakeTensorMode():
        a = torch.empty(6, 49, 32, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(6, 49, 32, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        gm = torch.fx.symbolic_trace(lambda x, y: torch.ops.ember.small_bmm.default(x, y))
        for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], (a, b)):
            node.meta["val"] = value
        call = next(n for n in gm.graph.nodes if n.op == "call_function")
        call.meta["val"] = c = small_bmm.small_bmm(a, b)
    (job,) = small_bmm.compile_jobs(gm)
    meta = dict(job.meta)
    assert meta == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "UPCAST": False}
    ints = [49, 49, 32, 1, 1, *a.stride(), *b.stride(), *c.stride()]
    assert list(job.arg_dtypes[3:]) == [precompile.int_arg(v) for v in ints]
    fn = small_bmm._kernels(False).small_bmm
    assert len(job.arg_dtypes) == len([p for p in fn.params if not p.is_constexpr])
