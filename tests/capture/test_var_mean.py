"""var_mean's one-pass form (shifted sums, capture/var_mean.py) against eager and float64, on the
CPU (numba) target and the Triton path (interpreter): var_mean and training batch norm, forward,
gradients and running statistics, on data whose mean is large against its spread; the rule that
picks the form; and the kernels a split batch-norm forward takes with each form.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from core_helpers import log_of
from ember_check import assert_close
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember import config
from ember.capture.decompositions import decomposition_table
from ember.codegen.kernel_writer import reduction_levels
from ember.schedule.plan import plan_graph

aten = torch.ops.aten
TARGETS = ["cpu", "triton-interpret"]
# Small shapes: the rule's row threshold lowered to fit them (the default is 4096).
MIN_ROW = 256
# Tiny blocks and split reductions in the interpreter: the path a large GPU reduction takes.
SPLIT = {"interpret_split_target_programs": 64, "loop_rblock": 64, "persistent_rblock_max": 64}


@contextlib.contextmanager
def one_pass(enabled: bool | str = True, min_row: int = MIN_ROW, **extra):
    """The one-pass form for every dtype (``True``: ``always``), never (``False``) or by the rule's
    dtype test (``"auto"``, the default setting)."""
    mode = enabled if isinstance(enabled, str) else ("always" if enabled else "off")
    torch._dynamo.reset()
    try:
        with config.patch(strict=True, one_pass_var_mean=mode, one_pass_var_mean_min=min_row, **extra):
            yield
    finally:
        torch._dynamo.reset()


def data(shape: tuple[int, ...], offset: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = 0.1 if offset else 1.0
    return torch.randn(shape, generator=gen) * scale + offset


# -- var_mean ------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("offset", [0.0, 100.0])
@pytest.mark.parametrize("correction,keepdim", [(0, True), (1, False)])
def test_var_mean_forward_and_gradients_match_eager(target, offset, correction, keepdim):
    x = data((4, 5, 64), offset)  # rows of 4 * 64 = 256 elements over dims 0 and 2

    def fn(x):
        var, mean = torch.var_mean(x, dim=(0, 2), correction=correction, keepdim=keepdim)
        return var * 3.0 + mean

    with one_pass(**SPLIT):
        compiled = ember.compile(fn, target=target)
        leaf_e, leaf_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = fn(leaf_e), compiled(leaf_c)
        cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        want.backward(cot)
        got.backward(cot)
    # var against float64: the shift keeps fp32's digits where the mean is 1000x the spread.
    var64 = torch.var_mean(x.double(), dim=(0, 2), correction=correction, keepdim=keepdim)[0]
    var_c = torch.var_mean(x, dim=(0, 2), correction=correction, keepdim=keepdim)[0]
    torch.testing.assert_close(got.detach().double(), fn(x.double()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var_c.double(), var64, rtol=1e-4, atol=0)  # eager itself, as a sanity bound
    assert_close(got, want, "output", rtol=1e-5, atol=1e-5)
    assert_close(leaf_c.grad, leaf_e.grad, "gradient", rtol=1e-4, atol=1e-4)
    if target == "triton-interpret":  # the split path ran: one partial kernel, no second level
        names = [name for g in log_of(compiled).graphs if g.kind == "forward" for name in g.kernel_sources]
        assert any("part1" in n for n in names) and not any("part2" in n for n in names), names


@pytest.mark.parametrize("target", TARGETS)
def test_var_alone_of_offset_data_keeps_fp32_digits(target):
    x = data((3, 512), 1000.0, seed=2)  # spread 0.1 around 1000: unshifted sums of squares lose all digits

    def fn(x):
        return torch.var(x, dim=1)

    with one_pass():
        got = ember.compile(fn, target=target)(x)
    torch.testing.assert_close(got.double(), torch.var(x.double(), dim=1), rtol=1e-4, atol=0)


# -- batch norm ------------------------------------------------------------------------------------

def _bn_model(conv: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)] if conv else []
    return torch.nn.Sequential(*layers, torch.nn.BatchNorm2d(6 if conv else 3), torch.nn.ReLU())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("conv", [False, True], ids=["bn", "conv_bn"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_batch_norm_training_steps_match_eager(target, conv, autocast):
    """Three SGD steps: outputs, every gradient, the running statistics (n = 4 * 8 * 8 = 256 per
    channel)."""
    eager, model = _bn_model(conv), _bn_model(conv)
    # Steps update batch norm's parameters only: a bf16 convolution's weight gradient differs
    # between two runs of different summation order by more than bf16 outputs tolerate.
    opt_e = torch.optim.SGD(eager[-2].parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model[-2].parameters(), lr=0.1)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-4, "atol": 1e-4}
    with one_pass(**SPLIT):
        compiled = ember.compile(model, target=target)
        for step in range(3):
            # Batch norm of the input itself sees a mean 1000x its spread (steps 0 and 2); behind a
            # convolution that data would leave bf16 outputs a bit or two of spread, so it gets randn.
            x = data((4, 3, 8, 8), 100.0 if step != 1 and not conv else 0.0, seed=step)
            cot = torch.randn(4, 6 if conv else 3, 8, 8, generator=torch.Generator().manual_seed(10 + step))
            outs, x_grads = [], []
            for m, opt in ((eager, opt_e), (compiled, opt_c)):
                m.zero_grad()
                leaf = x.clone().requires_grad_()
                with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    out = m(leaf)
                # A fixed random cotangent: a loss of bounded gradient keeps the steps small.
                out.float().backward(cot)
                opt.step()
                outs.append(out)
                x_grads.append(leaf.grad)
            assert_close(outs[1], outs[0], f"output of step {step}", **tol)
            grads = [(f"input gradient at step {step}", x_grads[1], x_grads[0])]
            grads += [(f"gradient of {name} at step {step}", p.grad, q.grad)
                      for (name, p), q in zip(model.named_parameters(), eager.parameters())]
            for what, got, want in grads:
                if autocast and conv:
                    # Gradients through a bf16 convolution sum bf16 products: elements differ by bf16
                    # steps between two runs, so the whole is compared (a norm-relative error).
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 0.05, f"{what}: relative error {err}"
                else:
                    assert_close(got, want, what, **tol)
        bn_c, bn_e = model[-2], eager[-2]
        assert_close(bn_c.running_mean, bn_e.running_mean, "running_mean", rtol=1e-4, atol=1e-4)
        assert_close(bn_c.running_var, bn_e.running_var, "running_var", rtol=1e-3, atol=1e-4)
        assert int(bn_c.num_batches_tracked) == 3
    forward = [g for g in log_of(compiled).graphs if g.kind == "forward"]
    assert forward and all(" slice" in g.plan_text for g in forward), "the one-pass form was not taken"


# -- the rule -----------------------------------------------------------------------------------

def _statistics_levels(fn, x: torch.Tensor) -> list[int]:
    """The reduction levels of the plan's reduction groups over ``x``'s full shape."""
    gm = make_fx(fn, decomposition_table=decomposition_table())(x)
    plan = plan_graph(gm.graph)
    levels = []
    for g in plan.fused():
        if g.is_reduction and tuple(g.shape) == tuple(x.shape):
            levels.append(max(reduction_levels(g).values()))
    return levels


def _bn_train(x: torch.Tensor) -> torch.Tensor:
    w, b = torch.ones(x.shape[1]), torch.zeros(x.shape[1])
    return torch.nn.functional.batch_norm(x, None, None, w, b, training=True).relu()


@pytest.mark.parametrize("fn", [_bn_train, lambda x: sum(torch.var_mean(x, dim=(0, 2, 3)))], ids=["bn", "var_mean"])
def test_rule_one_pass_above_the_threshold_two_passes_below(fn):
    x = torch.randn(2, 3, 8, 8)  # 128 elements per row
    with one_pass(min_row=128):
        assert _statistics_levels(fn, x) == [1]
    with one_pass(min_row=129):
        assert _statistics_levels(fn, x) == [2]
    with one_pass(enabled=False, min_row=128):
        assert _statistics_levels(fn, x) == [2]


@pytest.mark.parametrize("fn", [_bn_train, lambda x: sum(torch.var_mean(x, dim=(0, 2, 3)))], ids=["bn", "var_mean"])
def test_rule_by_default_one_pass_over_half_precision_tensors_only(fn):
    """``auto``: a bfloat16/float16 tensor (autocast's activations) takes the one-pass form, whose
    cancellation lies far below its own rounding; a float32 one keeps two passes."""
    assert config.settings().one_pass_var_mean == "auto"
    x = torch.randn(2, 3, 8, 8)
    with one_pass("auto", min_row=128):
        assert _statistics_levels(fn, x) == [2]
        assert _statistics_levels(fn, x.to(torch.bfloat16)) == [1]
        assert _statistics_levels(fn, x.to(torch.float16)) == [1]


@pytest.mark.parametrize("target", TARGETS)
def test_bfloat16_batch_norm_by_default_is_as_accurate_as_eager(target):
    """The default rule's one-pass statistics of a bfloat16 activation (rows far from zero, where
    unshifted sums would lose every digit) against a float64 reference, forward and input
    gradient: at most eager bfloat16's own error (or a bfloat16 ulp of the output)."""
    torch.manual_seed(0)
    x = (data((4, 6, 16, 16), 50.0) * 3).to(torch.bfloat16).requires_grad_()
    model = torch.nn.BatchNorm2d(6).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.rand(6) + 0.5)
        model.bias.copy_(torch.randn(6))
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    grad = torch.randn(4, 6, 16, 16).to(torch.bfloat16)
    with one_pass("auto", **SPLIT):
        compiled = ember.compile(model, target=target)
        out = compiled(x)
        (gx,) = torch.autograd.grad(out, x, grad)
    forward = [g for g in log_of(compiled).graphs if g.kind == "forward"]
    assert forward and all(" slice" in g.plan_text for g in forward), "the one-pass form was not taken"
    want = eager(x)
    (gx_eager,) = torch.autograd.grad(want, x, grad)
    x64 = x.detach().double().requires_grad_()
    out64 = ref(x64)
    (gx64,) = torch.autograd.grad(out64, x64, grad.double())
    for what, got, theirs, exact in (("output", out, want, out64), ("input gradient", gx, gx_eager, gx64)):
        ours = (got.double() - exact).abs().max().item()
        eagers = (theirs.double() - exact).abs().max().item()
        ulp = exact.abs().max().item() * 2.0 ** -8
        assert ours <= max(eagers, ulp), f"{what}: {ours:.3e} from float64 (eager bfloat16 {eagers:.3e})"
    assert_close(model.running_mean.float(), ref.running_mean.float(), "running_mean", rtol=1e-2, atol=1e-2)
    assert_close(model.running_var.float(), ref.running_var.float(), "running_var", rtol=2e-2, atol=1e-2)


def test_rule_keeps_two_passes_for_a_value_a_fused_group_computes():
    """A shift of ``x * 2 + 1`` would need that value stored first: two passes, one group."""
    x = torch.randn(2, 3, 8, 8)
    with one_pass(min_row=128):
        assert _statistics_levels(lambda x: _bn_train(x * 2 + 1), x) == [2]


def test_rule_default_threshold_is_4096_elements_per_row():
    assert config.settings().one_pass_var_mean_min == 4096
    x = torch.randn(2, 3, 32, 64)  # 4096 per channel
    with config.patch(one_pass_var_mean="always"):
        assert _statistics_levels(_bn_train, x) == [1]
        assert _statistics_levels(_bn_train, x[:, :, :, :63].contiguous()) == [2]


@pytest.mark.parametrize("enabled,kernels", [(True, ["comb1", "part1", "red"]),
                                             (False, ["comb1", "comb2", "part1", "part2", "red"])])
def test_split_batch_norm_forward_kernels(enabled, kernels):
    """A split batch-norm forward (the GPU path of a large activation): one partial + combine
    pair with the one-pass form (x read twice), two pairs with two passes (x read three times)."""
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    with one_pass(enabled, **SPLIT):
        compiled = ember.compile(model, target="triton-interpret")
        compiled(data((4, 3, 8, 8), 0.0))
    (forward,) = [g for g in log_of(compiled).graphs if g.kind == "forward"]
    bn = [g for g in forward.plan_text.splitlines() if "fused-reduction" in g]
    assert len(bn) == 1, forward.plan_text
    names = sorted(name.split("_")[1] for name in forward.kernel_sources if not name.startswith("ember_pw"))
    assert names == kernels, sorted(forward.kernel_sources)
