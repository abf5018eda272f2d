"""Whole-step training programs (``ember.compile_step``) against a plain eager training loop.

Each test trains two copies of one model from identical weights on the same fresh random batches:
one with the whole-step program, one with the canonical eager loop (zero_grad, loss, backward,
clip, step). Parameters (and losses) must agree within fp32 tolerance after every step, and must
have moved. On CPU there is no CUDA graph: these check the step's semantics (the optimizer, the
scheduler, clipping, accumulation, GradScaler, checkpoints, fallbacks), every optimizer and a
checkpoint resumed mid-run also with the GPU code path's generated kernels (Triton's
interpreter); the guards of the CUDA capture are checked as pure functions at the end. benchmarks/scripts/gpu_whole_step.py checks
the captured path on a GPU.
"""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import ember
from ember import config
from ember.train.capture import CudaWholeStep
from ember.train.replay_guard import hyper_change, hyperparameters, signature

STEPS = 20
TARGET = "aten"  # the step's semantics; the optimizers and a checkpoint also on the Triton interpreter


@pytest.fixture(autouse=True)
def clean_dynamo(monkeypatch: pytest.MonkeyPatch):
    for name in ("EMBER_TARGET", "EMBER_CUDAGRAPHS", "EMBER_WHOLE_STEP_CUDAGRAPH", "EMBER_WHOLE_STEP_WARMUP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EMBER_STRICT", "1")
    torch._dynamo.reset()
    torch.manual_seed(1234)
    yield
    torch._dynamo.reset()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4))


class SmallConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)  # bias before BN: zero gradient
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


def batch_for(model: torch.nn.Module, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(model, SmallConvNet):
        return torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,))
    return torch.randn(n, 8), torch.randint(0, 4, (n,))


def twins(make: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = make()
    return model, copy.deepcopy(model)


def loss_of(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, y: F.cross_entropy(model(x), y)


def eager_step(model, opt, x, y, clip: float | None = None, scaler=None) -> torch.Tensor:
    """The canonical eager loop's step."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if clip is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss.detach()


def assert_same_params(got: torch.nn.Module, want: torch.nn.Module, what: str, tol: float = 2e-5) -> None:
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol, msg=lambda m, name=name: f"{what} {name}: {m}")
    for (name, b), (_, c) in zip(got.named_buffers(), want.named_buffers()):
        torch.testing.assert_close(b, c, rtol=tol, atol=tol, msg=lambda m, name=name: f"{what} buffer {name}: {m}")


def assert_moved(model: torch.nn.Module, initial: list[torch.Tensor]) -> None:
    moved = [not torch.equal(p.detach(), p0) for p, p0 in zip(model.parameters(), initial)]
    assert all(moved), f"parameters that never changed: {[i for i, m in enumerate(moved) if not m]}"


OPTIMIZERS = {
    "sgd_momentum_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                           weight_decay=1e-2),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_amsgrad_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


# Every optimizer on the MLP; the conv net (batch norm) with one SGD and one Adam-family optimizer;
# every optimizer on the MLP again with the GPU code path's generated kernels (Triton's interpreter).
CASES = ([(mlp, name, TARGET) for name in OPTIMIZERS]
         + [(SmallConvNet, "sgd_momentum_nesterov_wd", TARGET), (SmallConvNet, "adamw", TARGET)]
         + [(mlp, name, "triton-interpret") for name in OPTIMIZERS])


@pytest.mark.parametrize(("make", "name", "target"), CASES, ids=[f"{m.__name__}-{n}-{t}" for m, n, t in CASES])
def test_optimizers_match_eager(make: Callable[[], torch.nn.Module], name: str, target: str) -> None:
    model, ref = twins(make)
    initial = [p.detach().clone() for p in model.parameters()]
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    step = ember.compile_step(loss_of(model), opt, model=model, target=target)
    for i in range(STEPS):
        x, y = batch_for(model)
        loss = step(x, y)
        want = eager_step(ref, ref_opt, x, y)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"loss at step {i}: {m}")
        assert_same_params(model, ref, f"step {i}")
    assert_moved(model, initial)
    assert step.optimizer_steps == STEPS and step.calls == STEPS
    if target != TARGET:  # the step's graphs ran generated kernels, not ATen's
        assert all(g.placement.get("generated") for g in step.backend.log.graphs), step.backend.log.graphs
    report = step.explain()
    assert {"forward", "backward"} <= {t.split()[0] for t in report.graphs}, report.graphs
    # The optimizer's own state is the user's: same keys and values as eager's.
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sched", ["step_lr", "one_cycle"])
def test_lr_scheduler_changes_the_rate(sched: str) -> None:
    model, ref = twins(mlp)
    if sched == "step_lr":
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        make = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.3)  # noqa: E731
    else:
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
        make = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 4)  # noqa: E731
    scheduler, ref_scheduler = make(opt), make(ref_opt)
    step = ember.compile_step(loss_of(model), opt, target=TARGET)
    rates = set()
    for i in range(STEPS):
        x, y = batch_for(model)
        step(x, y)
        eager_step(ref, ref_opt, x, y)
        scheduler.step()
        ref_scheduler.step()
        rates.add(round(float(opt.param_groups[0]["lr"]), 8))
        assert_same_params(model, ref, f"step {i}")
    assert len(rates) >= 4, rates  # the schedule did change the rate


def test_gradient_clipping_by_norm() -> None:
    model, ref = twins(mlp)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in (model, ref))
    clip = 0.05
    step = ember.compile_step(loss_of(model), opt, clip_grad_norm=clip, target=TARGET)
    norms_before_clip = []
    for i in range(STEPS):
        x, y = batch_for(model)
        step(x, y)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        norms_before_clip.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)))
        ref_opt.step()
        assert_same_params(model, ref, f"step {i}")
        # The step's gradients (kept after the step) are the clipped ones.
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        assert norm <= clip * (1 + 1e-4), (i, norm)
    assert min(norms_before_clip) > clip  # every step was clipped: the clip mattered


def test_gradient_accumulation_over_micro_steps() -> None:
    model, ref = twins(mlp)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05) for m in (model, ref))
    n = 3
    step = ember.compile_step(loss_of(model), opt, accumulate=n, clip_grad_norm=1.0, target=TARGET)
    for k in range(8):
        ref_opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        for j in range(n):
            x, y = batch_for(model, 4)
            loss = step(x, y)
            want = F.cross_entropy(ref(x), y)
            (want / n).backward()
            torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
            if j < n - 1:  # no update until the last micro-step
                assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        ref_opt.step()
        assert_same_params(model, ref, f"optimizer step {k}")
    assert step.optimizer_steps == 8 and step.calls == 24


@pytest.mark.parametrize("target", [TARGET, "triton-interpret"])
def test_checkpoint_resume_mid_run(target: str) -> None:
    model, ref = twins(SmallConvNet)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    step = ember.compile_step(loss_of(model), opt, target=target)
    batches = [batch_for(model) for _ in range(STEPS)]
    half = STEPS // 2
    for x, y in batches[:half]:
        step(x, y)
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()},
               buffer)
    del step, opt, scheduler, model
    torch._dynamo.reset()
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    torch.manual_seed(99)
    resumed = SmallConvNet()  # fresh weights, replaced by the checkpoint's
    resumed.load_state_dict(checkpoint["model"])
    opt2 = make_opt(resumed.parameters())
    opt2.load_state_dict(checkpoint["optimizer"])
    scheduler2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=4, gamma=0.5)
    scheduler2.load_state_dict(checkpoint["scheduler"])
    step2 = ember.compile_step(loss_of(resumed), opt2, target=target)
    for i, (x, y) in enumerate(batches):
        eager_step(ref, ref_opt, x, y)
        ref_scheduler.step()
        if i >= half:
            step2(x, y)
            scheduler2.step()
            assert_same_params(resumed, ref, f"step {i} (resumed at {half})")
        elif i == half - 1:
            assert_same_params(resumed, ref, "the checkpoint")
    assert opt2.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])


def test_grad_scaler_skips_steps_on_inf() -> None:
    scaler_cls = getattr(torch.amp, "GradScaler", None)
    if scaler_cls is None:
        pytest.skip("torch.amp.GradScaler not available")
    try:
        scaler_cls("cpu")
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"GradScaler('cpu') unusable here: {err}")
    model, ref = twins(mlp)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    scaler = scaler_cls("cpu", init_scale=2.0 ** 12, growth_interval=4)
    ref_scaler = scaler_cls("cpu", init_scale=2.0 ** 12, growth_interval=4)
    step = ember.compile_step(loss_of(model), opt, scaler=scaler, clip_grad_norm=2.0, target=TARGET)
    bad_steps = {5, 6, 13}
    scales = set()
    for i in range(STEPS):
        x, y = batch_for(model)
        if i in bad_steps:
            x[0, 0] = float("inf")  # the loss and gradients overflow: the update must be skipped
        before = [p.detach().clone() for p in model.parameters()]
        step(x, y)
        eager_step(ref, ref_opt, x, y, clip=2.0, scaler=ref_scaler)
        assert scaler.get_scale() == ref_scaler.get_scale(), i
        scales.add(scaler.get_scale())
        if i in bad_steps:
            assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)), f"step {i} not skipped"
        assert_same_params(model, ref, f"step {i}")
    assert len(scales) >= 3, scales  # it backed off on inf and grew after good steps


def test_lbfgs_falls_back_with_a_reason() -> None:
    model, ref = twins(mlp)
    opt, ref_opt = (torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4) for m in (model, ref))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = ember.compile_step(loss_of(model), opt, target=TARGET)
    assert any("LBFGS needs a closure" in str(w.message) for w in seen), [str(w.message) for w in seen]
    for i in range(6):
        x, y = batch_for(model)
        loss = step(x, y)

        def closure(x=x, y=y) -> torch.Tensor:
            ref_opt.zero_grad()
            out = F.cross_entropy(ref(x), y)
            out.backward()
            return out
        want = ref_opt.step(closure)
        # LBFGS's line search amplifies rounding differences of the compiled forward: looser tolerances.
        torch.testing.assert_close(loss, want.detach(), rtol=2e-4, atol=2e-4)
        assert_same_params(model, ref, f"LBFGS step {i}", tol=2e-4)
    assert "LBFGS needs a closure" in step.status
    report = ember.explain(step)
    assert "LBFGS needs a closure" in str(report) and report.uncaptured_calls
    with pytest.raises(ValueError, match="accumulate"):
        ember.compile_step(loss_of(model), opt, accumulate=2, target=TARGET)


def test_entry_points_and_bad_input() -> None:
    model, ref = twins(mlp)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    step = ember.compile(loss_of(model), optimizer=opt, target=TARGET)
    assert isinstance(step, ember.TrainStep)

    @ember.train_step(ref_opt, target=TARGET)
    def ref_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(ref(x), y)
    for _ in range(3):
        x, y = batch_for(model)
        step(x, y)
        ref_step(x, y)
    assert_same_params(model, ref, "ember.compile(optimizer=) vs @ember.train_step")
    bad = ember.compile_step(lambda x, y: model(x), opt, target=TARGET)
    with pytest.raises(TypeError, match="must return the loss"):
        bad(*batch_for(model))
    with pytest.raises(ValueError, match="accumulate"):
        ember.compile_step(loss_of(model), opt, accumulate=0)


# -- the CUDA capture's guards, as pure functions (no GPU needed) ---------------------------------


def test_capture_guards_see_scheduler_and_checkpoint_changes() -> None:
    model = mlp()
    x, y = batch_for(model)
    mods = list(model.modules())  # listed once per capture; their flags are read on every call
    assert signature((x, y), mods, torch.device("cpu")) == signature((x.clone(), y), mods, torch.device("cpu"))
    assert signature((x, y), mods, torch.device("cpu")) != signature((x[:3], y[:3]), mods, torch.device("cpu"))
    mods[-1].eval()  # one submodule switched to eval mode
    eval_sig = signature((x, y), mods, torch.device("cpu"))
    model.train()
    assert eval_sig != signature((x, y), mods, torch.device("cpu"))
    # A float lr that a scheduler replaces is a change; a tensor lr it fills in place is not.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    before = hyperparameters(sgd.param_groups[0])
    sgd.step()
    scheduler.step()
    assert hyper_change(before, hyperparameters(sgd.param_groups[0])) == "lr"
    adam = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    before = hyperparameters(adam.param_groups[0])
    adam.step()
    scheduler.step()
    assert hyper_change(before, hyperparameters(adam.param_groups[0])) is None
    assert float(adam.param_groups[0]["lr"]) == pytest.approx(0.005)


def test_capture_preparation_and_state_guard_on_cpu_objects() -> None:
    # CudaWholeStep's checks, driven with CPU tensors standing in for the device.
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ember.compile_step(loss_of(model), opt, target=TARGET)
    step(*batch_for(model))
    cuda = CudaWholeStep(step, torch.device("cpu"))
    assert cuda._prepare() is None
    group = opt.param_groups[0]
    assert group["capturable"] is True and isinstance(group["lr"], torch.Tensor)
    assert any("capturable" in c for c in cuda.changes)
    cuda._snapshot()
    assert cuda._guard_change() == (None, False)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    why, hyper = cuda._guard_change()
    assert why is not None and "replaced" in why and not hyper
    # Unknown optimizers and GradScaler with a non-fused optimizer are refused with a reason.
    rms = torch.optim.RMSprop(model.parameters())
    assert "RMSprop" in ember.compile_step(loss_of(model), rms, target=TARGET).blocker
    scaled = ember.compile_step(loss_of(model), torch.optim.SGD(model.parameters(), lr=0.1, foreach=False),
                                scaler=torch.amp.GradScaler("cpu"), target=TARGET)
    assert "non-fused" in CudaWholeStep(scaled, torch.device("cpu"))._prepare()


FUSABLE = {  # optimizer family -> (its class, its hyperparameters)
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
FUSE_CASES = ([(family, kind) for family in FUSABLE
               for kind in ("default", "foreach", "for-loop", "subclass", "setting off")]
              + [("adam", "tensor betas"), ("adamw", "differentiable")])


@pytest.mark.parametrize(("family", "kind"), FUSE_CASES, ids=[f"{f}-{k}" for f, k in FUSE_CASES])
def test_foreach_optimizers_run_fused_in_a_captured_step(family: str, kind: str) -> None:
    """A foreach (or default) SGD, Adam or AdamW becomes torch's fused optimizer when a whole step
    is captured: the same update up to rounding over several steps, the change reported, GradScaler
    then capturable; an explicit for-loop optimizer, a subclass, ``differentiable``, Adam's tensor
    betas and ``fused_optimizers=False`` are left as constructed."""
    cls, hyper = FUSABLE[family]
    sub = type(f"My{cls.__name__}", (cls,), {})
    extra = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "differentiable": {"differentiable": True},
             "tensor betas": {"betas": (torch.tensor(0.9), torch.tensor(0.999))}}.get(kind, {})

    def make(ps):
        return (sub if kind == "subclass" else cls)(ps, **hyper, **extra)

    model, ref = twins(mlp)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = ember.compile_step(loss_of(model), opt, target=TARGET)
    fused = kind in ("default", "foreach")
    with config.patch(fused_optimizers=kind != "setting off"):
        cuda = CudaWholeStep(step, torch.device("cpu"))
        assert cuda._prepare() is None
        # With a GradScaler: refused as non-fused, or (fused) only because this scaler is the CPU's.
        other = make(copy.deepcopy(model).parameters())
        scaled = ember.compile_step(loss_of(model), other, scaler=torch.amp.GradScaler("cpu"), target=TARGET)
        why = CudaWholeStep(scaled, torch.device("cpu"))._prepare()
    assert ("non-fused" not in why) is fused, why
    group = opt.param_groups[0]
    assert bool(group["fused"]) is fused, group
    if fused:
        assert group["foreach"] is False and isinstance(group["lr"], torch.Tensor)
        assert opt._step_supports_amp_scaling
        assert any(c.startswith(f"fused=True ({cls.__name__}'s") for c in cuda.changes), cuda.changes
    if kind == "differentiable":  # (its step needs parameters that are not leaves: not run here)
        return
    if not fused and family != "sgd":  # capturable=True is CUDA's; torch's CPU for-loop/foreach Adam refuses it
        for g in opt.param_groups:
            g["capturable"] = False
    for i in range(5):  # the optimizer's own step, fused or not, against the one as constructed
        x, y = batch_for(model)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        assert_same_params(model, ref, f"step {i}")
        for p, q in zip(model.parameters(), ref.parameters()):
            got, want = opt.state[p], ref_opt.state[q]
            assert set(got) == set(want)
            for key in want:
                torch.testing.assert_close(torch.as_tensor(got[key]).float(), torch.as_tensor(want[key]).float(),
                                           rtol=1e-5, atol=1e-6, msg=f"state {key!r} after step {i}")


def test_compacting_optimizer_state_keeps_tensors_values_and_training() -> None:
    # What the whole-step capture does before its first capture with compact_optimizer_state on
    # (CUDA only; the function itself is device-agnostic): each state tensor keeps its object,
    # values and strides, gets new memory, and training goes on as without it.
    from ember.train.capture import compact_tensors

    model, ref = twins(mlp)
    opt = OPTIMIZERS["adam_amsgrad_wd"](model.parameters())
    ref_opt = OPTIMIZERS["adam_amsgrad_wd"](ref.parameters())
    batches = [batch_for(model) for _ in range(6)]
    for x, y in batches[:3]:
        eager_step(model, opt, x, y)
        eager_step(ref, ref_opt, x, y)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = [(id(t), t.clone(), t.stride()) for t in state]
    released = []
    moved = compact_tensors(state, lambda: released.append(True))
    assert released == [True] and moved == sum(t.numel() * t.element_size() for t in state)
    for t, (ident, value, stride) in zip(state, before):  # (CPU malloc may hand back the same address)
        assert id(t) == ident and t.stride() == stride and torch.equal(t, value)
    assert all(a is b for a, b in zip(state, (v for s in opt.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor))))
    for x, y in batches[3:]:
        eager_step(model, opt, x, y)
        eager_step(ref, ref_opt, x, y)
    assert_same_params(model, ref, "after compacting", tol=0)
    shared = torch.zeros(8)
    assert compact_tensors([shared[:4], shared[4:]], lambda: None) == 0  # one storage: left as it is


def test_first_capture_holds_no_gradient_of_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool is reserved after the warm-up's cached memory is handed back; a gradient of the
    # warm-up still alive then keeps its memory reserved, unused, beside the graph's pool for the
    # whole run (bert: 419 MiB above eager's peak). Driven on CPU with the capture calls stubbed.
    import contextlib
    import gc
    import weakref

    import ember.train.capture as capture

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ember.compile_step(loss_of(model), opt, target=TARGET)
    x, y = batch_for(model)
    step(x, y)
    old = [weakref.ref(p.grad) for p in model.parameters()]
    assert all(r() is not None for r in old)
    alive_at_reserve = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(capture, "capture_stream", lambda device: None)

    def reserve(self: CudaWholeStep) -> None:
        gc.collect()
        alive_at_reserve.append(sum(r() is not None for r in old))

    monkeypatch.setattr(CudaWholeStep, "_reserve", reserve)
    cuda = CudaWholeStep(step, torch.device("cpu"))
    cuda.static_batch = (x, y)
    graph = cuda._capture(first=True, last=True)
    assert alive_at_reserve == [0]
    assert all(p.grad is g and g is not None for p, g in zip(model.parameters(), graph.grads))


@pytest.mark.parametrize("limit, compacted", [(1 << 30, True), (16, False)])
def test_reserve_compacts_optimizer_state_up_to_the_limit(monkeypatch: pytest.MonkeyPatch, limit: int,
                                                          compacted: bool) -> None:
    # Before a first capture the optimizer state moves to fresh memory (on by default), unless it
    # holds more than MAX_COMPACT_BYTES (seconds of copies through the host). CUDA calls stubbed.
    import contextlib

    import ember.train.capture as capture

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ember.compile_step(loss_of(model), opt, target=TARGET)
    step(*batch_for(model))
    moved = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(capture, "compact_tensors", lambda state, release: moved.append(len(state)))
    monkeypatch.setattr(capture, "MAX_COMPACT_BYTES", limit)
    cuda = CudaWholeStep(step, torch.device("cpu"))
    cuda._reserve()
    assert moved == ([len(list(model.parameters()))] if compacted else [])

