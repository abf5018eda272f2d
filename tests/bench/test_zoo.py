"""The zoo suite at its small size through Ember's CPU target: one training step and one
inference call of each model, Ember vs eager, both measured against eager in float64.

Fresh random weights and inputs (``ember.bench.check.run_seed_step``), dropout off (the
comparison needs the same function, not the same random numbers), ``EMBER_STRICT=1`` so a graph
Ember fails to compile is an error, not a silent fallback. Checked: the output, the loss, every
parameter gradient and float buffer (batch-norm statistics), and the inference output; Ember may
be 4x as far from float64 as eager float32 is, or under 1e-5 relative
(``ember.bench.check.acceptable``, the rule of the seed-model tests). Gradients that are zero in
exact arithmetic (a bias feeding a batch norm or a softmax over keys) are compared the same way:
both sides are rounding noise there and the rule holds against eager's noise.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import ember
from ember.bench.check import acceptable, run_seed_step
from ember.bench.models import SUITES

pytest.importorskip("timm")
pytest.importorskip("transformers")

FLOOR = 1e-5


@pytest.fixture(autouse=True)
def strict_ember(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EMBER_STRICT", "1")
    for name in ("EMBER_TARGET", "EMBER_CUDAGRAPHS", "EMBER_CHECK", "TRITON_INTERPRET", "DEBUG"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", SUITES["zoo"])
def test_zoo_model_trains_and_infers_through_ember_like_eager(name: str) -> None:
    pytest.importorskip("numba")
    compiled = []

    def compile_fn(model: torch.nn.Module):
        fn = ember.compile(model, target="cpu")
        compiled.append(fn)
        return fn

    train, infer = run_seed_step(name, compile_fn, device="cpu", batch=2, small=True, seed=1)
    for result in (train, infer):
        bad = {k: v for k, v in result.errors.items() if not acceptable(v[0], v[1], FLOOR)}
        assert not bad, f"{name} {result.mode}: (ember, eager) error vs float64: {bad}"
    assert sum(1 for k in train.errors if k.startswith("grad ")) > 0 and "output" in infer.errors

    # Ember compiled the model (not only ran it eagerly): forward, backward and inference graphs,
    # no graph failed, and generated code ran somewhere.
    log = compiled[0]._ember_backend.log
    kinds = Counter(g.kind for g in log.graphs)
    assert kinds["forward"] >= 1 and kinds["backward"] >= 1 and kinds["inference"] >= 1, kinds
    assert not [g.error for g in log.graphs if g.error]
    assert sum(g.kernels for g in log.graphs) >= 1
