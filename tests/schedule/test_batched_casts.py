"""Casts in a few multi-tensor copies (schedule/batched_casts.py): autocast's weight casts at the
first one's place, weight-gradient casts that are only returned at the end, on the Triton code
path (the interpreter), against eager, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torchvision

import ember
from ember.schedule.batched_casts import batch_input_casts
from ember.schedule.plan import plan_graph


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8))


def _step(model: torch.nn.Module, fn, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.float().detach(), [p.grad.clone() for p in model.parameters()]


def _graphs(compiled) -> dict[str, object]:
    return {g.kind: g for g in compiled._ember_backend.log.graphs}


@pytest.mark.parametrize("on", [True, False], ids=["batched", "a-kernel-each"])
def test_autocast_training_step_matches_eager(on: bool) -> None:
    model = _mlp()
    compiled = ember.compile(model, target="triton-interpret", cache=False, batch_casts=on)
    for _ in range(2):  # fresh random inputs each step
        x = torch.randn(4, 16)
        got, got_grads = _step(model, compiled, x)
        want, want_grads = _step(model, model, x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    graphs = _graphs(compiled)
    forward, backward = graphs["forward"], graphs["backward"]
    if on:
        # The input and six weights and biases cast to bf16 in one copy; the three weight
        # gradients cast to float32 last, in one copy.
        assert "7 casts of graph inputs to torch.bfloat16" in forward.plan_text, forward.plan_text
        assert forward.program.count("_cast_all(") == 1
        assert "3 casts to torch.float32 of values only returned" in backward.plan_text, backward.plan_text
        last_step = backward.plan_text.strip().splitlines()[-1]
        assert "foreach" in last_step
    else:
        assert "foreach" not in forward.plan_text + backward.plan_text
        assert "_cast_all(" not in forward.program + backward.program


def _four_casts(a, b, c, d):
    return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).sum() + (c.to(torch.bfloat16) @ d.to(torch.bfloat16)).sum()


def _four_casts_plan():
    """The plan of ``_four_casts`` on inputs of four shapes (each cast a group of its own: casts of
    one shape fuse anyway), each 256 bytes in bf16."""
    from torch.fx.experimental.proxy_tensor import make_fx
    args = [torch.randn(8, 16), torch.randn(16, 8), torch.randn(4, 32), torch.randn(32, 4)]
    return plan_graph(make_fx(_four_casts)(*args).graph)


def test_batches_close_at_the_byte_limit() -> None:
    plan = _four_casts_plan()
    assert batch_input_casts(plan, max_bytes=2 * 256) == 4  # two casts' results per batch
    batches = [s for s in plan.steps if s.kind == "foreach"]
    assert [len(s.nodes) for s in batches] == [2, 2]
    assert [s.index for s in plan.steps] == list(range(len(plan.steps)))
    assert all(plan.step_of[n] is s for s in batches for n in s.nodes)

    plan = _four_casts_plan()
    assert batch_input_casts(plan, max_bytes=256) == 0  # one cast per batch: nothing to batch


def test_a_real_convnet_under_autocast() -> None:
    # torchvision's SqueezeNet: 26 convolutions' weights and biases in the forward's batches.
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=10).eval()  # no dropout: the same numbers as eager
    compiled = ember.compile(model, target="triton-interpret", cache=False)
    x = torch.randn(1, 3, 32, 32)
    got, got_grads = _step(model, compiled, x)
    want, want_grads = _step(model, model, x)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)
    forward = _graphs(compiled)["forward"]
    assert "foreach" in forward.plan_text


def test_whole_step_program_under_autocast_matches_eager() -> None:
    # The whole-step program (forward, backward, AdamW) on the Triton code path, weights cast in
    # batches: parameters equal to an eager loop's after each of four steps on fresh batches.
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)

    def loss_of(net: torch.nn.Module):
        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return torch.nn.functional.mse_loss(net(x).float(), y)
        return loss

    step = ember.compile_step(loss_of(model), opt, model=model, target="triton-interpret")
    ref_loss = loss_of(ref)
    for i in range(4):
        x, y = torch.randn(4, 16), torch.randn(4, 8)
        got = step(x, y)
        ref_opt.zero_grad(set_to_none=True)
        want = ref_loss(x, y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=2e-2, atol=2e-2, msg=f"loss at step {i}")
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2, msg=f"parameters after step {i}")
    plans = {g.kind: g.plan_text for g in step.backend.log.graphs}
    assert "casts of graph inputs to torch.bfloat16" in plans["forward"], plans["forward"]


def test_large_casts_stay_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.schedule import batched_casts

    monkeypatch.setattr(batched_casts, "MAX_EARLY_CAST_BYTES", 255)
    plan = _four_casts_plan()
    assert batch_input_casts(plan) == 0 and not any(s.kind == "foreach" for s in plan.steps)
