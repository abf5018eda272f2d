"""Small real models from timm and transformers, trained one step through Ember's CPU target.

Each model is compiled with ``EMBER_STRICT=1`` (conftest): a graph that fails to compile is an
error here, not a silent fallback. Forward output and every parameter's gradient are compared
with eager on random inputs. Dropout is set to 0 (functional dropout in transformers reads the
config, so the configs carry it too): the comparison needs the same function, not the same RNG.
Gradient tolerance is relative to the model's largest gradient: a batch-norm bias followed by
another batch norm has a true gradient of ~0, and its rounding noise is not an error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ember

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


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _step(fn: Callable, model: torch.nn.Module, inputs: dict, cot: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = _logits(fn(**inputs))
    out.backward(cot if cot is not None else torch.ones_like(out))
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_trains_through_the_cpu_target_like_eager(name: str) -> None:
    build, make_inputs = MODELS[name]
    model = build().train()
    inputs = make_inputs()
    out = _logits(model(**inputs))
    cot = torch.randn_like(out)
    want, want_grads = _step(model, model, inputs, cot)
    compiled = ember.compile(model, target="cpu")
    got, got_grads = _step(compiled, model, inputs, cot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert got_grads.keys() == want_grads.keys()
    scale = max(g.abs().max().item() for g in want_grads.values())
    for n, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-3, atol=1e-5 * scale, msg=lambda m, n=n: f"{n}: {m}")
    log = compiled._ember_backend.log
    assert {g.kind for g in log.graphs} >= {"forward", "backward"}
    assert not [g.error for g in log.graphs if g.error]
    assert sum(g.kernels for g in log.graphs) > 0  # generated CPU kernels ran, not only ATen
