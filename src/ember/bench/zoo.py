"""The ``zoo`` suite: popular timm and transformers models that are not seed models.

Each case builds from a config with random weights (timm ``pretrained=False``; transformers
models from a ``*Config``), so nothing is downloaded. ``build(False)`` is the full-size model
measured on the GPU; ``build(True)`` keeps the same architecture (the same module classes and
code paths) with few, narrow layers, for CPU runs and tests. Only long-standing constructor
arguments are used: the GPU machine runs older timm and transformers 5.x releases.

Language models run as one forward over the whole sequence (training, or inference without a
key/value cache: ``use_cache=False``); the loss is next-token cross entropy on random targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.bench.cases import Batch, BenchCase, _cross_entropy, _image_batch, _require, primary_tensor

__all__ = ["LSTMLanguageModel", "ZOO_CASES", "ZOO_SUITE"]


# ---------------------------------------------------------------------------------------
# Inputs and losses
# ---------------------------------------------------------------------------------------


def _token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (batch, seq, vocab) logits against (batch, seq) token ids."""
    logits = primary_tensor(out)
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _lm_batch(vocab: int, small_vocab: int, seq: int, small_seq: int
              ) -> Callable[[int, torch.device, torch.Generator, bool], Batch]:
    """Token ids (batch, seq) and next-token targets of the same shape."""

    def make(batch: int, device: torch.device, gen: torch.Generator, small: bool) -> Batch:
        v, n = (small_vocab, small_seq) if small else (vocab, seq)
        ids = torch.randint(1, v, (batch, n + 1), generator=gen)
        return (ids[:, :-1].contiguous().to(device),), ids[:, 1:].contiguous().to(device)

    return make


def _seq2seq_batch(vocab: int, small_vocab: int, src: int, tgt: int, small_src: int, small_tgt: int
                   ) -> Callable[[int, torch.device, torch.Generator, bool], Batch]:
    """``(input_ids, attention_mask, decoder_input_ids)``, the positional order of the
    forward of T5 and BART, and the decoder's next-token targets."""

    def make(batch: int, device: torch.device, gen: torch.Generator, small: bool) -> Batch:
        v, s, t = (small_vocab, small_src, small_tgt) if small else (vocab, src, tgt)
        ids = torch.randint(1, v, (batch, s), generator=gen)
        mask = torch.ones(batch, s, dtype=torch.long)
        dec = torch.randint(1, v, (batch, t + 1), generator=gen)
        inputs = (ids.to(device), mask.to(device), dec[:, :-1].contiguous().to(device))
        return inputs, dec[:, 1:].contiguous().to(device)

    return make


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def _timm(case: str, full: str, **small_kwargs: Any) -> Callable[[bool], nn.Module]:
    def build(small: bool) -> nn.Module:
        timm = _require("timm", case)
        kwargs = small_kwargs if small else {}
        return timm.create_model(full, pretrained=False, num_classes=1000, **kwargs)

    return build


def _transformers(case: str, config: str, model: str, full: dict[str, Any], small: dict[str, Any]
                  ) -> Callable[[bool], nn.Module]:
    def build(is_small: bool) -> nn.Module:
        transformers = _require("transformers", case)
        # use_cache=False: a training step and a one-pass forward build no key/value cache.
        cfg = getattr(transformers, config)(**(small if is_small else full), use_cache=False)
        return getattr(transformers, model)(cfg)

    return build


class LSTMLanguageModel(nn.Module):
    """The word-level LSTM language model of Zaremba et al. 2014 (PyTorch's
    word_language_model example): embedding, a stacked ``nn.LSTM``, dropout, a linear
    decoder to the vocabulary."""

    def __init__(self, vocab: int, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(width, width, layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.drop(self.embed(ids))
        hidden = self.recurrence(emb)
        return self.decoder(self.drop(hidden))

    def recurrence(self, emb: torch.Tensor) -> torch.Tensor:
        # Dynamo does not trace nn.LSTM by default (``allow_rnn`` off, for every torch.compile
        # backend): it breaks the graph. Called inline in ``forward`` the break falls on loading
        # ``self.lstm``, where Dynamo cannot resume, and it compiles the embedding only; from this
        # method the break falls on the call in ``forward`` and Dynamo compiles the decoder too.
        # There the recurrence runs as cuDNN's (or ATen's) LSTM. Ember's inference calls turn
        # ``allow_rnn`` on (``trace_rnn``): one graph, the recurrence unrolled over the sequence.
        hidden, _state = self.lstm(emb)
        return hidden


def _build_lstm(small: bool) -> nn.Module:
    # Full size: the "large" model of Zaremba et al. (2 layers of 1500, vocabulary 10k, dropout 0.65).
    return LSTMLanguageModel(500, 64, 2, 0.65) if small else LSTMLanguageModel(10000, 1500, 2, 0.65)


# ---------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------

_GPT2_SMALL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
_LLAMA_FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
_LLAMA_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_T5_SMALL = dict(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=512)
_BART_FULL = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)  # bart-base
_BART_SMALL = dict(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)

ZOO_CASES: list[BenchCase] = [
    BenchCase(
        "vit_b16", "timm vit_base_patch16_224 (ViT-B/16), 3x224x224",
        _timm("vit_b16", "vit_base_patch16_224", img_size=64, depth=2, embed_dim=64, num_heads=2),
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=32, extra="bench",
    ),
    BenchCase(
        "swin_t", "timm swin_tiny_patch4_window7_224 (shifted-window attention), 3x224x224",
        _timm("swin_t", "swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=32,
              depths=(2, 2), num_heads=(2, 4)),
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=32, extra="bench",
    ),
    BenchCase(
        "convnext_t", "timm convnext_tiny (7x7 depthwise convs, LayerNorm, GELU), 3x224x224",
        _timm("convnext_t", "convnext_tiny", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=32, extra="bench",
    ),
    BenchCase(
        # The small variant is the same network: efficientnet_b0's builder takes no width or depth
        # override in every timm release, and at 64x64 it is small enough.
        "efficientnet_b0", "timm efficientnet_b0 (depthwise convs, squeeze-excite, SiLU), 3x224x224",
        _timm("efficientnet_b0", "efficientnet_b0"),
        _image_batch(224), _cross_entropy, batch_train=128, batch_infer=32, extra="bench",
    ),
    BenchCase(
        "gpt2", "transformers GPT2LMHeadModel(GPT2Config()) (124M), seq 512, next-token loss",
        _transformers("gpt2", "GPT2Config", "GPT2LMHeadModel", {}, _GPT2_SMALL),
        _lm_batch(50257, 512, 512, 32), _token_loss, batch_train=16, batch_infer=1, extra="bench",
    ),
    BenchCase(
        "llama", "transformers LlamaForCausalLM, 12 layers, hidden 768, 12 heads / 4 key-value heads "
        "(RMSNorm, RoPE, SwiGLU), seq 512",
        _transformers("llama", "LlamaConfig", "LlamaForCausalLM", _LLAMA_FULL, _LLAMA_SMALL),
        _lm_batch(32000, 512, 512, 32), _token_loss, batch_train=16, batch_infer=1, extra="bench",
    ),
    BenchCase(
        "t5", "transformers T5ForConditionalGeneration(T5Config()) (t5-small), source 512, target 128",
        _transformers("t5", "T5Config", "T5ForConditionalGeneration", {}, _T5_SMALL),
        _seq2seq_batch(32128, 512, 512, 128, 32, 16), _token_loss, batch_train=16, batch_infer=1,
        extra="bench",
    ),
    BenchCase(
        "bart", "transformers BartForConditionalGeneration (bart-base config), source 512, target 128",
        _transformers("bart", "BartConfig", "BartForConditionalGeneration", _BART_FULL, _BART_SMALL),
        _seq2seq_batch(50265, 512, 512, 128, 32, 16), _token_loss, batch_train=16, batch_infer=1,
        extra="bench",
    ),
    BenchCase(
        "lstm_lm", "word-level LSTM language model (Zaremba et al. large: 2 x 1500, vocab 10k), seq 35; "
        "Dynamo breaks the graph at nn.LSTM (Ember's inference traces it)",
        _build_lstm, _lm_batch(10000, 500, 35, 16), _token_loss, batch_train=20, batch_infer=1,
    ),
]

ZOO_SUITE = [case.name for case in ZOO_CASES]
