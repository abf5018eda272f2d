"""Ember against eager on a broad sweep of small models, each in its own process (CPU).

Models: torchvision, timm, transformers (tiny configs) and hand-written modules with unusual ops,
random weights, small inputs. Per model, in a fresh process with an empty ``EMBER_CACHE_DIR``:
1. training: one forward + backward with a fixed random cotangent through ``ember.compile``,
   against eager float32 and a float64 eager reference (a ``.double()`` deep copy). Ember passes
   where its error vs float64 is within ``ember.bench.check.acceptable`` (at most 4x eager's,
   or under 1e-5 relative) for every output, parameter gradient and floating buffer;
2. inference (eval mode, ``torch.no_grad()``): the same on two calls with different inputs;
3. a record: status (ok | mismatch | error | timeout | skipped), the worst tensor with Ember's
   and eager's errors, the exception with the frame in ``src/ember`` that raised it, wall time,
   and Ember's compile log (graphs, graph breaks, ops left to ATen, graphs that fell back).
Integer and bool outputs count the fraction of elements that differ. Dropout and stochastic
depth are off. ``EMBER_CPU_ATEN_FIRST=0`` makes the first calls run the generated CPU kernels,
not ATen while they compile (``--aten-first`` keeps Ember's default).

Run from the repository root:
    python benchmarks/scripts/cpu_model_sweep.py --json /tmp/sweep/default.json
    python benchmarks/scripts/cpu_model_sweep.py --only custom_data_branch,hf_gpt2 --target triton-interpret
    python benchmarks/scripts/cpu_model_sweep.py --list
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
FLOOR = 1e-5
Inputs = tuple[tuple, dict]
LIVE: set[subprocess.Popen] = set()  # running worker processes


@dataclass
class Case:
    family: str
    build: Callable[[], nn.Module]
    make: Callable[[torch.Generator], Inputs]
    train: bool = True


REGISTRY: dict[str, Case] = {}


def _add(name: str, family: str, build: Callable[[], nn.Module], make: Callable[[torch.Generator], Inputs],
         train: bool = True) -> None:
    REGISTRY[name] = Case(family, build, make, train)


def image(*shape: int) -> Callable[[torch.Generator], Inputs]:
    return lambda g: ((torch.randn(*shape, generator=g),), {})


def kw_inputs(**makers: Callable[[torch.Generator], torch.Tensor]) -> Callable[[torch.Generator], Inputs]:
    return lambda g: ((), {k: f(g) for k, f in makers.items()})


def ids(*shape: int, vocab: int = 500) -> Callable[[torch.Generator], torch.Tensor]:  # no pad or special ids
    return lambda g: torch.randint(3, vocab, shape, generator=g)


def randn(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(*shape, generator=g)


class Wrap(nn.Module):
    """``fn(self, *inputs)`` as a module's forward, with ``layers`` (modules, parameters, buffers)."""

    def __init__(self, fn: Callable[..., Any], **layers: Any) -> None:
        super().__init__()
        self.fn = fn
        for k, v in layers.items():  # a plain tensor becomes a buffer
            (self.register_buffer if type(v) is torch.Tensor else self.__setattr__)(k, v)

    def forward(self, *inputs: Any) -> Any:
        return self.fn(self, *inputs)


def _register_torchvision() -> None:
    import torchvision.models as tvm
    from torchvision.models import detection, maxvit, optical_flow, segmentation, video

    # 64 px where a network's last batch norms would see a single position per image at 32 px: with a batch
    # of 2 they normalise 2 values, and float32 eager is itself far (up to 2x) from float64 there.
    plain = ("resnet18 32 | regnet_y_400mf 32 | efficientnet_b0 64 | mobilenet_v2 64 | mobilenet_v3_small 64 | "
             "shufflenet_v2_x0_5 64 | densenet121 64 | convnext_tiny 32 | swin_v2_t 64")
    for entry in plain.split("|"):
        name, px = entry.split()
        _add(f"tv_{name}", "torchvision", lambda n=name: getattr(tvm, n)(num_classes=10), image(2, 3, int(px), int(px)))
    seg = {"weights_backbone": None, "num_classes": 3}
    other = {
        "googlenet": (lambda: tvm.googlenet(aux_logits=False, init_weights=True, num_classes=10), 32),
        "inception_v3": (lambda: tvm.inception_v3(aux_logits=False, init_weights=True, num_classes=10), 75),
        "vit_small": (lambda: tvm.VisionTransformer(32, 8, 2, 4, 64, 128, num_classes=10), 32),
        "maxvit_small": (lambda: maxvit.MaxVit((64, 64), 16, 2, [16, 32], [1, 1], 8, 0.0, num_classes=10), 64),
        "lraspp_mbv3": (lambda: segmentation.lraspp_mobilenet_v3_large(**seg), 64),
    }
    for name, (build, px) in other.items():
        _add(f"tv_{name}", "torchvision", build, image(2, 3, px, px))
    _add("tv_r3d_18", "torchvision", lambda: video.r3d_18(num_classes=10), image(2, 3, 4, 32, 32))
    _add("tv_raft_small", "torchvision",  # two frames in, the list of flow refinements out
         lambda: Wrap(lambda m, a, b: m.raft(a, b, num_flow_updates=2), raft=optical_flow.raft_small(weights=None)),
         lambda g: ((torch.randn(1, 3, 128, 128, generator=g), torch.randn(1, 3, 128, 128, generator=g)), {}))
    det = lambda: detection.fasterrcnn_mobilenet_v3_large_320_fpn(  # noqa: E731
        weights=None, weights_backbone=None, num_classes=3, min_size=128, max_size=128)
    _add("tv_fasterrcnn_mbv3", "torchvision", lambda: Wrap(lambda m, x: m.det(list(x)), det=det()),
         lambda g: ((torch.rand(2, 3, 96, 96, generator=g),), {}), train=False)  # eval-mode detection only


# "model pixels [img] [depth=N]": "img" passes img_size=pixels; depth trims a transformer's blocks.
TIMM = """
tf_efficientnetv2_b0 64 | mobilevit_xxs 64 | levit_128s 64 img | poolformer_s12 32 | mixer_s16_224 32 img
coat_lite_tiny 64 img | maxvit_nano_rw_256 64 img | edgenext_xx_small 64 | repvgg_a0 32 | ghostnet_100 64
eca_nfnet_l0 32 | xcit_nano_12_p16_224 32 img | pvt_v2_b0 64 | eva02_tiny_patch14_224 28 img
cait_xxs24_224 32 img depth=4 | efficientformerv2_s0 64 img | hiera_tiny_224 64 img | resnest14d 32
"""


def _register_timm() -> None:
    import timm

    def builder(model: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            if not timm.is_model(model):
                raise LookupError(f"not in timm {timm.__version__}")
            return timm.create_model(model, pretrained=False, num_classes=10, **kw)
        return build

    for entry in filter(str.strip, TIMM.replace("\n", "|").split("|")):
        model, px, *extra = entry.split()
        kw: dict[str, Any] = {"img_size": int(px)} if "img" in extra else {}
        kw.update({k: int(v) for k, v in (e.split("=") for e in extra if "=" in e)})
        _add(f"timm_{model}", "timm", builder(model, kw), image(2, 3, int(px), int(px)))

    def convmixer() -> nn.Module:
        from timm.models.convmixer import ConvMixer
        return ConvMixer(dim=64, depth=2, kernel_size=5, patch_size=4, num_classes=10)

    _add("timm_convmixer_small", "timm", convmixer, image(2, 3, 32, 32))


def _register_transformers() -> None:
    import transformers as T

    enc = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "max_position_embeddings": 64}
    dec = {**enc, "num_key_value_heads": 2}
    s2s = {"vocab_size": 500, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
           "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
           "decoder_start_token_id": 2}
    vis = {"image_size": 32, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128}
    text, masked = kw_inputs(input_ids=ids(2, 16)), kw_inputs(
        input_ids=ids(2, 16), attention_mask=lambda g: (torch.arange(16) < torch.tensor([[16], [11]])).long())
    seq2seq = kw_inputs(input_ids=ids(2, 16), decoder_input_ids=ids(2, 8))
    pixels = kw_inputs(pixel_values=randn(2, 3, 32, 32))

    def hf(model: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
        return lambda: getattr(T, model)(getattr(T, config)(**kw))

    cases = {
        "bert_mlm": (hf("BertForMaskedLM", "BertConfig", **enc), masked),
        "roberta_cls": (hf("RobertaForSequenceClassification", "RobertaConfig", **enc, num_labels=3), text),
        "albert": (hf("AlbertForMaskedLM", "AlbertConfig", **enc, embedding_size=32), text),
        "distilbert_tok": (hf("DistilBertForTokenClassification", "DistilBertConfig", vocab_size=500, dim=64,
                              n_layers=2, n_heads=4, hidden_dim=128, num_labels=5), masked),
        "deberta_v2": (hf("DebertaV2ForSequenceClassification", "DebertaV2Config", **enc, num_labels=3,
                          relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8), masked),
        "mobilebert": (hf("MobileBertModel", "MobileBertConfig", **{**enc, "intermediate_size": 64},
                          embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32,
                          num_feedforward_networks=2), text),
        "gpt2": (hf("GPT2LMHeadModel", "GPT2Config", vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                    bos_token_id=0, eos_token_id=0), text),
        "gpt_neo": (hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=500, hidden_size=64, num_layers=2,
                       num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0), text),
        "opt": (hf("OPTForCausalLM", "OPTConfig", vocab_size=500, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64), masked),
        "llama": (hf("LlamaForCausalLM", "LlamaConfig", **dec), text),
        "llama_eager_attn": (hf("LlamaForCausalLM", "LlamaConfig", **dec, attn_implementation="eager"), masked),
        "mistral": (hf("MistralForCausalLM", "MistralConfig", **dec, sliding_window=8), text),
        "phi": (hf("PhiForCausalLM", "PhiConfig", **enc, partial_rotary_factor=0.5), text),
        "gemma": (hf("GemmaForCausalLM", "GemmaConfig", **{**dec, "num_key_value_heads": 1}, head_dim=16), text),
        "bloom": (hf("BloomForCausalLM", "BloomConfig", vocab_size=500, hidden_size=64, n_layer=2, n_head=4),
                  masked),  # alibi
        "t5": (hf("T5ForConditionalGeneration", "T5Config", vocab_size=500, d_model=64, d_ff=128, num_layers=2,
                  num_heads=4, d_kv=16), seq2seq),
        "bart": (hf("BartForConditionalGeneration", "BartConfig", **s2s), seq2seq),
        "whisper": (hf("WhisperForConditionalGeneration", "WhisperConfig", **s2s, num_mel_bins=16,
                       max_source_positions=16, max_target_positions=32),
                    kw_inputs(input_features=randn(2, 16, 32), decoder_input_ids=ids(2, 8))),
        "swin": (hf("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=2, embed_dim=16,
                    depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=10), pixels),
        "clip": (hf("CLIPModel", "CLIPConfig", text_config={**enc, "max_position_embeddings": 16},
                    vision_config=vis, projection_dim=32),
                 kw_inputs(input_ids=ids(2, 16), pixel_values=randn(2, 3, 32, 32))),
        "wav2vec2_ctc": (hf("Wav2Vec2ForCTC", "Wav2Vec2Config", **{**enc, "vocab_size": 32}, conv_dim=(32, 32, 32),
                            conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, mask_time_prob=0.0, mask_feature_prob=0.0),
                         kw_inputs(input_values=randn(2, 1600))),
    }
    for name, (build, make) in cases.items():
        _add(f"hf_{name}", "transformers", build, make)


def _inplace_views(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m.lin(x).clone()
    y[:, :4].mul_(2.0)
    y.transpose(0, 1)[1].add_(1.0)
    z = y.view(-1, 4, 4)
    z.diagonal(dim1=1, dim2=2).zero_()
    y.narrow(1, 8, 4).add_(x[:, :4])
    return F.relu_(y) + z.sum(1).repeat(1, 4)


def _where_cumsum_sort(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = m.lin(x)
    h = torch.where(h > 0, h, 0.1) + torch.where(h < -0.5, 1.0, h * 2)
    c = h.cumsum(-1) + h.flip(-1).cumprod(-1).clamp(-10, 10)
    v, i = h.sort(dim=-1, descending=True)
    tv, ti = h.topk(5, dim=-1)
    return c + v, tv * 2, i, ti, torch.logsumexp(h, -1), h.std(-1, correction=0), (h > 0).any(-1)


def _index_scatter(m: nn.Module, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    h = m.lin(x) + m.emb(idx)
    out = h.new_zeros(8, 16).index_put((idx % 8,), h, accumulate=True)
    out = out.scatter_add(0, (idx % 8)[:, None].expand(-1, 16), h * 2)
    g = torch.gather(h, 1, (idx[:, None] + torch.arange(4)) % 16)
    soft = h.masked_fill(h.abs() < 0.1, float("-inf")).softmax(-1)
    h2 = h.clone()
    h2[idx % 3 == 0] = 0.0
    return out.sum() + g.mean(1, keepdim=True) * soft + h2 + h.index_select(0, idx.argsort())


def _spatial_ops(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = F.silu(m.gn(m.conv(x)))
    h = F.interpolate(h, scale_factor=1.5, mode="bilinear", align_corners=False)
    grid = F.affine_grid(m.theta.expand(x.shape[0], 2, 3), list(h.shape), align_corners=False)
    h = m.inorm(F.grid_sample(h, grid, mode="bilinear", padding_mode="border", align_corners=False))
    p = F.unfold(h, kernel_size=3, stride=2).mean(1).sum(-1)
    u = F.pixel_shuffle(m.up(F.avg_pool2d(h, 3, 2, ceil_mode=True)), 2).amax((1, 2, 3))
    return p + u + F.adaptive_max_pool2d(F.pad(h, (1, 2, 0, 1), mode="replicate"), 3).sum((1, 2, 3))


def _einsum_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q, k, v = m.qkv(x).unflatten(-1, (3, 4, 8)).unbind(2)
    a = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(8 ** -0.5).tril().softmax(-1)
    h = torch.einsum("bhqk,bkhd->bqhd", a, v).flatten(2)
    o, w = m.mha(h, x, x, need_weights=True)
    return o + torch.bmm(w, x) + torch.baddbmm(x, w, h, alpha=0.5)


def _dict_output(m: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    m.calls += 1  # a buffer written by forward
    h = m.lin(x)
    return {"h": h, "pair": (h.t(), F.normalize(h, dim=0)), "arg": h.argmax(-1), "pos": h > 0,
            "count": h.floor().to(torch.int64) // 2 % 3, "view": x.t()}


def _data_branch(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = m.a(x)
    h = m.b(h).relu() if h.sum() > 0 else m.b(-h).tanh()  # graph break on a tensor's value
    return h * int((h > 0).sum().item()) + h.nonzero().float().sum()


def _norms_encoder(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = m.bn(m.conv(x.transpose(1, 2))).transpose(1, 2)  # Dynamo does not trace nn.LSTM/GRU: a conv instead
    g = m.ln(h)
    return m.encoder(g) + torch.var_mean(g, dim=1, keepdim=True)[0]


def _mixed_dtypes(m: nn.Module, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = m.lin(x)
    lo = h.to(torch.bfloat16).exp().to(h.dtype) + h.half().sigmoid().to(h.dtype)
    ints = (n * 7 - 20) // 3 + torch.remainder(n - 9, 4) + (n & 6) - torch.div(n, -3, rounding_mode="trunc")
    return lo * ints.float() / (1 + ints.abs().float()), ints.cumsum(-1)


def _register_custom() -> None:
    x16, cl = image(4, 16), torch.channels_last
    lin = lambda i, o: (lambda: nn.Linear(i, o))  # noqa: E731

    wrap = lambda fn, **layers: (lambda: Wrap(fn, **{k: f() for k, f in layers.items()}))  # noqa: E731
    def spatial() -> nn.Module:
        return Wrap(_spatial_ops, conv=nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), gn=nn.GroupNorm(2, 8),
                    inorm=nn.InstanceNorm2d(8, affine=True), up=nn.ConvTranspose2d(8, 4, 2, stride=2),
                    theta=nn.Parameter(torch.tensor([[1.0, 0.1, 0.0], [-0.1, 0.9, 0.05]])))

    def norms_encoder() -> nn.Module:
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)  # eval: its fused fast path
        return Wrap(_norms_encoder, conv=nn.Conv1d(8, 16, 3, padding=1), bn=nn.BatchNorm1d(16),
                    ln=nn.LayerNorm(16, elementwise_affine=False),
                    encoder=nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))

    ints = lambda hi, shape, lo=0: (  # noqa: E731 - (float (n, 16), ints of shape)
        lambda g: ((torch.randn(shape[0], 16, generator=g), torch.randint(lo, hi, shape, generator=g)), {}))
    cases: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Inputs]]] = {
        "inplace_views": (wrap(_inplace_views, lin=lin(16, 16)), x16),
        "inplace_views_strided": (wrap(_inplace_views, lin=lin(16, 16)),  # a transposed, non-contiguous input
                                  lambda g: ((torch.randn(16, 4, generator=g).t(),), {})),
        "where_cumsum_sort": (wrap(_where_cumsum_sort, lin=lin(16, 32)), x16),
        "index_scatter": (wrap(_index_scatter, lin=lin(16, 16), emb=lambda: nn.Embedding(50, 16)), ints(50, (6,))),
        "spatial_ops": (spatial, image(2, 3, 12, 12)),
        "spatial_ops_channels_last": (spatial, lambda g: ((image(2, 3, 12, 12)(g)[0][0].to(memory_format=cl),), {})),
        "einsum_attention": (wrap(_einsum_attention, qkv=lin(32, 96),
                                  mha=lambda: nn.MultiheadAttention(32, 4, batch_first=True)), image(2, 8, 32)),
        "dict_output": (wrap(_dict_output, lin=lin(16, 8), calls=lambda: torch.zeros((), dtype=torch.long)), x16),
        "data_branch": (wrap(_data_branch, a=lin(16, 16), b=lin(16, 16)), x16),
        "norms_encoder": (norms_encoder, image(3, 8, 8)),
        "mixed_dtypes": (wrap(_mixed_dtypes, lin=lin(16, 16)), ints(30, (4, 16), -30)),
    }
    for name, (build, make) in cases.items():
        _add(f"custom_{name}", "custom", build, make)


def _register_all() -> None:
    for register in (_register_torchvision, _register_timm, _register_transformers, _register_custom):
        register()


def _leaves(out: Any, prefix: str = "out") -> dict[str, torch.Tensor]:
    """The tensors of a model's output by path; a transformers output gives its logits."""
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        for key in ("logits", "logits_per_image", "last_hidden_state"):
            if out.get(key) is not None:
                return {f"{prefix}.{key}": out[key]}
    items = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, list | tuple) else []
    return {k: v for key, value in items for k, v in _leaves(value, f"{prefix}.{key}").items()}


def _cast(inputs: Inputs, double: bool) -> Inputs:
    c = lambda t: t.double() if double and isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(c(a) for a in inputs[0]), {k: c(v) for k, v in inputs[1].items()}


def _err(a: torch.Tensor | None, ref: torch.Tensor, floor: float = 1e-12) -> float:
    if a is None or a.shape != ref.shape:
        return float("inf")
    if not ref.is_floating_point():
        return (a != ref).double().mean().item() if ref.numel() else 0.0
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


def _train_step(model: nn.Module, fn: Callable, inputs: Inputs, double: bool) -> dict[str, torch.Tensor]:
    """Outputs, parameter gradients and floating buffers after one forward + backward."""
    model.train().zero_grad(set_to_none=True)
    args, kwargs = _cast(inputs, double)
    out = _leaves(fn(*args, **kwargs))
    terms = [(t * torch.randn(t.shape, generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
              .to(t.dtype)).sum() for i, t in enumerate(out.values()) if t.is_floating_point() and t.requires_grad]
    if terms:
        sum(terms).backward()
    got = {k: t.detach().clone() for k, t in out.items()}
    got.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    got.update({f"buffer {n}": b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
    return got


def _infer(model: nn.Module, fn: Callable, inputs: Inputs, double: bool) -> dict[str, torch.Tensor]:
    model.eval()
    args, kwargs = _cast(inputs, double)
    with torch.no_grad():
        return {k: t.clone() for k, t in _leaves(fn(*args, **kwargs)).items()}


def _compare(errors: dict[str, tuple[float, float, float]], prefix: str, got: dict, eager: dict,
             ref: dict | None) -> None:
    """errors[name] = (Ember's error, eager's error, floor) against float64; without a float64
    reference, Ember's against eager (float32 against float32) with a floor of 1e-3. A gradient's
    error is measured against the model's gradient scale where it is near zero (a conv bias before
    a norm: rounding noise; check.py's rule, 1e-6 of the largest gradient, 1e-4 without float64);
    a buffer's likewise (a batch norm's running mean of values whose batch mean is exactly zero)."""
    base, floor = (ref, FLOOR) if ref is not None else (eager, 1e-3)
    floors = {}
    for kind in ("grad", "buffer"):
        scale = [t.double().norm().item() for k, t in base.items() if k.startswith(kind + " ")]
        floors[kind] = (1e-6 if ref is not None else 1e-4) * max(scale) if scale else 1e-12
    for key, r in base.items():
        f = floors.get(key.split()[0], 1e-12)
        e = _err(eager.get(key), r, f) if ref is not None else 0.0
        errors[f"{prefix} {key}"] = (_err(got.get(key), r, f), e, floor)
    errors.update({f"{prefix} {key} (extra)": (float("inf"), 0.0, FLOOR) for key in set(got) - set(base)})


def _ember_frame(err: BaseException | None) -> str | None:
    """``file:line (function)`` of the innermost frame in src/ember over the exception's chain."""
    found = None
    while err is not None:
        for fr in traceback.extract_tb(err.__traceback__):
            if f"{os.sep}src{os.sep}ember{os.sep}" in fr.filename:
                found = f"{os.path.relpath(fr.filename, REPO)}:{fr.lineno} ({fr.name})"
        err = err.__cause__ or err.__context__
    return found


def _log_summary(compiled: Any, breaks: Any) -> dict[str, Any]:
    log = compiled._ember_backend.log
    return {"graphs": [f"{g.kind}:{g.frame}:{g.kernels}k" for g in log.graphs],
            "graph_errors": [f"{g.kind} {g.frame}: {g.error[:300]}" for g in log.graphs if g.error],
            "unlowered_ops": sorted({r.split(":")[0] for g in log.graphs for r in g.fallback_reasons
                                     if "no Ember lowering" in r}),
            "recompiles": log.recompiles[:5], "gave_up": log.gave_up[:5],
            "graph_breaks": {k[:160]: v for k, v in breaks.counts.most_common(6)}}


def run_case(name: str, target: str | None, seed: int) -> dict[str, Any]:
    """Eager, float64 and Ember runs of one registry model; the record described in the docstring."""
    import ember
    from ember.bench.check import _no_dropout, acceptable
    from ember.report.graph_breaks import collect_graph_breaks

    case = REGISTRY[name]
    rec: dict[str, Any] = {"name": name, "family": case.family, "status": "ok", "stage": "build", "notes": []}
    try:
        torch.manual_seed(seed)
        model = _no_dropout(case.build())
        for m in model.modules():  # Dropout2d and AlphaDropout are no nn.Dropout; nor is torchvision's StochasticDepth
            if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
                m.p = 0.0
        inputs = [case.make(torch.Generator().manual_seed(seed + i)) for i in range(3)]
        eager, ours = copy.deepcopy(model), copy.deepcopy(model)
        rec["stage"] = "eager"
        e_runs = [_train_step(eager, eager, inputs[0], False) if case.train else {}]
        e_runs += [_infer(eager, eager, x, False) for x in inputs[1:]]
    except Exception as err:  # noqa: BLE001 - not Ember's failure: the model is skipped
        rec.update(status="skipped", error=f"{type(err).__name__}: {str(err)[:300]}")
        return rec
    try:
        rmodel = copy.deepcopy(model).double()
        torch.set_default_dtype(torch.float64)  # tensors a forward creates (RAFT's coordinate grid) too
        r_runs: list[dict | None] = [_train_step(rmodel, rmodel, inputs[0], True) if case.train else {}]
        r_runs += [_infer(rmodel, rmodel, x, True) for x in inputs[1:]]
    except Exception as err:  # noqa: BLE001
        r_runs = [None] * 3
        rec["notes"].append(f"no float64 reference ({type(err).__name__}: {str(err)[:120]}); compared with eager")
    torch.set_default_dtype(torch.float32)
    errors: dict[str, tuple[float, float, float]] = {}
    compiled = None
    with collect_graph_breaks() as breaks:
        try:
            rec["stage"] = "ember-compile"
            compiled = ember.compile(ours, **({"target": target} if target else {}))
            for i, x in enumerate(inputs):
                if i == 0 and not case.train:
                    continue
                rec["stage"] = "ember-train" if i == 0 else f"ember-infer{i}"
                got = _train_step(ours, compiled, x, False) if i == 0 else _infer(ours, compiled, x, False)
                _compare(errors, "train" if i == 0 else f"infer{i}", got, e_runs[i], r_runs[i])
            rec["stage"] = "done"
        except Exception as err:  # noqa: BLE001 - the record says what and where
            rec.update(status="error", error=f"{type(err).__name__}: {str(err)[:600]}", ember_frame=_ember_frame(err),
                       traceback="".join(traceback.format_exception(err))[-2500:])
    if compiled is not None:
        try:
            rec["ember"] = _log_summary(compiled, breaks)
        except Exception as err:  # noqa: BLE001 - the log is a bonus
            rec["notes"].append(f"no compile log: {err}")
    bad = {k: v for k, v in errors.items() if not acceptable(*v)}
    pool = bad or errors
    if pool:
        worst = max(pool, key=lambda k: pool[k][0] / max(4 * pool[k][1], pool[k][2]))
        rec["worst"] = {"name": worst, "ember": pool[worst][0], "eager": pool[worst][1]}
    rec.update(n_checked=len(errors), params=sum(p.numel() for p in model.parameters()), bad={k: v[:2] for k, v in sorted(bad.items(), key=lambda kv: -kv[1][0])[:8]})
    if bad and rec["status"] == "ok":
        rec["status"] = "mismatch"
    return rec


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one model in a fresh process with an empty Ember cache; never raises."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-sweep-") as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, EMBER_CACHE_DIR=str(Path(tmp) / "cache"), EMBER_PROGRESS="0",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p))
        env.update(({} if args.aten_first else {"EMBER_CPU_ATEN_FIRST": "0"}) | ({"EMBER_STRICT": "1"} if args.strict else {}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
               "--seed", str(args.seed)] + (["--target", args.target] if args.target else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, cwd=REPO)
        LIVE.add(proc)
        try:
            _, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and its compile workers
            proc.communicate()
            return {"name": name, "family": REGISTRY[name].family, "status": "timeout",
                    "error": f"over {args.timeout} s", "seconds": time.perf_counter() - start}
        finally:
            LIVE.discard(proc)
        rec = json.loads(result.read_text()) if result.exists() else {
            "name": name, "family": REGISTRY[name].family, "status": "error",
            "error": f"worker exited with {proc.returncode} and no result", "traceback": stderr[-2500:]}
    rec["seconds"] = time.perf_counter() - start
    return rec


def print_table(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Ember vs eager (errors relative to float64 eager)")
    for col in ("model", "status", "s", "worst", "ember", "eager", "graphs/breaks", "detail"):
        table.add_column(col, overflow="fold")
    style = {"ok": "green", "mismatch": "red", "error": "red", "timeout": "yellow", "skipped": "dim"}
    for r in records:
        w, em = r.get("worst") or {}, r.get("ember") or {}
        detail = r.get("error") or "; ".join(em.get("graph_errors", [])[:1]) or ""
        if r.get("ember_frame"):
            detail += f" @ {r['ember_frame']}"
        breaks = sum((em.get("graph_breaks") or {}).values())
        table.add_row(r["name"], f"[{style.get(r['status'], '')}]{r['status']}", f"{r.get('seconds', 0):.0f}",
                      w.get("name", "") if r["status"] != "ok" else "", *(f"{w[k]:.2e}" if k in w else "-" for k in ("ember", "eager")),
                      f"{len(em.get('graphs', []))}/{breaks}" if em else "", detail[:160])
    Console(width=200).print(table)
    print("  ".join(f"{k}: {v}" for k, v in sorted(Counter(r["status"] for r in records).items())))
    fell_back = [r["name"] for r in records if (r.get("ember") or {}).get("graph_errors")]
    print(f"graphs Ember could not compile (run through ATen as captured) in: {', '.join(fell_back) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run the sweep, or one model as the worker process."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated model names (see --list)")
    p.add_argument("--family", choices=("torchvision", "timm", "transformers", "custom"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model (default 300)")
    p.add_argument("--json", type=Path, help="write the records here (rewritten after each model)")
    p.add_argument("--jobs", type=int, default=1, help="models run at once (default 1)")
    p.add_argument("--target", help="ember.compile(target=...); default: Ember's default target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="EMBER_STRICT=1: internal compile errors raise")
    p.add_argument("--aten-first", action="store_true", help="keep EMBER_CPU_ATEN_FIRST at its default")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stopped sweep takes its running workers along
        signal.signal(sig, lambda *_: ([os.killpg(q.pid, signal.SIGKILL) for q in LIVE], os._exit(130)))
    _register_all()
    if args.worker:
        args.result.write_text(json.dumps(run_case(args.worker, args.target, args.seed), default=str))
        return 0
    names = [n for n, c in REGISTRY.items() if args.family in (None, c.family)]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        if unknown := [n for n in wanted if n not in REGISTRY]:
            p.error(f"unknown model(s) {unknown}; see --list")
        names = [n for n in wanted if args.family in (None, REGISTRY[n].family)]
    if args.list:
        print("\n".join(f"{n}  ({REGISTRY[n].family})" for n in names))
        return 0
    records: list[dict[str, Any]] = []
    meta = {"target": args.target or "default", "seed": args.seed, "torch": torch.__version__,
            "aten_first": args.aten_first, "strict": args.strict}
    for rec in ThreadPoolExecutor(max_workers=max(1, args.jobs)).map(lambda n: run_one(n, args), names):
        records.append(rec)
        print(f"[{len(records)}/{len(names)}] {rec['name']}: {rec['status']} ({rec.get('seconds', 0):.0f} s)"
              + (f" {rec.get('error', '')[:150]}" if rec["status"] != "ok" else ""), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "results": records}, indent=1, default=str))
    print_table(records)
    return 1 if any(r["status"] in ("mismatch", "error", "timeout") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
