"""The models of the CPU sweep (``cpu_model_sweep.py``): builders and input makers by name.

Two sets. ``core``: 68 small models (torchvision, timm, transformers with tiny configs, hand-written
modules with unusual ops), the set of the first sweeps. ``wider``: further models of the same
libraries, chosen for what ``core`` lacks (LSTMs and recurrent scans, mixture-of-experts routing,
relative and rotary position schemes, grouped and dilated convolutions, pooling attention,
token mixers that are not attention), so that a sweep of them stands for models Ember was not
written against. Random weights, small inputs, dropout off (the sweep turns it off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Inputs = tuple[tuple, dict]



@dataclass
class Case:
    family: str
    build: Callable[[], nn.Module]
    make: Callable[[torch.Generator], Inputs]
    train: bool = True
    group: str = "core"


REGISTRY: dict[str, Case] = {}


def _add(name: str, family: str, build: Callable[[], nn.Module], make: Callable[[torch.Generator], Inputs],
         train: bool = True, group: str = "core") -> None:
    REGISTRY[name] = Case(family, build, make, train, group)


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


# Tiny transformers configurations: encoders, decoders (grouped-query attention), encoder-decoders, ViTs.
HF_ENCODER = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "max_position_embeddings": 64}
HF_DECODER = {**HF_ENCODER, "num_key_value_heads": 2}
HF_SEQ2SEQ = {"vocab_size": 500, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
              "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
              "decoder_start_token_id": 2}
HF_VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}


def hf(model: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    """A transformers model class built from its configuration class with ``kw``."""
    def build() -> nn.Module:
        import transformers as T
        return getattr(T, model)(getattr(T, config)(**kw))
    return build


def _hf_inputs() -> tuple[Callable[[torch.Generator], Inputs], ...]:
    """Input makers: token ids, ids with a padding mask, encoder-decoder ids, pixels."""
    masked = kw_inputs(input_ids=ids(2, 16),
                       attention_mask=lambda g: (torch.arange(16) < torch.tensor([[16], [11]])).long())
    return (kw_inputs(input_ids=ids(2, 16)), masked, kw_inputs(input_ids=ids(2, 16), decoder_input_ids=ids(2, 8)),
            kw_inputs(pixel_values=randn(2, 3, 32, 32)))


def _register_transformers() -> None:
    enc, dec, s2s, vis = HF_ENCODER, HF_DECODER, HF_SEQ2SEQ, HF_VISION
    text, masked, seq2seq, pixels = _hf_inputs()

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


TIMM_WIDER = """
deit_tiny_patch16_224 32 img | regnetx_002 32 | mobilenetv4_conv_small 64 | fastvit_t8 64 | efficientvit_b0 64
convnextv2_atto 32 | rexnet_100 64 | dla34 32 | hrnet_w18_small 64 | res2net50_14w_8s 32 | cspdarknet53 64
dpn68 32 | lcnet_050 64 | inception_next_tiny 32 | mambaout_femto 32 | starnet_s1 32 | ghostnetv2_100 64
selecsls42b 32 | twins_svt_small 64 img | gcvit_xxtiny 64 img | davit_tiny 64 | focalnet_tiny_srf 64
volo_d1_224 32 img | sequencer2d_s 32 | resmlp_12_224 32 img | gmlp_ti16_224 32 img | convit_tiny 32 img
pit_ti_224 32 img | tiny_vit_5m_224 64 | skresnet18 32 | mobileone_s0 32 | hgnetv2_b0 64
"""


def _register_wider_vision() -> None:
    import timm
    import torchvision.models as tvm
    from torchvision.models import detection, segmentation, video

    for entry in filter(str.strip, TIMM_WIDER.replace("\n", "|").split("|")):
        model, px, *extra = entry.split()
        kw: dict[str, Any] = {"img_size": int(px)} if "img" in extra else {}
        _add(f"timm_{model}", "timm", lambda m=model, kw=kw: timm.create_model(m, pretrained=False, num_classes=10, **kw),
             image(2, 3, int(px), int(px)), group="wider")
    for name, px in {"mnasnet0_5": 64, "squeezenet1_1": 64, "resnext50_32x4d": 32, "efficientnet_v2_s": 64,
                     "regnet_x_400mf": 64, "mobilenet_v3_large": 64, "swin_t": 64, "wide_resnet50_2": 32}.items():
        _add(f"tv_{name}", "torchvision", lambda n=name: getattr(tvm, n)(num_classes=10), image(2, 3, px, px),
             group="wider")
    _add("tv_deeplabv3_mbv3", "torchvision", lambda: segmentation.deeplabv3_mobilenet_v3_large(
        weights_backbone=None, num_classes=3, aux_loss=False), image(2, 3, 64, 64), group="wider")
    _add("tv_r2plus1d_18", "torchvision", lambda: video.r2plus1d_18(num_classes=10), image(2, 3, 4, 32, 32),
         group="wider")
    ssd = lambda: detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)  # noqa: E731
    _add("tv_ssdlite_mbv3", "torchvision", lambda: Wrap(lambda m, x: m.det(list(x)), det=ssd()),
         lambda g: ((torch.rand(2, 3, 96, 96, generator=g),), {}), train=False, group="wider")


def _register_wider_transformers() -> None:
    enc, dec, s2s, vis = HF_ENCODER, HF_DECODER, HF_SEQ2SEQ, HF_VISION
    t5 = {"vocab_size": 500, "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16}
    text, masked, seq2seq, pixels = _hf_inputs()
    cases = {
        "electra": (hf("ElectraForPreTraining", "ElectraConfig", **enc, embedding_size=32), masked),
        "funnel": (hf("FunnelModel", "FunnelConfig", vocab_size=500, block_sizes=[1, 1], d_model=64, n_head=4,
                      d_head=16, d_inner=128), masked),
        "mpnet": (hf("MPNetForMaskedLM", "MPNetConfig", **enc), masked),
        "squeezebert": (hf("SqueezeBertForSequenceClassification", "SqueezeBertConfig", **enc, embedding_size=64,
                           q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2,
                           output_groups=2, num_labels=3), masked),
        "convbert": (hf("ConvBertForMaskedLM", "ConvBertConfig", **enc, embedding_size=64, head_ratio=2,
                        conv_kernel_size=3), masked),
        "roformer": (hf("RoFormerForMaskedLM", "RoFormerConfig", **enc, embedding_size=64), masked),
        "xlm_roberta": (hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", **enc), masked),
        "big_bird_full": (hf("BigBirdForMaskedLM", "BigBirdConfig", **enc, attention_type="original_full"), masked),
        "nystromformer": (hf("NystromformerForMaskedLM", "NystromformerConfig", **enc, num_landmarks=4,
                             segment_means_seq_len=16, conv_kernel_size=3), text),
        "fnet": (hf("FNetForMaskedLM", "FNetConfig", **{k: v for k, v in enc.items() if k != "num_attention_heads"},
                    use_tpu_fourier_optimizations=False), text),  # token mixing by a 2-D FFT
        "esm": (hf("EsmForMaskedLM", "EsmConfig", **enc, pad_token_id=1, mask_token_id=2,
                   position_embedding_type="rotary"), masked),
        "xlnet": (hf("XLNetLMHeadModel", "XLNetConfig", vocab_size=500, d_model=64, n_layer=2, n_head=4,
                     d_inner=128), text),
        "gptj": (hf("GPTJForCausalLM", "GPTJConfig", vocab_size=500, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                    n_positions=64, bos_token_id=0, eos_token_id=0), text),
        "gpt_bigcode": (hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=500, n_embd=64, n_layer=2,
                           n_head=4, n_positions=64, multi_query=True, bos_token_id=0, eos_token_id=0), masked),
        "codegen": (hf("CodeGenForCausalLM", "CodeGenConfig", vocab_size=500, n_embd=64, n_layer=2, n_head=4,
                       rotary_dim=8, n_positions=64, n_ctx=64, bos_token_id=0, eos_token_id=0), text),
        "falcon": (hf("FalconForCausalLM", "FalconConfig", vocab_size=500, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, bos_token_id=0, eos_token_id=0), masked),
        "qwen2": (hf("Qwen2ForCausalLM", "Qwen2Config", **dec), masked),
        "qwen3": (hf("Qwen3ForCausalLM", "Qwen3Config", **dec, head_dim=16), text),
        "phi3": (hf("Phi3ForCausalLM", "Phi3Config", **dec, pad_token_id=0), text),
        "stablelm": (hf("StableLmForCausalLM", "StableLmConfig", **dec, partial_rotary_factor=0.25), text),
        "starcoder2": (hf("Starcoder2ForCausalLM", "Starcoder2Config", **dec, sliding_window=8), text),
        "olmo": (hf("OlmoForCausalLM", "OlmoConfig", **dec, pad_token_id=1), text),
        "gemma2": (hf("Gemma2ForCausalLM", "Gemma2Config", **dec, head_dim=16, sliding_window=8,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0), text),
        "mixtral": (hf("MixtralForCausalLM", "MixtralConfig", **dec, num_local_experts=4, num_experts_per_tok=2),
                    text),  # top-2 routing over 4 experts
        "qwen2_moe": (hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **dec, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=64), text),
        "mamba": (hf("MambaForCausalLM", "MambaConfig", vocab_size=500, hidden_size=64, num_hidden_layers=2,
                     state_size=8, expand=2, conv_kernel=4), text),  # a selective scan, step by step on CPU
        "rwkv": (hf("RwkvForCausalLM", "RwkvConfig", vocab_size=500, hidden_size=64, num_hidden_layers=2,
                    attention_hidden_size=64, intermediate_size=128, context_length=64), text),
        "pegasus": (hf("PegasusForConditionalGeneration", "PegasusConfig", **s2s), seq2seq),
        "marian": (hf("MarianMTModel", "MarianConfig", **s2s, decoder_vocab_size=500), seq2seq),
        "mbart": (hf("MBartForConditionalGeneration", "MBartConfig", **s2s), seq2seq),
        "mt5": (hf("MT5ForConditionalGeneration", "MT5Config", **t5, decoder_start_token_id=0), seq2seq),
        "long_t5_local": (hf("LongT5ForConditionalGeneration", "LongT5Config", **t5, local_radius=4,
                             encoder_attention_type="local", decoder_start_token_id=0), seq2seq),
        "deit": (hf("DeiTForImageClassification", "DeiTConfig", **vis, num_labels=10), pixels),
        "beit": (hf("BeitForImageClassification", "BeitConfig", **vis, use_relative_position_bias=True,
                    num_labels=10), pixels),
        "dinov2": (hf("Dinov2Model", "Dinov2Config", **vis), pixels),
        "convnext": (hf("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                        num_labels=10), pixels),
        "segformer": (hf("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                         hidden_sizes=[16, 32], sr_ratios=[2, 1], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                         strides=[4, 2], decoder_hidden_size=32, num_labels=3), pixels),
        "hubert_ctc": (hf("HubertForCTC", "HubertConfig", **{**enc, "vocab_size": 32}, conv_dim=(32, 32, 32),
                          conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                          num_conv_pos_embedding_groups=4, mask_time_prob=0.0, mask_feature_prob=0.0),
                       kw_inputs(input_values=randn(2, 1600))),
    }
    for name, (build, make) in cases.items():
        _add(f"hf_{name}", "transformers", build, make, group="wider")


class _Tagger(nn.Module):
    """Embedding, a bidirectional LSTM and a GRU cell unrolled over time (Dynamo breaks on nn.LSTM)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm = nn.Embedding(60, 16), nn.LSTM(16, 16, batch_first=True, bidirectional=True)
        self.cell, self.out = nn.GRUCell(32, 16), nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq, _ = self.lstm(self.emb(tokens))
        h, outs = seq.new_zeros(seq.shape[0], 16), []
        for t in range(seq.shape[1]):
            h = self.cell(seq[:, t], h)
            outs.append(h)
        return self.out(torch.stack(outs, 1))


def _moe(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weights, chosen = m.router(x).softmax(-1).topk(2, dim=-1)  # top-2 of 4 experts per token
    out = torch.zeros_like(x)
    for e, expert in enumerate(m.experts):
        token, slot = torch.where(chosen == e)  # data-dependent sizes
        out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
    return out


def _fft_filter(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    spec = torch.fft.rfft(m.proj(x), dim=1, norm="ortho")  # a global filter over the sequence
    mixed = torch.fft.irfft(spec * torch.view_as_complex(m.filter), n=x.shape[1], dim=1, norm="ortho")
    return F.layer_norm(mixed + x, (x.shape[-1],))


def _gated_dilated(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for conv, res in zip(m.convs, m.res, strict=True):  # WaveNet's causal, dilated, gated blocks
        h = conv(F.pad(x, (conv.dilation[0] * 2, 0)))
        a, b = h.chunk(2, 1)
        x = x + res(torch.tanh(a) * torch.sigmoid(b))
    return x


def _losses(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = m.lin(x)  # a loss inside forward, as training scripts of many repositories write it
    ce = F.cross_entropy(logits, y, label_smoothing=0.1, ignore_index=0)
    bag = m.bag(y.view(-1, 2), per_sample_weights=x[: y.numel() // 2, :2].sigmoid().reshape(-1, 2))
    head = logits[: bag.shape[0]]
    return ce + F.smooth_l1_loss(bag, head) + F.kl_div(head.log_softmax(-1), bag.softmax(-1), reduction="batchmean")


def _register_wider_custom() -> None:
    def shuffle_convs() -> nn.Module:
        def fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(m.g(x))  # grouped 3x3, channel shuffle, a 1x1 back
            h = h.unflatten(1, (4, 4)).transpose(1, 2).flatten(1, 2)
            return m.p(h) + F.max_pool2d(x, 3, 1, 1, dilation=1)
        return Wrap(fn, g=nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=4), p=nn.Conv2d(16, 16, 1))

    experts = lambda: Wrap(_moe, router=nn.Linear(16, 4), experts=nn.ModuleList(  # noqa: E731
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4)))
    cases: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Inputs]]] = {
        "lstm_gru_tagger": (_Tagger, lambda g: ((torch.randint(0, 60, (3, 7), generator=g),), {})),
        "moe_top2": (experts, image(12, 16)),
        "fft_filter": (lambda: Wrap(_fft_filter, proj=nn.Linear(16, 16),
                                    filter=nn.Parameter(torch.randn(5, 16, 2) * 0.5)), image(2, 8, 16)),
        "gated_dilated_conv1d": (lambda: Wrap(_gated_dilated, convs=nn.ModuleList(
            nn.Conv1d(8, 16, 3, dilation=d) for d in (1, 2, 4)), res=nn.ModuleList(nn.Conv1d(8, 8, 1) for _ in range(3))),
            image(2, 8, 20)),
        "losses_in_forward": (lambda: Wrap(_losses, lin=nn.Linear(16, 6), bag=nn.EmbeddingBag(6, 6, mode="sum")),
                              lambda g: ((torch.randn(8, 16, generator=g), torch.randint(0, 6, (8,), generator=g)), {})),
        "grouped_dilated_shuffle": (shuffle_convs, image(2, 16, 10, 10)),
    }
    for name, (build, make) in cases.items():
        _add(f"custom_{name}", "custom", build, make, group="wider")


def _register_all() -> None:
    for register in (_register_torchvision, _register_timm, _register_transformers, _register_custom,
                     _register_wider_vision, _register_wider_transformers, _register_wider_custom):
        register()
