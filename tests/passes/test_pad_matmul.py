"""Matmul padding (passes/pad_matmul.py, the rule in passes/matmul_padding_rule.py, ops/pad_zeros.py).

Three levels: the rule on dims alone; the pass on graphs traced with fake tensors (full-size GPT-2
shapes cost nothing there) and on small real graphs run before and after; and whole models through
``ember.compile`` on the Triton interpreter, forward and every gradient against eager, with the
pass forced on (``pad_matmul="always"``: the CPU has no TF32 and these matmuls are small).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from core_helpers import assert_close, check_against_eager, log_of
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.passes import PassContext, passes_for
from ember.passes.matmul_padding_rule import MatmulDims, decide
from ember.passes.pad_matmul import PADDING_META, pad_unaligned_matmuls

aten = torch.ops.aten
PAD = torch.ops.ember.pad_zeros.default
BF16 = torch.bfloat16


def no_copies(m: int, k: int, n: int) -> int:
    return 0


# -- the rule ------------------------------------------------------------------------------------

def test_rule_pads_a_language_model_head() -> None:
    head = MatmulDims(1, 8192, 768, 50257, BF16)  # GPT-2 small, batch 16 x 512 tokens
    d = decide(head, lambda m, k, n: 2 * (50257 * 768 * 2) + 2 * 8192 * 50257 * 2)
    assert d.pads and (d.m, d.k, d.n, d.align) == (8192, 768, 50264, 8)
    grad_input = MatmulDims(1, 8192, 50257, 768, torch.float16)  # the backward's K = vocabulary
    assert decide(grad_input, no_copies).k == 50264


@pytest.mark.parametrize("dims, why", [
    (MatmulDims(1, 8192, 768, 3072, BF16), "aligned"),
    (MatmulDims(1, 64, 768, 2, BF16), "to the work"),  # a classifier over 2 labels
    (MatmulDims(1, 96, 64, 1001, BF16), "small"),
    (MatmulDims(1, 8192, 768, 50257, torch.float32), "TF32"),
    (MatmulDims(1, 8192, 768, 50257, torch.int8), "not a tensor-core float"),
])
def test_rule_declines(dims: MatmulDims, why: str) -> None:
    d = decide(dims, no_copies, tf32=False)
    assert not d.pads and why in d.declined
    assert (d.m, d.k, d.n) == (dims.m, dims.k, dims.n)


def test_rule_weighs_the_bytes_it_copies() -> None:
    # 16 tokens through a large odd layer: padding K copies the whole weight for little compute.
    dims = MatmulDims(1, 16, 50257, 4096, BF16)
    weight_copy = 2 * 50257 * 4096 * 2
    d = decide(dims, lambda m, k, n: weight_copy, min_gflop=0.0)
    assert not d.pads and "FLOP per byte" in d.declined
    assert decide(dims, lambda m, k, n: weight_copy, mode="always").pads


def test_rule_float32_follows_tf32_and_modes() -> None:
    dims = MatmulDims(1, 8192, 768, 50257, torch.float32)
    assert decide(dims, no_copies, tf32=True).n == 50260  # 4 elements = 16 bytes
    assert decide(MatmulDims(1, 8, 8, 1001, torch.float32), no_copies, mode="always", tf32=False).n == 1004
    assert not decide(MatmulDims(1, 8192, 768, 50257, BF16), no_copies, mode="off").pads


# -- the pass on traced graphs ---------------------------------------------------------------------

def fake_trace(fn, *shapes_dtypes) -> fx.GraphModule:
    args = [torch.empty(s, dtype=d) for s, d in shapes_dtypes]
    return make_fx(fn, tracing_mode="fake")(*args)


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == target)


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def test_auto_pads_full_size_head_on_fake_tensors() -> None:
    gm = fake_trace(lm_head, ((16, 512, 768), BF16), ((50257, 768), BF16))
    assert pad_unaligned_matmuls(gm, "auto") == 1
    record = gm.meta[PADDING_META]
    assert record["padded"] == ["mm: mm N 50257->50264"]  # (no module here: the node's name)
    assert count(gm, PAD) == 1 and count(gm, aten.slice.Tensor) == 1
    # The weight is padded at its source (rows), the transposing view applied again.
    pad = next(n for n in gm.graph.nodes if n.target == PAD)
    assert pad.args[1] == [50264, 768]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].is_contiguous()  # the caller's logits keep eager's strides


def test_auto_declines_small_and_aligned_on_fake_tensors() -> None:
    small = fake_trace(lm_head, ((4, 6, 64), BF16), ((1001, 64), BF16))
    aligned = fake_trace(lm_head, ((16, 512, 768), BF16), ((3072, 768), BF16))
    assert pad_unaligned_matmuls(small, "auto") == 0
    assert pad_unaligned_matmuls(aligned, "auto") == 0
    assert count(small, PAD) == count(aligned, PAD) == 0
    assert any("small" in why for why in small.meta[PADDING_META]["declined"])
    assert aligned.meta[PADDING_META]["declined"] == {}  # aligned matmuls are not worth a line


def run_both(fn, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list, list]:
    gm = make_fx(fn, tracing_mode="fake")(*[torch.empty_like(x) for x in inputs])
    want = gm(*inputs)
    changed = pad_unaligned_matmuls(gm, "always")
    gm.recompile()
    assert changed
    got = gm(*inputs)
    return gm, list(want) if isinstance(want, tuple) else [want], list(got) if isinstance(got, tuple) else [got]


def test_bmm_odd_k_and_addmm_bias_same_results_and_strides() -> None:
    def fn(a, b, bias, x, w):
        return torch.bmm(a, b), torch.addmm(bias, x, w.t())

    inputs = [torch.randn(3, 24, 37), torch.randn(3, 37, 40), torch.randn(29), torch.randn(16, 13),
              torch.randn(29, 13)]
    gm, want, got = run_both(fn, *inputs)
    assert count(gm, PAD) == 5  # a, b (K); bias, x, w (K and N)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert_close(g, w, "padded matmul")


def test_one_padded_copy_serves_both_gradients() -> None:
    # The backward of a head: grad_input = g @ W (K = vocab), grad_weight = g^T @ x (M = vocab).
    def fn(g, w, x):
        return g @ w, g.t() @ x

    gm, want, got = run_both(fn, torch.randn(24, 1001), torch.randn(1001, 64), torch.randn(24, 64))
    pads = [n for n in gm.graph.nodes if n.target == PAD]
    assert sorted(tuple(p.args[1]) for p in pads) == [(24, 1004), (1004, 64)]  # g once, w once
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        assert_close(g, w, "gradient matmuls")


def test_view_the_sliced_result_no_longer_allows_becomes_reshape() -> None:
    def fn(x, w):
        return (x @ w).view(-1)

    gm, want, got = run_both(fn, torch.randn(8, 16), torch.randn(16, 1001))
    assert count(gm, aten.reshape.default) == 1
    assert_close(got[0], want[0], "flattened result")


# -- through ember.compile ---------------------------------------------------------------------

class Head(nn.Module):
    def __init__(self, vocab: int = 1001, bias: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(x)))


def pad_records(compiled) -> dict[str, dict]:
    return {g.kind: g.matmul_padding for g in log_of(compiled).graphs}


def test_compiled_head_matches_eager_and_reports_padding() -> None:
    model = Head()
    eager = copy.deepcopy(model)
    compiled = ember.compile(model, target="triton-interpret", pad_matmul="always")
    x = torch.randn(4, 6, 64)
    check_against_eager(compiled, eager, [x], params=[])
    got, want = compiled(x), eager(x)
    assert got.stride() == want.stride()  # the caller's logits are contiguous as in eager
    grads_want = torch.autograd.grad(want.square().sum(), list(eager.parameters()))
    grads_got = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    for g, w in zip(grads_got, grads_want):
        assert_close(g, w, "parameter gradient")
    records = pad_records(compiled)
    assert records["forward"]["padded"] == ["lm_head: mm N 1001->1004"]
    assert sorted(records["backward"]["padded"]) == ["lm_head: mm K 1001->1004", "lm_head: mm M 1001->1004"]
    text = str(ember.explain(ember.compile(copy.deepcopy(eager), target="triton-interpret", pad_matmul="always"),
                             x))
    assert "padded 1 matmul(s) to multiples of 4: lm_head: mm N 1001->1004" in text


def test_loss_inside_the_graph_reads_the_sliced_logits_bf16() -> None:
    torch.manual_seed(0)
    model = Head(vocab=501, bias=True).to(BF16)
    eager = copy.deepcopy(model)
    target = torch.randint(0, 501, (24,))

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits = m(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), target) + logits.reshape(-1)[:7].float().sum()

    compiled = ember.compile(lambda x: step(model, x), target="triton-interpret", pad_matmul="always")
    x = torch.randn(4, 6, 64, dtype=BF16)
    got = compiled(x)
    got.backward()
    want = step(eager, x)
    want.backward()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=3e-2, atol=3e-2, msg=name)
    records = pad_records(compiled)
    assert records["forward"]["padded"] == ["lm_head: addmm N 501->504"]
    assert records["forward"]["align"] == [8]


def test_declines_tiny_and_aligned_and_is_off_on_the_cpu_target() -> None:
    names = [p.__name__ for p in passes_for(PassContext("forward", "cpu", set()))]
    assert "pad_matmul_dims" not in names
    assert "pad_matmul_dims" in [p.__name__ for p in passes_for(PassContext("forward", "triton-interpret", set()))]
    assert "pad_matmul_dims" not in [p.__name__ for p in
                                     passes_for(PassContext("forward", "triton", set(), pad_matmul="off"))]
    x = torch.randn(4, 6, 64, dtype=BF16)
    tiny = ember.compile(Head().to(BF16), target="triton-interpret")  # auto: far too small to pay
    aligned = ember.compile(Head(vocab=1000).to(BF16), target="triton-interpret", pad_matmul="always")
    tiny(x).float().sum().backward()
    aligned(x).float().sum().backward()
    for compiled in (tiny, aligned):
        assert all(not r.get("padded") for r in pad_records(compiled).values())
    assert any("small" in why for why in pad_records(tiny)["forward"]["declined"])


def test_compiled_bmm_with_odd_k_matches_eager_with_gradients() -> None:
    compiled = ember.compile(torch.bmm, target="triton-interpret", pad_matmul="always")
    a, b = torch.randn(2, 24, 37), torch.randn(2, 37, 40)
    check_against_eager(compiled, torch.bmm, [a, b])
    records = pad_records(compiled)
    assert [p.split(": ", 1)[1] for p in records["forward"]["padded"]] == ["bmm K 37->40"]
    # grad_a = grad @ b^T has N = 37; grad_b = a^T @ grad has M = 37.
    assert sorted(p.split(": ", 1)[1] for p in records["backward"]["padded"]) == ["bmm M 37->40", "bmm N 37->40"]


def test_pad_zeros_keeps_the_source_layout() -> None:
    pad_zeros = torch.ops.ember.pad_zeros
    y = torch.randn(3, 7, 5).transpose(1, 2)  # a batch of transposed matrices
    out = pad_zeros(y, [3, 8, 8])
    assert out.stride() == (64, 1, 8)
    assert torch.equal(out[:, :5, :7], y) and not out[:, 5:].any() and not out[:, :, 7:].any()
    expanded = torch.randn(1, 5, 7).expand(3, 5, 7)
    assert pad_zeros(expanded, [3, 8, 8]).is_contiguous()
