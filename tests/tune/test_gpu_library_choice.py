"""GPU library choices as tuned decisions (passes/gpu_library_choices.py, ops/tiled_matmul.py), on
the GPU code path through Triton's interpreter: the sites a training compile meets (addmm, mm,
bmm, Ember's small products; depthwise convolutions and their backward) with their rules; every
candidate checked against a float64 reference and a wrong one rejected; tuned answers applied by
compile (Ember's tiled kernel in place of cuBLAS, cuBLAS in place of the small-product rule,
Ember's depthwise kernels in place of cuDNN) with forward and gradients as eager's, and explain
naming each choice."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import ember
from ember import config
from ember.ops import attention, tiled_matmul
from ember.report.explain import explain_with
from ember.tune.db import Result, TuningDB
from ember.tune.device import device_key
from ember.tune.library import site_candidates, tune_site
from ember.tune.measure import candidate_output_hook
from ember.tune.session import collect_work


class ProjectAttend(torch.nn.Module):
    """A projection (addmm), products of 7-token rows (bmm, small enough for Ember's small-product
    rule) and a projection without bias (mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(24, 36)
        self.out = torch.nn.Linear(36, 20, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = torch.bmm(h, h.transpose(1, 2))
        return self.out(torch.bmm(scores.softmax(-1), h))


@contextlib.contextmanager
def _corrupting(impl: str, output: int = 0, index: int = 0, by: float = 1.0):
    """Every candidate of implementation ``impl`` returns one wrong element (``outputs[output]``'s
    element ``index`` moved by ``by``); yields the names of the candidates corrupted."""
    corrupted: list[str] = []

    def corrupt(candidate, outputs) -> None:
        if f"impl={impl}" in candidate.source:
            corrupted.append(candidate.name)
            outputs[output].view(-1)[index] += by

    with candidate_output_hook(corrupt):
        yield corrupted


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _model(dtype: torch.dtype = torch.bfloat16) -> ProjectAttend:
    torch.manual_seed(3)
    return ProjectAttend().to(dtype)


@pytest.fixture(scope="module")
def sites():
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(1)).bfloat16()
    with config.patch(small_bmm=True):
        return collect_work(_model(), (x,), train=True, target="triton-interpret", loss=_loss)[1]


def test_training_sites_and_their_rules(sites) -> None:
    matmuls = [s for s in sites if s.op == "matmul"]
    rules = {s.impls[0] for s in matmuls}
    assert rules == {"cublas", "small_bmm"}
    labels = [s.label for s in matmuls]
    assert "mm 21x24 @ 24x36 +bias (bfloat16, rule cublas)" in labels  # the projection's forward
    assert any(label.startswith("bmm 3x7x36 @ 3x36x7 (bfloat16, rule small_bmm)") for label in labels)
    small = next(s for s in matmuls if s.impls[0] == "small_bmm")
    assert small.impls == ("small_bmm", "cublas", "tiled")
    configs = [c for c, impl in site_candidates(small) if impl == "tiled"]
    assert configs and all(set(c) == {"impl", *tiled_matmul.TILE_KEYS} for c in configs)
    assert len({s.key for s in matmuls}) == len(matmuls)


def test_candidates_checked_and_a_wrong_one_rejected(sites, tmp_path: Path) -> None:
    site = next(s for s in sites if s.op == "matmul" and s.bias is not None)
    dev = device_key("cpu")
    db = TuningDB(tmp_path / "t.sqlite")
    good = tune_site(site, db, dev, per_candidate_s=0.01)
    assert good.failed == 0 and good.tried == len(site_candidates(site)) - 1
    assert all(r.status == "ok" for r in db.results(site.key, dev))

    bad_db = TuningDB(tmp_path / "bad.sqlite")
    with _corrupting("tiled", index=3) as corrupted:
        bad = tune_site(site, bad_db, dev, per_candidate_s=0.01)
    assert corrupted and bad.failed == len(corrupted) == good.tried
    rows = bad_db.results(site.key, dev)
    assert all(r.failed and "differ" in r.detail for r in rows if r.config.get("impl") == "tiled")
    assert bad_db.choices([site.key], dev)[site.key].config == {}  # only the rule passed


def _step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    _loss(out).backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]


def test_tuned_choices_compiled_and_trained_like_eager(sites, tmp_path: Path) -> None:
    dev = device_key("cpu")
    rows = []
    for site in (s for s in sites if s.op == "matmul"):
        # Every product to the tiled kernel, except the small-product rule's, which go back to cuBLAS.
        chosen = {"impl": "cublas"} if site.impls[0] == "small_bmm" else \
            next(c for c, impl in site_candidates(site) if impl == "tiled")
        rows += [Result(site.key, dev, {}, 2.0, "ok", label=site.label), Result(site.key, dev, chosen, 1.0, "ok")]
    db_path = tmp_path / "tuning.sqlite"
    TuningDB(db_path).record(rows)

    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(2))
    want = _step(_model(torch.float32), x)
    eager = _step(_model(), x.bfloat16())
    model = _model()
    with config.patch(tuning_db=str(db_path), small_bmm=True):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        got = _step(compiled, x.bfloat16())
        report = explain_with(_model(), (x.bfloat16(),), target="triton-interpret", steps=0)
    # Ember's bfloat16 step as close to float32 eager as eager's bfloat16 step, within 3x.
    for g, e, w in zip(got, eager, want):
        assert (g.float() - w).abs().max().item() <= 3 * (e.float() - w).abs().max().item() + 1e-3
    programs = "\n".join(g.program for g in compiled._ember_backend.log.graphs)
    assert "torch.ops.ember.tiled_matmul.default" in programs
    assert "torch.ops.ember.small_bmm.default" not in programs and "aten.bmm.default" in programs
    assert "aten.addmm.default" not in programs and "aten.mm.default" not in programs
    tuned = [t for g in report.graphs for t in g.tuned.values() if t.get("kind") == "library"]
    assert {t["config"].get("impl") for t in tuned} == {"tiled", "cublas"}
    text = " ".join(str(report).split())
    assert "impl=tiled " in text and "warps" in text and "impl=cublas" in text and "2.00x" in text


class ProjectActivate(torch.nn.Module):
    """A linear layer whose output only a ReLU reads (cuBLASLt can apply it in its epilogue), one
    followed by a tanh GELU (decomposed for fusion before the pass), one by an exact GELU and one
    whose output is read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(24, 40)
        self.b = torch.nn.Linear(40, 32)
        self.c = torch.nn.Linear(32, 32)
        self.d = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.nn.functional.gelu(self.b(h), approximate="tanh")
        h = torch.nn.functional.gelu(self.c(h))
        y = self.d(h)
        return y + torch.relu(y)


def _activate(dtype: torch.dtype = torch.bfloat16) -> ProjectActivate:
    torch.manual_seed(5)
    return ProjectActivate().to(dtype)


def _epilogue_sites(train: bool, x: torch.Tensor) -> list:
    sites = collect_work(_activate(), (x.bfloat16(),), train=train, target="triton-interpret", loss=_loss)[1]
    return [s for s in sites if s.op == "matmul"]


def _prefer_epilogues(sites: list, db_path: Path) -> None:
    dev = device_key("cpu")
    rows = []
    for site in sites:
        rows += [Result(site.key, dev, {}, 2.0, "ok", label=site.label),
                 Result(site.key, dev, {"impl": "cublaslt"}, 1.0, "ok")]
    TuningDB(db_path).record(rows)


def test_activation_epilogue_sites_checked_and_a_wrong_one_rejected(tmp_path: Path) -> None:
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    matmuls = _epilogue_sites(False, x)
    with_epilogue = [s for s in matmuls if "cublaslt" in s.impls]
    # Layer a alone (its ReLU); b's and c's GELUs and d's two readers keep the rule without it.
    assert [s.epilogue for s in with_epilogue] == ["relu"]
    assert all(s.epilogue == "none" for s in matmuls if s not in with_epilogue)
    dev = device_key("cpu")
    db = TuningDB(tmp_path / "check.sqlite")
    for site in with_epilogue:  # every candidate, the activation included, against float64
        found = tune_site(site, db, dev, per_candidate_s=0.01)
        assert found.failed == 0 and found.tried == len(site_candidates(site)) - 1
    bad_db = TuningDB(tmp_path / "bad.sqlite")
    with _corrupting("cublaslt", index=1) as corrupted:
        for site in with_epilogue:
            tune_site(site, bad_db, dev, per_candidate_s=0.01)
            assert any(r.failed for r in bad_db.results(site.key, dev) if r.config.get("impl") == "cublaslt")
    assert len(corrupted) == 1


def test_activation_epilogue_chosen_in_inference_and_training(tmp_path: Path) -> None:
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    infer_sites = [s for s in _epilogue_sites(False, x) if "cublaslt" in s.impls]
    train_sites = [s for s in _epilogue_sites(True, x) if "cublaslt" in s.impls]
    assert [s.epilogue for s in train_sites] == ["relu"]
    db_path = tmp_path / "tuning.sqlite"
    _prefer_epilogues(infer_sites + train_sites, db_path)

    with config.patch(tuning_db=str(db_path)), torch.no_grad():
        compiled = ember.compile(_activate().eval(), target="triton-interpret", cache=False)
        got = compiled(x.bfloat16())
        program = compiled._ember_backend.log.graphs[0].program
    want, eager = _activate(torch.float32)(x), _activate()(x.bfloat16())
    assert (got.float() - want).abs().max().item() <= 3 * (eager.float() - want).abs().max().item() + 1e-3
    assert program.count("aten._addmm_activation.default") == 1 and "aten.addmm.default" in program

    want = _step(_activate(torch.float32), x)
    eager = _step(_activate(), x.bfloat16())
    with config.patch(tuning_db=str(db_path)):
        compiled = ember.compile(_activate(), target="triton-interpret", cache=False)
        got = _step(compiled, x.bfloat16())
    for g, e, w in zip(got, eager, want):
        assert (g.float() - w).abs().max().item() <= 3 * (e.float() - w).abs().max().item() + 1e-3
    forward = compiled._ember_backend.log.graphs[0].program
    assert forward.count("aten._addmm_activation.default") == 1


def test_an_answer_the_pass_cannot_apply_is_not_listed(sites, tmp_path: Path, monkeypatch) -> None:
    from ember.passes import gpu_library_choices

    dev = device_key("cpu")
    rows = []
    for site in (s for s in sites if s.op == "matmul" and s.impls[0] == "cublas"):
        tiled = next(c for c, impl in site_candidates(site) if impl == "tiled")
        rows += [Result(site.key, dev, {}, 2.0, "ok", label=site.label), Result(site.key, dev, tiled, 1.0, "ok")]
    TuningDB(tmp_path / "t.sqlite").record(rows)
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(2)).bfloat16()

    def library_rows() -> list[dict]:
        with config.patch(tuning_db=str(tmp_path / "t.sqlite"), small_bmm=True):
            report = explain_with(_model(), (x,), target="triton-interpret", steps=0, cache=False)
        return [t for g in report.graphs for t in g.tuned.values() if t.get("kind") == "library"]
    assert library_rows()  # applied: listed
    monkeypatch.setattr(gpu_library_choices, "_replace_product", lambda *args: False)  # planned for other strides
    assert library_rows() == []


def test_no_database_no_pass(tmp_path: Path) -> None:
    from ember.passes import PassContext, passes_for
    from ember.report.records import GraphRecord
    from ember.targets import TRITON_INTERPRET
    from ember.tune.apply import library_chooser

    with config.patch(tuning_db=str(tmp_path / "absent.sqlite")):
        choose = library_chooser(TRITON_INTERPRET, tmp_path, GraphRecord("g", "forward", "0/0", "triton-interpret"))
    assert choose is None
    names = [p.__name__ for p in passes_for(PassContext("forward", "triton-interpret", set(), library_choice=choose))]
    assert "choose_gpu_library_implementations" not in names


class Depthwise(torch.nn.Module):
    """A depthwise convolution (stride 2, with a bias) between two pointwise ones."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = torch.nn.Conv2d(4, 16, 1)
        self.depthwise = torch.nn.Conv2d(16, 16, 3, 2, 1, groups=16)
        self.project = torch.nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.relu(self.depthwise(self.expand(x))))


def test_depthwise_sites_checked_and_ember_kernels_applied(tmp_path: Path) -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 4, 12, 12)
    with config.patch(layout_min_activation_to_weight=0.0, depthwise_kernels=False):
        convs = [s for s in collect_work(Depthwise(), (x,), train=True, target="triton-interpret",
                                         loss=lambda out: out.square().mean())[1] if s.op.startswith("conv")]
    assert sorted(s.op for s in convs) == ["conv", "conv_backward"]
    forward = next(s for s in convs if s.op == "conv")
    backward = next(s for s in convs if s.op == "conv_backward")
    assert forward.impls == ("cudnn", "ember") and forward.label.startswith("conv 2x16x12x12 3x3->16 s2 g16")
    assert backward.epilogue == "grads:input,weight"  # (the bias gradient: a sum of its own)
    dev = device_key("cpu")
    db = TuningDB(tmp_path / "t.sqlite")
    for site in convs:  # Ember's kernels pass their check against float64
        result = tune_site(site, db, dev, per_candidate_s=0.01)
        assert result.failed == 0 and result.tried == 1, result.failures

    with _corrupting("ember", output=-1) as corrupted:  # the last gradient asked for
        bad = tune_site(backward, TuningDB(tmp_path / "bad.sqlite"), dev, per_candidate_s=0.01)
    assert corrupted and bad.failed == 1

    db_path = tmp_path / "tuning.sqlite"
    TuningDB(db_path).record([row for site in convs for row in (
        Result(site.key, dev, {}, 2.0, "ok", label=site.label), Result(site.key, dev, {"impl": "ember"}, 1.0, "ok"))])
    eager, model = Depthwise(), Depthwise()
    model.load_state_dict(eager.state_dict())
    want = [eager(x)]
    want[0].square().mean().backward()
    want += [p.grad for p in eager.parameters()]
    with config.patch(layout_min_activation_to_weight=0.0, depthwise_kernels=False, tuning_db=str(db_path)):
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        out = compiled(x)
        out.square().mean().backward()
    for g, w in zip([out, *(p.grad for p in model.parameters())], want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    programs = {g.kind: g.program for g in compiled._ember_backend.log.graphs}
    assert programs["forward"].count("torch.ops.ember.depthwise_conv2d.default") == 1
    assert all(programs["backward"].count(f"torch.ops.ember.depthwise_conv2d_backward_{k}.default") == 1
               for k in ("input", "weight"))


class SelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("target,masked", [("triton-interpret", True), ("triton-interpret", False), ("cpu", True)],
                         ids=["bool_mask", "no_mask", "cpu_target"])
def test_attention_backend_chosen_for_inference(target: str, masked: bool, tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = SelfAttention().eval()
    x = torch.randn(2, 10, 16)
    mask = (torch.rand(2, 1, 10, 10) < 0.7) | torch.eye(10, dtype=torch.bool) if masked else None
    with torch.no_grad():
        sites = [s for s in collect_work(model, (x, mask), train=False, target=target)[1] if s.op == "attention"]
    (site,) = sites
    assert site.impls == ("flash_cpu", "math") and site.label.startswith("attention q 2x2x10x8 kv 2x2x10x8")
    assert ("mask 2x1x10x10 float32" in site.label) == masked  # (SDPA turns a boolean mask into a bias)
    dev = device_key("cpu")
    result = tune_site(site, TuningDB(tmp_path / "t.sqlite"), dev, per_candidate_s=0.01)
    assert result.failed == 0 and result.tried == 1, result.failures

    with _corrupting("math", index=1, by=0.5):
        assert tune_site(site, TuningDB(tmp_path / "bad.sqlite"), dev, per_candidate_s=0.01).failed == 1

    db_path = tmp_path / "tuning.sqlite"
    TuningDB(db_path).record([Result(site.key, dev, {}, 2.0, "ok", label=site.label),
                              Result(site.key, dev, {"impl": "math"}, 1.0, "ok")])
    with config.patch(tuning_db=str(db_path)), torch.no_grad():
        compiled = ember.compile(model, target=target, cache=False)
        got = compiled(x, mask)
        want = model(x, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    program = "\n".join(g.program for g in compiled._ember_backend.log.graphs)
    assert "_scaled_dot_product_attention_math" in program and "flash_attention_for_cpu" not in program


@pytest.mark.parametrize("masked", [True, False], ids=["bool_mask", "no_mask"])
def test_embers_attention_kernel_checked_chosen_and_run(masked: bool, tmp_path: Path) -> None:
    # bf16 on the GPU code path (the interpreter here): Ember's kernel is a candidate per tile
    # configuration, checked against float64; a corrupted one is rejected; a tuned answer runs it.
    torch.manual_seed(8)
    model = SelfAttention().bfloat16().eval()
    x = torch.randn(2, 10, 16).bfloat16()
    mask = (torch.rand(2, 1, 10, 10) < 0.7) | torch.eye(10, dtype=torch.bool) if masked else None
    with torch.no_grad():
        (site,) = [s for s in collect_work(model, (x, mask), train=False, target="triton-interpret")[1]
                   if s.op == "attention"]
    assert site.impls == ("flash_cpu", "math", "ember")
    configs = [c for c, impl in site_candidates(site) if impl == "ember"]
    assert configs and all(set(c) == {"impl", *attention.TILE_KEYS} for c in configs)
    dev = device_key("cpu")
    result = tune_site(site, TuningDB(tmp_path / "t.sqlite"), dev, per_candidate_s=0.01)
    assert result.failed == 0 and result.tried == 1 + len(configs), result.failures

    with _corrupting("ember", index=5, by=0.5):
        assert tune_site(site, TuningDB(tmp_path / "bad.sqlite"), dev, per_candidate_s=0.01).failed == len(configs)

    db_path = tmp_path / "tuning.sqlite"
    TuningDB(db_path).record([Result(site.key, dev, {}, 2.0, "ok", label=site.label),
                              Result(site.key, dev, configs[-1], 1.0, "ok")])
    with config.patch(tuning_db=str(db_path)), torch.no_grad():
        compiled = ember.compile(model, target="triton-interpret", cache=False)
        got = compiled(x, mask)
        want = model.float()(x.float(), mask)
        eager = model.bfloat16()(x, mask)
    # Within 3x of eager bf16's error against float32 (the interpreter truncates bf16: one more ulp).
    assert (got.float() - want).abs().max() <= 3 * (eager.float() - want).abs().max() + 2**-7
    program = "\n".join(g.program for g in compiled._ember_backend.log.graphs)
    assert "torch.ops.ember.attention.default" in program and "flash_attention_for_cpu" not in program
