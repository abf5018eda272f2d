"""Small real models from timm and transformers, trained one step through Ember's CPU target.

Each model is compiled with ``EMBER_STRICT=1`` (conftest): a graph that fails to compile is an
error here, not a silent fallback. The forward output and every parameter's gradient of Ember
and of eager (float32) are measured against eager in float64 on random inputs, and Ember may be
at most 4x as far off as eager (or under 1e-5 relative, ``ember.bench.check.acceptable``, the
rule of the seed-model tests): batch norms over a few values per channel are ill-conditioned,
so a fixed tolerance against float32 eager would compare rounding noise. Dropout is 0 (the
transformers configs carry it too: functional dropout reads them): the comparison needs the
same function, not the same random numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import ember
from ember.bench.check import acceptable

FLOOR = 1e-5

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _t5() -> torch.nn.Module:
    cfg = transformers.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=500,
                                dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _distilbert() -> torch.nn.Module:
    cfg = transformers.DistilBertConfig(n_layers=2, dim=64, hidden_dim=128, n_heads=4, vocab_size=500,
                                        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    return transformers.DistilBertForSequenceClassification(cfg)


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randint(1, 500, shape)


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], dict]]] = {
    "gpt2": (_gpt2, lambda: {"input_ids": _tokens(2, 16)}),
    "t5": (_t5, lambda: {"input_ids": _tokens(2, 16), "decoder_input_ids": _tokens(2, 8)}),
    "distilbert": (_distilbert, lambda: {"input_ids": _tokens(2, 16)}),
    "vit_tiny": (lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, drop_rate=0.0),
                 lambda: {"x": torch.randn(2, 3, 32, 32)}),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=10),
                      lambda: {"x": torch.randn(2, 3, 64, 64)}),
}
# efficientnet_b0 is trained and run through the CPU target by the zoo suite's test
# (tests/bench/test_zoo.py), under the same rule.


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _step(fn: Callable, model: torch.nn.Module, inputs: dict, cot: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and parameter gradients of one forward + backward, by name."""
    model.zero_grad(set_to_none=True)
    out = _logits(fn(**inputs))
    out.backward(cot.to(out.dtype))
    grads = {f"grad {n}": p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"output": out.detach(), **grads}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_trains_through_the_cpu_target_like_eager(name: str) -> None:
    build, make_inputs = MODELS[name]
    model = build().train()
    inputs = make_inputs()
    cot = torch.randn_like(_logits(model(**inputs)))
    model64 = copy.deepcopy(model).double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    ref = _step(model64, model64, inputs64, cot)
    eager = _step(model, model, inputs, cot)
    compiled = ember.compile(model, target="cpu")
    got = _step(compiled, model, inputs, cot)
    assert got.keys() == ref.keys() == eager.keys()
    bad = {k: (_rel(got[k], ref[k]), _rel(eager[k], ref[k])) for k in ref
           if not acceptable(_rel(got[k], ref[k]), _rel(eager[k], ref[k]), FLOOR)}
    assert not bad, f"(ember, eager) error vs float64: {bad}"
    log = compiled._ember_backend.log
    assert {g.kind for g in log.graphs} >= {"forward", "backward"}
    assert not [g.error for g in log.graphs if g.error]
    assert sum(g.kernels for g in log.graphs) > 0  # generated CPU kernels ran, not only ATen
