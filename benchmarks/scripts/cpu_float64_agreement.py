"""Ember against eager with both in float64: separates float32 rounding from a wrong result.

A sweep mismatch (``cpu_model_sweep.py``) on a gradient or buffer that is near zero in exact
arithmetic, or behind a ReLU whose mask flips on rounding, or in an ill-conditioned network, shows
as a large float32 error for Ember and for eager alike, or for one of them by chance. Run in
float64, a correct compile agrees with eager to about 1e-10 or closer; a wrong one does not.
One training step (forward, backward with a fixed random cotangent) of a sweep model, the
largest relative gradient difference among gradients above 1e-9 of the largest one.

    python benchmarks/scripts/cpu_float64_agreement.py timm_rexnet_100 tv_mnasnet0_5
    python benchmarks/scripts/cpu_float64_agreement.py --target triton-interpret timm_hgnetv2_b0
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_models import REGISTRY, _register_all  # noqa: E402

import ember  # noqa: E402


def _step(model: torch.nn.Module, fn: object, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    out = fn(*args, **kwargs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    (out * cot).sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def agreement(name: str, target: str | None = None) -> tuple[str, float, float]:
    """(parameter, relative difference, its gradient's norm) of the worst gradient."""
    case = REGISTRY[name]
    torch.manual_seed(0)
    model = case.build().double().train()
    for m in model.modules():  # dropout off, as in the sweep
        if isinstance(getattr(m, "p", None), float):
            m.p = 0.0
    args, kwargs = case.make(torch.Generator().manual_seed(0))
    args = tuple(t.double() if t.is_floating_point() else t for t in args)
    eager = copy.deepcopy(model)
    want = _step(eager, eager, args, kwargs)
    got = _step(model, ember.compile(model, cache=False, **({"target": target} if target else {})), args, kwargs)
    top = max(g.norm().item() for g in want.values())
    return max(((n, ((got[n] - want[n]).norm() / want[n].norm()).item(), want[n].norm().item())
                for n in want if want[n].norm() > 1e-9 * top), key=lambda row: row[1])


if __name__ == "__main__":
    _register_all()
    names = sys.argv[1:]
    chosen = None
    if names[:1] == ["--target"]:
        chosen, names = names[1], names[2:]
    for model_name in names:
        param, diff, norm = agreement(model_name, chosen)
        print(f"{model_name}: largest float64 gradient difference {diff:.3e} ({param}, norm {norm:.3e})", flush=True)
