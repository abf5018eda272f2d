"""The Triton kernels a GPU run would compile, gathered on any machine, as compile jobs for
runtime/target_compile.py.

Two sources:
- ``model_jobs``: a model compiled on the ``triton-interpret`` target (the GPU code path: the same
  passes, fusion and library rules) and run once; each fused group's kernel is generated again as
  the GPU target writes it (codegen does not depend on the device, only on the interpreter flag),
  with the best configurations ``ember tune`` would time for it; and the kernels of Ember's own
  ops in its graphs (pooling, depthwise convolution, padding, small products, attention), from the
  graphs' values moved to fake CUDA tensors.
- ``tuning_family_jobs``: every tile configuration of the kernels that only ``ember tune`` puts
  in a graph (the tiled matmul with its split-K sum, the attention kernel), at typical shapes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._subclasses import FakeTensorMode

from ember.runtime.precompile import CompileJob, job_for

_OWN_OPS = ("reflection_pad", "max_pool", "depthwise_conv", "small_bmm", "tiled_matmul", "attention")


def _fake_cuda(fake: FakeTensorMode, val: object) -> object:
    if isinstance(val, torch.Tensor):
        with fake:
            return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="cuda")
    if isinstance(val, (tuple, list)):
        return type(val)(_fake_cuda(fake, v) for v in val)
    return val


def own_op_jobs(gm: torch.fx.GraphModule) -> list[CompileJob]:
    """The jobs of Ember's own ops in ``gm`` (a graph after Ember's passes), its values taken as
    CUDA tensors of the same sizes, strides and dtypes."""
    import importlib
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    saved = {n: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
    try:
        for node, val in saved.items():
            node.meta["val"] = _fake_cuda(fake, val)
        return [j for op in _OWN_OPS for j in importlib.import_module(f"ember.ops.{op}").compile_jobs(gm)]
    finally:
        for node, val in saved.items():
            node.meta["val"] = val


def group_jobs(group: Any, folder: Path, candidates: int = 4) -> list[CompileJob]:
    """The GPU kernel(s) of one fused group, by the generator's rules and with the ``candidates``
    best configurations of the tuner's model, written under ``folder``."""
    from ember.codegen.triton_kernel import generate_triton
    from ember.runtime.kernels import kernel_file
    from ember.tune.space import triton_candidates
    configs: list[dict | None] = [None]
    if candidates:
        configs += [c.config for c in triton_candidates(group, interpret=False)[:candidates]]
    jobs = []
    for config in configs:
        for ks in generate_triton(group, interpret=False, config=config).launch_order():
            jobs.append(job_for(kernel_file(ks, folder), ks.name, ks.arg_dtypes(), ks.meta))
    return jobs


def model_jobs(model: Callable, inputs: tuple, train: bool, folder: Path,
               loss: Callable[[Any], torch.Tensor] | None = None, candidates: int = 4) -> list[CompileJob]:
    """Every kernel a GPU compile of ``model`` on inputs like ``inputs`` would build (see the module
    docstring); the model runs one step on the Triton interpreter to get there."""
    import ember
    from ember.instruments import instrument
    from ember.tune.model_check import run_step

    seen: list[tuple[torch.fx.GraphModule, Any]] = []

    def before(stage: str, record: Any, args: tuple) -> None:
        if stage == "codegen":
            job, plan = args
            seen.append((job.gm, plan))

    compiled = ember.compile(model, target="triton-interpret", cache=False)
    with instrument(before=before):
        run_step(compiled, inputs, train, loss)
    if not seen:  # Dynamo ran it eagerly (a trace it could not make, its recompile limit): nothing to check
        raise RuntimeError("no graph of the model reached Ember's code generation; ember.explain(model, ...) says why")
    jobs: list[CompileJob] = []
    for gm, plan in seen:
        for group in plan.fused():
            jobs += group_jobs(group, folder, candidates)
        jobs += own_op_jobs(gm)
    return list(dict.fromkeys(jobs))


def _cuda(fake: FakeTensorMode, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    with fake:
        return torch.empty(shape, device="cuda", dtype=dtype)


def tuning_family_jobs(dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float16)) -> list[CompileJob]:
    """Every tile configuration of the tiled matmul (each split of K, with and without a bias)
    and of the attention kernel (head dims 64, 80 and 128; no mask, an additive and a boolean
    mask, causal), for each of ``dtypes``."""
    from ember.ops import attention, tiled_matmul
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    jobs: list[CompileJob] = []
    for dtype in dtypes:
        a, b = _cuda(fake, 512, 768, dtype=dtype), _cuda(fake, 768, 3072, dtype=dtype)
        bias, c = _cuda(fake, 3072, dtype=dtype), _cuda(fake, 512, 3072, dtype=dtype)
        for config in tiled_matmul._CONFIGS:
            for split in tiled_matmul.SPLITS:
                bm, bn, bk, warps, stages = config
                tiles = [bm, bn, bk, 8, warps, stages, split]
                jobs += tiled_matmul.job(a, b, bias if split % 2 else None, c, tiles)
        for dim, mask_kind, causal in ((64, None, False), (80, "additive", False), (128, "bool", True)):
            q = _cuda(fake, 2, 4, 128, dim, dtype=dtype)
            mask = (None if mask_kind is None else
                    _cuda(fake, 2, 1, 1, 128, dtype=dtype if mask_kind == "additive" else torch.bool))
            for config in attention._CONFIGS:
                jobs.append(attention.job(q, q, q, mask, causal, None, list(config)))
    return list(dict.fromkeys(jobs))


def scratch_folder() -> Path:
    """A folder for the kernel modules ``model_jobs`` writes (kept until the process ends)."""
    return Path(tempfile.mkdtemp(prefix="ember_gpu_kernels_"))


def failures(results: Iterable[Any]) -> list[Any]:
    """The results (runtime/target_compile.py's) that did not compile or do not fit."""
    return [r for r in results if not r.ok]
