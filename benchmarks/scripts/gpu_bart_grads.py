"""Which Ember configuration gets BART's training gradients wrong on the GPU (a bf16 training step
of the zoo's bart against an fp32 eager reference, encoder and decoder gradients listed apart).

    PYTHONPATH=src python benchmarks/scripts/gpu_bart_grads.py     # about 2 minutes on an H100

Variants: Ember's defaults; CUDA graphs off; eager's NCHW layout (channels_last=False); ATen only
(target="aten": no generated kernels). A variant whose encoder gradients are far off eager's
(ratio > 4) names the stage to look at.
"""

from __future__ import annotations

import sys
import traceback

import torch

import ember
from ember.bench.check import run_seed_step

VARIANTS = {"defaults": {}, "cudagraphs off": {"cudagraphs": False}, "nchw": {"channels_last": False},
            "aten target": {"target": "aten"}}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    bad = 0
    for name, options in VARIANTS.items():
        torch._dynamo.reset()
        try:
            train, _ = run_seed_step("bart", lambda m, o=options: ember.compile(m, **o), device="cuda", batch=4,
                                     small=True, autocast=torch.bfloat16)
        except Exception:  # noqa: BLE001 - report and go on with the next variant
            print(f"{name}: error\n{traceback.format_exc(limit=3)}")
            continue
        parts = {"encoder": [], "decoder": [], "other": []}
        for tensor, (ours, eager) in train.errors.items():
            part = "encoder" if ".encoder." in tensor else "decoder" if ".decoder." in tensor else "other"
            parts[part].append((ours / max(eager, 1e-6), tensor, ours, eager))
        line = []
        for part, rows in parts.items():
            ratio, tensor, ours, eager = max(rows)
            line.append(f"{part} worst ratio {ratio:.1f} ({tensor}: {ours:.2e} vs eager {eager:.2e})")
            bad += part != "other" and ratio > 4
        print(f"{name:15s} " + " | ".join(line))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
