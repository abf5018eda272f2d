"""Ember's GPU kernels compile for an H100 on a machine without one (runtime/target_compile.py,
bench/gpu_kernels.py): the real compiler, ptxas included, and the device's shared memory limit.

The interpreter tests run the kernels' arithmetic; these catch what only the GPU compiler sees.
They cover the kernels no rule launches (the tuner's tiled matmul with split-K and its attention
kernel, every tile configuration) and the generated kernels of real training steps in bf16 with
the configurations the tuner would time.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from ember.bench import gpu_kernels
from ember.ops import tiled_matmul
from ember.runtime.precompile import job_for
from ember.runtime.target_compile import H100, SHARED_LIMIT, compile_for_target, main


def _problems(results: list) -> list[str]:
    return [f"{r.describe()}: {r.problem()}" for r in gpu_kernels.failures(results)]


def test_every_tile_configuration_of_the_tuners_kernels_compiles_and_fits() -> None:
    jobs = gpu_kernels.tuning_family_jobs(dtypes=(torch.bfloat16,))
    names = {j.name for j in jobs}
    assert names == {"tiled_matmul", "split_k_sum", "attention_forward"}
    assert len(jobs) >= len(tiled_matmul._CONFIGS) * len(tiled_matmul.SPLITS)
    results = compile_for_target(jobs)
    assert _problems(results) == []
    assert all(0 < r.shared <= SHARED_LIMIT[90] for r in results if r.job.name != "split_k_sum")
    assert len({r.triton for r in results}) == 1 and results[0].triton  # one compiler, the one named


class _SmallResNet(nn.Module):
    """A ResNet's kinds of kernels at a fraction of its size: batch norms, an overlapping max
    pool, a residual add, global pooling, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(x.mean((2, 3)))


def test_a_bf16_convolutional_training_step_compiles_for_an_h100(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _SmallResNet()
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jobs = gpu_kernels.model_jobs(model, (x,), True, tmp_path, candidates=1)
    names = {j.name for j in jobs}
    assert any(n.startswith("ember_red") for n in names)  # batch-norm statistics and their gradients
    assert {"max_pool2d_forward", "max_pool2d_backward"} <= names  # Ember's own pooling op
    assert any(dict(j.meta).get("num_warps") for j in jobs)
    assert any("bfloat16" in j.arg_dtypes for j in jobs)
    assert _problems(compile_for_target(jobs)) == []


def test_a_bf16_transformer_training_step_compiles_for_an_h100(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jobs = gpu_kernels.model_jobs(lambda i: model(input_ids=i).logits, (ids,), True, tmp_path, candidates=1)
    assert len(jobs) >= 10  # layer norms, softmax, GELU, their gradients
    assert _problems(compile_for_target(jobs)) == []


def test_a_kernel_past_the_shared_memory_limit_is_reported() -> None:
    # float32 operands in the largest tile, four stages deep: three (128 + 256) x 64 x 4-byte buffers
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        a, b = torch.empty(512, 512, device="cuda"), torch.empty(512, 512, device="cuda")
        c = torch.empty(512, 512, device="cuda")
    job = tiled_matmul.job(a, b, None, c, [128, 256, 64, 8, 8, 4, 1])[0]
    (result,) = compile_for_target([job])
    assert result.error is None and not result.fits and not result.ok
    assert result.shared > SHARED_LIMIT[90] and "shared memory" in result.problem()


def _kernel_file(folder: Path, name: str, body: str) -> Path:
    """A module holding one ``@triton.jit`` kernel ``name(x_ptr, BLOCK)`` with ``body``."""
    path = folder / f"{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    f"def {name}(x_ptr, BLOCK: tl.constexpr):\n" + textwrap.indent(textwrap.dedent(body), "    "))
    return path


def test_a_kernel_the_compiler_rejects_is_reported_with_its_error(tmp_path: Path) -> None:
    path = _kernel_file(tmp_path, "bad_kernel", """
        rows = tl.arange(0, BLOCK)
        tile = tl.load(x_ptr + rows[:, None] * BLOCK + rows[None, :])
        tl.store(x_ptr + rows, tl.dot(tile, tile))  # a 2-D result stored through 1-D pointers
    """)
    (result,) = compile_for_target([job_for(path, "bad_kernel", ["float16"], {"BLOCK": 16})])
    assert result.error is not None and not result.ok
    assert result.problem() == result.error


def test_a_target_that_is_not_one_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="not a Triton target"):
        main(["--target", "h100"])
    assert H100 == "cuda:90:32"


def test_a_kernel_that_kills_its_compile_process_is_charged_alone(tmp_path: Path) -> None:
    good = _kernel_file(tmp_path, "good_kernel", """
        rows = tl.arange(0, BLOCK)
        tl.store(x_ptr + rows, tl.load(x_ptr + rows) * 2)
    """)
    dying = tmp_path / "dying_kernel.py"
    dying.write_text("import os\nos._exit(3)  # a crash outside Python's exceptions\n")
    jobs = [job_for(good, "good_kernel", ["float32"], {"BLOCK": 128}), job_for(dying, "dying_kernel", ["float32"], {})]
    ok, dead = compile_for_target(jobs, processes=1)
    assert ok.ok and ok.shared is not None
    assert not dead.ok and "died (3)" in dead.error


def test_a_model_that_runs_eagerly_has_no_kernels_to_check_and_says_so(tmp_path: Path) -> None:
    def untraceable(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x

    with pytest.raises(RuntimeError, match="no graph of the model reached"):
        gpu_kernels.model_jobs(untraceable, (torch.randn(4),), False, tmp_path)
