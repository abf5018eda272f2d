"""Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable()``) under Ember: gradients as eager's, and with dropout inside a
checkpoint the recompute draws the forward's mask, with the backward compiled
(capture/rng_states.py), not run as captured."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from core_helpers import assert_close, log_of
from torch.utils.checkpoint import checkpoint

import ember


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_train_as_eager(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, target="cpu", warm_start=False)
    for _ in range(2):
        x = torch.randn(4, 8, 16)
        cot = torch.randn(4, 8, 16)
        out = compiled(x.requires_grad_())
        (out * cot).sum().backward()
        want = ref(x.detach().requires_grad_())
        (want * cot).sum().backward()
        assert_close(out, want, "output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"grad {name}")
            p.grad = q.grad = None
    graphs = log_of(compiled).graphs
    assert {g.kind for g in graphs} == {"forward", "backward"} and not any(g.error for g in graphs)


@functools.cache
def _device_check():
    """benchmarks/scripts/gpu_checkpoint_dropout.py, whose model these tests share."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "gpu_checkpoint_dropout.py"
    spec = importlib.util.spec_from_file_location("gpu_checkpoint_dropout", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", ["cpu", "triton-interpret"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_dropout_inside_a_checkpoint_recomputes_the_same_mask(reentrant: bool, target: str) -> None:
    torch.manual_seed(0)
    model = _device_check().DropoutInCheckpoint(reentrant, features=64)
    compiled = ember.compile(model, target=target, warm_start=False)
    grads = set()
    x = torch.randn(32, 64)
    for _ in range(3):
        out = compiled(x)
        out.backward()
        assert_close(out, (model.w * model.w.grad).sum(), "output against the backward's mask")
        grads.add(tuple(model.w.grad.tolist()))
        model.w.grad = None
    assert len(grads) == 3  # the same input, a new mask every call
    log = log_of(compiled)
    backward = [g for g in log.graphs if g.kind == "backward"]
    assert backward and all(not g.dynamic and not g.error for g in backward), [g.target for g in backward]
    assert not log.recompiles


def test_a_transformers_model_with_gradient_checkpointing() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg).train()
    model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, warm_start=False)
    ids, labels = torch.randint(0, 200, (2, 16)), torch.tensor([0, 1])
    loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    assert_close(loss, want, "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_close(p.grad, q.grad, f"grad {name}")
    assert log_of(compiled).graphs
