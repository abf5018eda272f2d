"""Tuning a library choice: which implementation a convolution, linear layer, matmul or attention
call runs as.

For one ``LibrarySite`` (passes/library_sites.py) every implementation Ember can emit is built
on fresh random operands (the site's shapes, strides and dtypes; weights scaled by 1/sqrt(fan-in)
so outputs are O(1)), with its weight prepared as the program would (packed / reordered once,
outside the timing), and run with the epilogue the rule would fuse: as a oneDNN post-op where
the implementation fuses it, else as the ATen op after it (what a separate kernel costs). A GPU
matmul site's candidates are cuBLAS, Ember's small-product kernel where the rule took it, and
Ember's tiled kernel in the tile configurations the cost model ranks best (ops/tiled_matmul.py),
compiled by the compile workers side by side before the first is run, and for an addmm read only
by a ReLU, ``aten._addmm_activation`` (the ReLU in cuBLASLt's epilogue; the others run it after
the product); a depthwise convolution's
(or its gradients') are cuDNN and Ember's kernels; attention's are its backends.

Every candidate, the rule's included, is checked against a float64 computation of the captured
ops on the same operands before it may be chosen; a wrong one is recorded as failed. Results go
to the tuning database under the site's key: ``{}`` is the rule's implementation, ``{"impl": name}``
another one, so a choice's gain is the rule's time over the chosen one's.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.passes.library_sites import LibrarySite, TensorSig
from ember.tune.db import Result, TuningDB
from ember.tune.device import fingerprint
from ember.tune.kernels import KernelTuning
from ember.tune.measure import _OUTPUT_HOOKS, _storage_numel, mismatch, time_interleaved_ms

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn


@dataclass(frozen=True)
class LibraryCandidate:
    """What the output hooks of tune/measure.py see for a library candidate (``name``, ``source``)."""

    name: str
    source: str


@dataclass
class Operands:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    other: torch.Tensor | None


def _tensor(sig: TensorSig, gen: torch.Generator, scale: float = 1.0, device: str = "cpu") -> torch.Tensor:
    """Random values in the signature's shape, strides and dtype, on ``device`` (strides kept)."""
    shape, stride, dtype = sig
    val = torch.empty_strided(shape, stride, device="meta")
    base = torch.randn(_storage_numel(val), generator=gen) * scale
    return base.to(getattr(torch, dtype)).to(device).as_strided(shape, stride)


def _device(site: LibrarySite) -> torch.device:
    return torch.device("cuda" if site.device_type == "cuda" else "cpu")


def operands(site: LibrarySite, seed: int) -> Operands:
    """Fresh random operands of ``site`` on its device: a matmul's right operand scaled by
    1/sqrt(k) and a convolution's weight by 1/sqrt(fan-in), so results are O(1); attention's
    queries, keys and values O(1), its mask a bias O(1) (a boolean one all True)."""
    gen = torch.Generator().manual_seed(seed)
    dev = str(_device(site))

    def tensor(sig: TensorSig | None, scale: float = 1.0) -> torch.Tensor | None:
        return _tensor(sig, gen, scale, dev) if sig is not None else None
    if site.op == "matmul":
        return Operands(tensor(site.x), tensor(site.weight, 1.0 / math.sqrt(max(site.x[0][-1], 1))),
                        tensor(site.bias, 0.1), None)  # type: ignore[arg-type]
    if site.op == "attention":
        return Operands(tensor(site.x), tensor(site.weight), tensor(site.bias), tensor(site.other))  # type: ignore[arg-type]
    fan_in = math.prod(site.weight[0][1:])
    return Operands(tensor(site.measured_x()), tensor(site.weight, 1.0 / math.sqrt(max(fan_in, 1))),  # type: ignore[arg-type]
                    tensor(site.bias, 0.1), tensor(site.measured_other()))


def _epilogue(site: LibrarySite, y: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """The captured epilogue as ATen ops (what runs after an implementation that does not fuse it)."""
    epi = site.epilogue
    if epi == "none":
        return y
    if epi.startswith("add"):
        y = y + other
        return torch.relu(y) if epi == "add+relu" else y
    if epi.startswith("gelu:"):
        return F.gelu(y, approximate=epi.split(":", 1)[1])
    ops = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "swish": F.silu,
           "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}
    return ops[epi](y)


_GRADS = ("input", "weight", "bias")


def _grads(site: LibrarySite) -> list[int]:
    """Which gradients a conv_backward site asks for (indices into ``_GRADS``)."""
    return [_GRADS.index(g) for g in site.epilogue.removeprefix("grads:").split(",")]


def _conv_backward(site: LibrarySite, ops: Operands) -> tuple[torch.Tensor, ...]:
    stride, padding, dilation, groups = (list(p) if isinstance(p, tuple) else p for p in site.params)
    wanted = _grads(site)
    mask = [i in wanted for i in range(3)]
    out = aten.convolution_backward(ops.other, ops.x, ops.weight, [ops.weight.shape[0]], stride, padding, dilation,
                                    False, [0, 0], groups, mask)
    return tuple(out[i] for i in wanted)


def _ember_conv_backward(site: LibrarySite, ops: Operands) -> tuple[torch.Tensor, ...]:
    stride, padding, dilation, _ = (list(p) if isinstance(p, tuple) else p for p in site.params)
    ember = torch.ops.ember
    calls = {0: lambda: ember.depthwise_conv2d_backward_input(ops.other, ops.weight, list(ops.x.shape), stride,
                                                              padding, dilation),
             1: lambda: ember.depthwise_conv2d_backward_weight(ops.other, ops.x, ops.weight, stride, padding, dilation),
             2: lambda: ops.other.sum([0, 2, 3])}
    return tuple(calls[i]() for i in _grads(site))


def _attention(site: LibrarySite, ops: Operands, impl: str, config: dict | None = None) -> torch.Tensor:
    from ember.passes.gpu_library_choices import attention_call
    causal, scale = site.params
    op, args, kwargs = attention_call(impl, ops.x, ops.weight, ops.other, ops.bias, causal, scale, config)
    return op(*args, **kwargs)[0]


def _captured(site: LibrarySite, ops: Operands) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The ops as captured, in ATen (no prepared weight, no fused epilogue)."""
    if site.op == "matmul":
        product = torch.bmm if ops.x.dim() == 3 else torch.mm
        y = product(ops.x, ops.weight) if ops.bias is None else torch.addmm(ops.bias, ops.x, ops.weight)
        return _epilogue(site, y, None)
    if site.op == "conv_backward":
        return _conv_backward(site, ops)
    if site.op == "attention":  # ATen's composite: the reference (the rule is a backend: ``_attention``)
        return _attention(site, ops, "math")
    if site.op == "linear":
        wt = ops.weight.t()
        y = torch.addmm(ops.bias, ops.x, wt) if ops.bias is not None else torch.mm(ops.x, wt)
    else:
        stride, padding, dilation, groups = site.params
        y = aten.convolution(ops.x, ops.weight, ops.bias, list(stride), list(padding), list(dilation), False,
                             [0, 0], groups)
    return _epilogue(site, y, ops.other)


def reference(site: LibrarySite, ops: Operands) -> list[torch.Tensor]:
    """The captured ops in float64: what every candidate is checked against."""
    wide = Operands(*(t.double() if t is not None and t.is_floating_point() else t
                      for t in (ops.x, ops.weight, ops.bias, ops.other)))  # (a boolean mask stays one)
    return [t.to(ops.x.dtype) for t in _outputs(_captured(site, wide))]


def _outputs(got: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(got) if isinstance(got, tuple) else [got]


_UNARY_ATTR = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "swish": "swish", "hardswish": "hardswish",
               "hardsigmoid": "hardsigmoid"}


def implementation(site: LibrarySite, impl: str, ops: Operands, config: dict | None = None
                   ) -> Callable[[], torch.Tensor]:
    """A function computing ``site`` (epilogue included) as ``impl`` does (with ``config``: a
    tiled kernel's tiles), its weight prepared now."""
    if site.op == "attention":
        return lambda: _attention(site, ops, impl, config)
    if impl in ("aten", "cublas", "cudnn"):
        return lambda: _captured(site, ops)
    if site.op == "conv" and impl == "ember":
        stride, padding, dilation, _ = (list(p) if isinstance(p, tuple) else p for p in site.params)
        return lambda: torch.ops.ember.depthwise_conv2d(ops.x, ops.weight, ops.bias, stride, padding, dilation)
    if site.op == "conv_backward" and impl == "ember":
        return lambda: _ember_conv_backward(site, ops)
    if site.op == "matmul" and impl == "small_bmm":
        return lambda: _epilogue(site, torch.ops.ember.small_bmm(ops.x, ops.weight), None)
    if site.op == "matmul" and impl == "tiled":
        from ember.ops.tiled_matmul import tiles_of
        tiles = tiles_of(config or {})
        return lambda: _epilogue(site, torch.ops.ember.tiled_matmul(ops.x, ops.weight, ops.bias, tiles), None)
    if site.op == "matmul" and impl == "cublaslt":  # (a ReLU epilogue: passes/gpu_library_choices.py)
        return lambda: aten._addmm_activation(ops.bias, ops.x, ops.weight)
    if site.op == "linear" and impl == "mkl":
        batch = site.x[0][0]
        packed = torch.ops.mkl._mkl_reorder_linear_weight(ops.weight, batch)

        def run_mkl() -> torch.Tensor:
            y = torch.ops.mkl._mkl_linear(ops.x, packed, ops.weight, ops.bias, batch)
            return _epilogue(site, y, ops.other)
        return run_mkl
    if site.op == "linear" and impl == "onednn":
        epi = site.epilogue
        unary, algo = ("gelu", epi.split(":", 1)[1]) if epi.startswith("gelu:") else (epi, "")
        return lambda: mkldnn._linear_pointwise(ops.x, ops.weight, ops.bias, unary, [], algo)
    if site.op == "conv" and impl == "onednn":
        stride, padding, dilation, groups = (list(p) if isinstance(p, tuple) else p for p in site.params)
        packed = mkldnn._reorder_convolution_weight(ops.weight, padding, stride, dilation, groups, list(site.x[0]))
        if site.epilogue.startswith("add"):
            unary = "relu" if site.epilogue == "add+relu" else None
            return lambda: mkldnn._convolution_pointwise.binary(ops.x, ops.other, packed, ops.bias, padding, stride,
                                                               dilation, groups, "add", 1.0, unary, [], "")
        attr = _UNARY_ATTR.get(site.epilogue, "none")
        return lambda: mkldnn._convolution_pointwise(ops.x, packed, ops.bias, padding, stride, dilation, groups,
                                                     attr, [], "")
    raise ValueError(f"no implementation {impl!r} for a {site.op} site")


def _config(site: LibrarySite, impl: str) -> dict:
    return {} if impl == site.impls[0] else {"impl": impl}


def site_candidates(site: LibrarySite, top: int = 6) -> list[tuple[dict, str]]:
    """(configuration, implementation) of every candidate of ``site``, the rule's first; a tiled
    matmul kernel once per tile configuration of the cost model's best ``top``, Ember's attention
    kernel once per tile configuration that suits the tokens."""
    out = []
    for impl in site.impls:
        if site.op == "attention" and impl == "ember":
            from ember.ops.attention import candidates
            out += [({"impl": "ember", **tiles}, impl) for tiles in candidates(site.x[0][2], site.weight[0][2])]
        elif site.op == "matmul" and impl == "tiled":
            from ember.ops.tiled_matmul import candidates
            from ember.tune.device import fingerprint
            (batch, m, k), n = ((1, *site.x[0]) if len(site.x[0]) == 2 else site.x[0]), site.weight[0][-1]
            sms = int(fingerprint("cuda").get("sms", 132)) if site.device_type == "cuda" else 132
            itemsize = torch.empty((), dtype=getattr(torch, site.x[2])).element_size()
            out += [({"impl": "tiled", **tiles}, impl) for tiles in candidates(batch, m, n, k, itemsize, sms, top)]
        else:
            out.append((_config(site, impl), impl))
    return out


_GENERATED = {"matmul": "tiled", "attention": "ember"}  # the site kinds whose Ember kernel has tiles


def _compile_generated_ahead(site: LibrarySite, ops: Operands, todo: list[tuple[dict, str]]) -> None:
    """The candidates of Ember's kernels among ``todo`` (tiled matmuls, attention) compiled by the
    compile workers side by side (on their first launch Triton would compile them one at a time
    while the tuner waits)."""
    configs = [config for config, impl in todo if impl == _GENERATED.get(site.op)]
    if site.device_type != "cuda" or not configs:
        return
    from ember.ops import attention, tiled_matmul
    from ember.runtime import precompile
    if site.op == "attention":
        causal, scale = site.params
        jobs = [attention.job(ops.x, ops.weight, ops.other, ops.bias, causal, scale, attention.tiles_of(c))
                for c in configs]
    else:
        out = ops.x.new_empty((*ops.x.shape[:-1], ops.weight.shape[-1]))  # the product's (contiguous) result
        jobs = [j for c in configs for j in tiled_matmul.job(ops.x, ops.weight, ops.bias, out, tiled_matmul.tiles_of(c))]
    try:
        precompile.precompile(jobs)
    except Exception:  # noqa: BLE001 - compiling ahead only saves time: the first launch compiles anyway
        pass


def tune_site(site: LibrarySite, db: TuningDB, device: str, per_candidate_s: float = 0.2,
              deadline: float | None = None) -> KernelTuning:
    """Check every implementation of ``site`` (the rule's first), time those that pass together,
    and record them. Stops before a candidate once ``deadline`` (a ``perf_counter`` time) has
    passed; what was measured is recorded and the site marked incomplete, finished by a later run."""
    from ember.tune.kernels import INCOMPLETE, incomplete_marker, measured_configs
    out = KernelTuning(site.key, site.label)
    done = measured_configs(db, site.key, device)
    ops = operands(site, int.from_bytes(os.urandom(4), "little"))
    ref = reference(site, ops)
    stamp = time.time()
    results: list[Result] = []
    passed: list[tuple[dict, Callable[[], torch.Tensor]]] = []
    # What a run the budget cut short measured is not measured again (the rule is, beside the rest).
    todo = [(config, impl) for config, impl in site_candidates(site) if not (config and config_key(config) in done)]
    _compile_generated_ahead(site, ops, todo)
    for config, impl in todo:
        if deadline is not None and time.perf_counter() >= deadline and passed:
            results.append(incomplete_marker(site.key, device, out.label, stamp))
            out.incomplete = True
            break
        out.tried += bool(config)
        try:
            run = implementation(site, impl, ops, config)
            got = _outputs(run())
            if got[0].device.type == "cuda":
                torch.cuda.synchronize()
            for hook in list(_OUTPUT_HOOKS):
                hook(LibraryCandidate(f"{site.key}:{impl}", f"library impl={impl} {site.label}"), got)
            why = mismatch(ref, got)
        except Exception as err:  # noqa: BLE001 - an implementation that cannot run here is failed, not fatal
            why = f"{type(err).__name__}: {str(err)[:300]}"
        if why:
            results.append(out.failed_check(site.key, device, config, impl, why, stamp))
            continue
        passed.append((config, run))
    # Timed together, in turn (measure.time_interleaved_ms): a site's candidates are compared with
    # each other, so load from elsewhere must not fall on one of them only.
    times = time_interleaved_ms([run for _, run in passed], _device(site), per_candidate_s * len(passed))
    for (config, _), ms in zip(passed, times):
        results.append(Result(site.key, device, config, ms, "ok", "", out.label, stamp))
    if not out.incomplete:
        db.forget(site.key, device, INCOMPLETE)
    db.record(results, fingerprint(site.device_type))
    return _summary(out, db.results(site.key, device))


def _summary(out: KernelTuning, known: list[Result]) -> KernelTuning:
    ok = [r for r in known if r.usable]
    default = next((r for r in ok if not r.config), None)
    out.default_ms = default.ms if default else None
    if ok:
        out.best_ms, out.best_config = ok[0].ms, ok[0].config
    return out


def config_key(config: dict) -> str:
    from ember.tune.db import config_text
    return config_text(config)
