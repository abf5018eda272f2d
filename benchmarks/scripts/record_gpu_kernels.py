"""Record the GPU Triton kernels Ember generates for a model's training step, without a GPU.

The step runs through the Triton interpreter target; each fused group is generated a second
time as the GPU target would (GPU tile sizes and split decisions), and its module file and
compile job are recorded. Feed the list to ``benchmarks/scripts/sm90_compile_time.py``:

    EMBER_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/scripts/record_gpu_kernels.py \
        cyclegan 1 full kernels.json [bf16]

Arguments: model, batch, ``small`` or ``full`` inputs, output JSON, optional ``bf16`` (CPU
autocast). Use an empty cache folder: a cached program skips code generation.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

import ember
import ember.pipeline as P
from ember.bench import models
from ember.codegen import triton_kernel as TK
from ember.runtime.kernels import kernel_file
from ember.runtime.precompile import job_for

_GENERATE = TK.generate_triton


def record(name: str, batch: int, small: bool, out: str, bf16: bool) -> int:
    """Run one training step and write the GPU kernels' compile jobs to ``out``; returns their count."""
    out_dir = Path(tempfile.mkdtemp(prefix="gpu_kernels_"))
    jobs = {}

    def generate(group: object, interpret: bool = False) -> TK.KernelSource:
        for k in _GENERATE(group, interpret=False).launch_order():
            jobs[k.name] = job_for(kernel_file(k, out_dir), k.name, k.arg_dtypes(), k.meta)
        return _GENERATE(group, interpret=interpret)

    P.generate_triton = generate
    case = models.get_case(name)
    model = case.build(True)
    (inputs, target), *_ = models.make_batches(case, batch, torch.device("cpu"), small=small, count=1)
    fn = ember.compile(model, target="triton-interpret")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = case.loss(fn(*inputs), target)
    loss.backward()
    rows = [{"name": j.name, "path": j.path, "dtypes": list(j.arg_dtypes), "meta": dict(j.meta)} for j in jobs.values()]
    with open(out, "w") as f:
        json.dump(rows, f)
    return len(rows)


if __name__ == "__main__":
    a = sys.argv
    n = record(a[1], int(a[2]), a[3] == "small", a[4], len(a) > 5 and a[5] == "bf16")
    print(n, "GPU kernels recorded in", a[4])
