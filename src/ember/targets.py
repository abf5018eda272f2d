"""Where a graph's generated kernels run: one object per target, owning the decisions that
depend on it, resolved once per captured frame.

    triton            generated Triton kernels on CUDA tensors, compiled by worker processes
    triton-interpret  the same kernels through Triton's CPU interpreter (tests, CI)
    cpu               generated numba kernels on CPU tensors
    aten              no generated code: every op of a Fused group runs through ATen

``resolve_target("auto", tensors)`` picks Triton when a tensor is on a CUDA device, else the
numba target when numba imports, else ATen (with the reason, which ``explain`` reports).
Nothing else compares target names: stages ask the Target.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ember.codegen.kernel_source import KernelSource
    from ember.schedule.plan import KernelPlan


@dataclass
class GeneratedKernels:
    """The codegen stage's artifact: one kernel per Fused group (by step index), and the groups
    left to ATen with the reason."""

    by_step: dict[int, KernelSource] = field(default_factory=dict)
    on_aten: Counter = field(default_factory=Counter)
    # Groups a target's rule leaves to ATen on purpose (step index -> the rule's reason): reported
    # as ATen fallbacks with that reason, not as failed code generation.
    by_rule: dict[int, str] = field(default_factory=dict)

    def unique(self) -> list[KernelSource]:
        """Distinct kernels (several groups can share one by content), in plan order."""
        from ember.codegen.kernel_source import launch_kernels
        return list({ks.name: ks for ks in launch_kernels(self.by_step)}.values())

    def __str__(self) -> str:
        parts = [f"# {len(self.by_step)} generated kernel(s), {len(self.unique())} distinct"]
        parts += [f"# fused group via ATen ({n}x): {why}" for why, n in self.on_aten.items()]
        parts += [ks.source for ks in self.unique()]
        return "\n\n".join(parts)


@dataclass(frozen=True)
class Target:
    """One code-generation target (see the module docstring)."""

    name: str
    device_type: str  # where its tensors live: "cuda" or "cpu"
    language: str | None  # "triton", "numba" or None (ATen only)
    interpret: bool = False  # Triton kernels run through the interpreter
    why_no_codegen: str = ""  # "auto" fell back to ATen: the reason (explain reports it)

    def __str__(self) -> str:
        return self.name

    @property
    def gpu_code_path(self) -> bool:
        """Triton kernels (compiled or interpreted): GPU decompositions, the channels_last pass."""
        return self.language == "triton"

    @property
    def runs_on_cuda(self) -> bool:
        """Programs launch on a CUDA device: CUDA graphs, compile workers."""
        return self.device_type == "cuda"

    @property
    def cpu_library_passes(self) -> bool:
        """CPU inference: frozen parameters, folded batch norm, oneDNN calls."""
        return self.device_type == "cpu" and not self.interpret

    def generate(self, plan: KernelPlan) -> GeneratedKernels:
        """Kernel sources for the plan's Fused groups (the codegen stage)."""
        from ember import config
        out = GeneratedKernels()
        if self.language == "triton":
            from ember.codegen.triton_kernel import generate_triton
            for group in plan.fused():
                out.by_step[group.index] = generate_triton(group, interpret=self.interpret)
        elif self.language == "numba":
            from ember.codegen.cpu_kernel import CpuUnsupported, generate_cpu
            from ember.schedule.rules import lone_reduction
            for group in plan.fused():
                why = lone_reduction(group)
                if why:
                    out.by_rule[group.index] = why
                    continue
                try:
                    out.by_step[group.index] = generate_cpu(group)
                except CpuUnsupported as why:
                    out.on_aten[str(why)] += 1
                except Exception as err:  # noqa: BLE001 - a generator bug costs this group its kernel, never the graph
                    if config.strict():
                        raise
                    out.on_aten[f"CPU code generator error {type(err).__name__}: {err}"] += 1
        elif self.why_no_codegen:
            out.on_aten[self.why_no_codegen] += len(plan.fused())
        return out

    def compile_kernels(self, kernels: GeneratedKernels, kernel_dir: Path) -> None:
        """Compile what must be compiled before the program is linked (numba modules, or loads of
        numba's cached machine code); a module that fails sends its groups to ATen."""
        if self.language != "numba" or not kernels.by_step:
            return
        from ember import config
        from ember.runtime.kernels import compile_cpu_kernels
        failed = compile_cpu_kernels(list(kernels.by_step.values()), kernel_dir)
        if failed and config.strict():
            raise RuntimeError(f"CPU kernel compile failed: {next(iter(failed.values()))}")
        for index in [i for i, ks in kernels.by_step.items() if ks.digest in failed]:
            kernels.on_aten[f"CPU kernel compile error: {failed[kernels.by_step.pop(index).digest]}"] += 1

    def compile_behind(self, kernels: GeneratedKernels, kernel_dir: Path) -> object | None:
        """Start compiling the kernels numba has not cached in worker processes and return the
        pending job (runtime/cpu_compile.BehindCompile), so the program's first calls run their
        groups through ATen meanwhile; None where everything is compiled now (another target,
        ``cpu_aten_first`` off, nothing uncached, no worker allowed)."""
        from ember import config
        if self.language != "numba" or not kernels.by_step or not config.settings().cpu_aten_first:
            return None
        from ember.runtime.cpu_compile import compile_behind
        from ember.runtime.kernels import uncached_cpu_modules
        return compile_behind(uncached_cpu_modules(list(kernels.by_step.values()), kernel_dir))

    def precompiles(self) -> bool:
        """Kernels go to the compile workers ahead of the first call (compiled Triton only)."""
        return self.language == "triton" and not self.interpret

    def load(self, kernel: KernelSource, kernel_dir: Path) -> object:
        """The launchable kernel, for the program's namespace."""
        from ember.runtime.kernels import load_kernel
        return load_kernel(kernel, kernel_dir, interpret=self.interpret)


TRITON = Target("triton", "cuda", "triton")
TRITON_INTERPRET = Target("triton-interpret", "cpu", "triton", interpret=True)
CPU = Target("cpu", "cpu", "numba")
ATEN = Target("aten", "cpu", None)
BY_NAME = {t.name: t for t in (TRITON, TRITON_INTERPRET, CPU, ATEN)}

_NUMBA_PROBLEM: list[str] = []


def cpu_codegen_unavailable() -> str:
    """Why CPU kernels cannot be generated in this process ("" when numba is installed).

    Only whether numba is installed: importing it costs ~0.7 s on a 2-core CPU, which a graph with
    no generated kernel (every op in oneDNN or ATen) need not pay. A numba that is installed but
    fails to import fails each kernel's compile instead, and those groups run through ATen with
    the error as the reason (Target.compile_kernels)."""
    if not _NUMBA_PROBLEM:
        import importlib.util

        try:
            found = importlib.util.find_spec("numba") is not None
        except (ImportError, ValueError) as err:  # a broken or stubbed-out installation
            _NUMBA_PROBLEM.append(f"numba cannot be found ({type(err).__name__}: {err})")
        else:
            _NUMBA_PROBLEM.append("" if found else "numba is not installed")
    return _NUMBA_PROBLEM[0]


def frame_values(gm: object, example_inputs: Iterable[object]) -> list[object]:
    """A Dynamo frame's inputs and the values its graph computes (``example_value`` meta): a frame
    with no CUDA input can still make CUDA tensors (``torch.arange(n, device="cuda")`` of a mask
    builder), and must then take the GPU target, not the CPU one."""
    nodes = getattr(getattr(gm, "graph", None), "nodes", ())
    return list(example_inputs) + [n.meta.get("example_value") for n in nodes]


def resolve_target(requested: str, tensors: Iterable[object]) -> Target:
    """The Target for ``requested`` (an Options.target name) given the frame's tensors."""
    if requested != "auto":
        return BY_NAME[requested]
    if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors):
        return TRITON
    problem = cpu_codegen_unavailable()
    return Target("aten", "cpu", None, why_no_codegen=problem) if problem else CPU
