"""Generated kernels launched from recorded binaries (runtime/cubin_launch.py), on the CPU: the
static CUDA launcher and Triton's compiled kernel are stand-ins that record what they are given;
the launch facts are read from Triton's real ``ASTSource``. On a GPU the same code launches real
binaries (benchmarks/scripts/cubin_launch_probe.py, the bench's correctness checks)."""

from __future__ import annotations

import importlib.util
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ember.runtime import cubin_launch, cubin_records
from ember.runtime.cubin_launch import Binary, CubinKernel, binary_of

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scaled_sum(x_ptr, y_ptr, out_ptr, n, flag, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs) * flag, mask=offs < n)
'''

Meta = namedtuple("Meta", "name num_warps num_ctas shared global_scratch_size profile_scratch_size")


@pytest.fixture
def jit_fn(tmp_path):
    path = tmp_path / "scaled_sum_mod.py"
    path.write_text(KERNEL)
    spec = importlib.util.spec_from_file_location("scaled_sum_mod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.scaled_sum


def compiled_for(jit_fn, flag_is_one: bool, **meta_fields) -> SimpleNamespace:
    """What Triton's JIT builds for a launch: int ``flag`` folded to a constant when it is 1."""
    from triton.compiler.compiler import ASTSource
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                 "flag": "constexpr" if flag_is_one else "i32", "XBLOCK": "constexpr"}
    constexprs = {"XBLOCK": 64, **({"flag": 1} if flag_is_one else {})}
    fields = dict(name="scaled_sum", num_warps=4, num_ctas=1, shared=128, global_scratch_size=0,
                  profile_scratch_size=0)
    fields.update(meta_fields)
    return SimpleNamespace(src=ASTSource(jit_fn, signature, constexprs), metadata=Meta(**fields),
                           asm={"cubin": b"\x7fELF-binary-" + bytes(str(flag_is_one), "ascii")})


def test_launch_facts_come_from_tritons_signature(jit_fn):
    binary, cubin = binary_of(compiled_for(jit_fn, flag_is_one=False), n_args=5)
    assert binary.passed == (0, 1, 2, 3, 4) and binary.arg_tys == "OOOiiOO"  # two null scratch pointers
    assert (binary.num_warps, binary.shared, binary.function, binary.scratch) == (4, 128, "scaled_sum", 2)
    assert cubin.startswith(b"\x7fELF")
    folded, _ = binary_of(compiled_for(jit_fn, flag_is_one=True), n_args=5)
    assert folded.passed == (0, 1, 2, 3) and folded.arg_tys == "OOOiOO"  # a constant is not passed
    assert Binary.from_json(folded.to_json()) == folded


@pytest.mark.parametrize("fields, why", [
    ({"num_ctas": 2}, "more than one CTA"),
    ({"global_scratch_size": 256}, "global_scratch_size 256"),
])
def test_binaries_the_static_launcher_cannot_run_stay_on_triton(jit_fn, fields, why):
    found = binary_of(compiled_for(jit_fn, False, **fields), n_args=5)
    assert isinstance(found, cubin_records.OnTriton) and found.why == why


class FakeLauncher:
    """Stands for torch._C._StaticCudaLauncher: records loads and launches."""

    def __init__(self) -> None:
        self.loads: list[tuple] = []
        self.launches: list[tuple] = []

    def _load_kernel(self, path, name, shared, device):
        self.loads.append((Path(path).read_bytes(), name, shared, device))
        return (f"function:{name}", 32, 0)  # torch 2.11's shape: (function, registers, spills)

    def _launch_kernel(self, function, gx, gy, gz, num_warps, shared, arg_tys, args, stream):
        if len(arg_tys) != len(args):  # what torch's launcher checks before launching
            raise RuntimeError("Mismatch between number of argument types and provided arguments")
        self.launches.append((function, (gx, gy, gz), num_warps, shared, arg_tys, args, stream))


class FakeJit:
    """Stands for Triton's JITFunction: launches are recorded, warmup answers the compiled kernel."""

    def __init__(self, jit_fn, **meta_fields) -> None:
        self.jit_fn, self.meta_fields, self.launches = jit_fn, meta_fields, []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))

    def warmup(self, *args, grid, **meta):
        return compiled_for(self.jit_fn, args[4] == 1, **self.meta_fields)


@pytest.fixture
def gpu_stand_ins(monkeypatch):
    launcher = FakeLauncher()
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", launcher, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(cubin_launch, "device_tag", lambda device: "triton-key\ntorch\nGPU\n9.0")
    monkeypatch.setattr(cubin_launch, "STATS", {"stored": 0, "kept": 0, "triton": 0, "recorded": 0})
    return launcher


def tensors(n=64, offset=0):
    x, y, out = (torch.randn(n + 8)[offset:offset + n] for _ in range(3))
    return x, y, out


def make(folder, jit, text=KERNEL):
    def load_jit():
        if jit is None:
            raise AssertionError("the kernel module was imported")
        return jit
    return CubinKernel("scaled_sum", text, folder / "cubins", load_jit)


def test_a_launch_records_the_binary_and_the_next_launches_it(tmp_path, jit_fn, gpu_stand_ins):
    jit = FakeJit(jit_fn)
    kernel = make(tmp_path, jit)
    x, y, out = tensors()
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches  # the first through Triton
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1
    function, grid, warps, shared, tys, args, stream = gpu_stand_ins.launches[0]
    assert (function, grid, warps, shared, tys, stream) == ("function:scaled_sum", (3, 1, 1), 4, 128, "OOOiiOO", 1234)
    assert len(tys) == len(args)
    assert args[:5] == (x, y, out, 64, 5) and args[5:] == (None, None)  # the two unused scratch pointers
    assert list((tmp_path / "cubins").glob("*.cubin")) and list((tmp_path / "cubins").glob("scaled_sum.*.json"))


def test_a_new_process_launches_the_recorded_binary_without_importing_the_module(tmp_path, jit_fn, gpu_stand_ins):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    warm = make(tmp_path, None)  # load_jit would fail
    warm[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(gpu_stand_ins.launches) == 1 and gpu_stand_ins.loads[0][0].startswith(b"\x7fELF")
    assert cubin_launch.STATS["stored"] == 1


def test_other_specialisations_take_tritons_path_and_are_recorded(tmp_path, jit_fn, gpu_stand_ins):
    jit = FakeJit(jit_fn)
    kernel = make(tmp_path, jit)
    x, y, out = tensors()
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    xu, yu, outu = tensors(offset=1)  # 4-byte offsets: not 16-byte aligned
    kernel[(3,)](xu, yu, outu, 64, 5, XBLOCK=64)
    kernel[(3,)](x, y, out, 64, 1, XBLOCK=64)  # an integer equal to 1: folded by Triton
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=128)  # other meta
    assert len(jit.launches) == 4 and not gpu_stand_ins.launches
    kernel[(3,)](x, y, out, 64, 1, XBLOCK=64)
    assert gpu_stand_ins.launches[-1][4] == "OOOiOO" and len(gpu_stand_ins.launches[-1][5]) == 6
    warm = make(tmp_path, None)
    for args, meta in [((xu, yu, outu, 64, 5), 64), ((x, y, out, 64, 1), 64), ((x, y, out, 64, 5), 128)]:
        warm[(3,)](*args, XBLOCK=meta)
    assert len(gpu_stand_ins.launches) == 4


def test_a_damaged_cubin_or_record_is_never_launched(tmp_path, jit_fn, gpu_stand_ins):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    cubin = next((tmp_path / "cubins").glob("*.cubin"))
    cubin.write_bytes(b"\x7fELF-damaged")
    jit = FakeJit(jit_fn)
    make(tmp_path, jit)[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches  # launched once, through Triton
    record = next((tmp_path / "cubins").glob("scaled_sum.*.json"))
    record.write_text("{not json")
    jit = FakeJit(jit_fn)
    kernel = make(tmp_path, jit)
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches
    make(tmp_path, None)[(3,)](x, y, out, 64, 5, XBLOCK=64)  # recorded again, in a readable file
    assert len(gpu_stand_ins.launches) == 1


def test_a_record_of_another_gpu_torch_or_text_is_not_read(tmp_path, jit_fn, gpu_stand_ins, monkeypatch):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    monkeypatch.setattr(cubin_launch, "device_tag", lambda device: "triton-key\ntorch\nanother GPU\n8.0")
    jit = FakeJit(jit_fn)
    make(tmp_path, jit)[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches
    jit = FakeJit(jit_fn)
    make(tmp_path, jit, text=KERNEL + "\n# edited\n")[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches


def test_a_binary_the_launcher_cannot_run_stays_on_triton_in_later_processes(tmp_path, jit_fn, gpu_stand_ins):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn, num_ctas=2))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    jit = FakeJit(jit_fn)
    make(tmp_path, jit)[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 1 and not gpu_stand_ins.launches and not gpu_stand_ins.loads


def test_a_binary_the_launcher_refuses_launches_through_triton_once(tmp_path, jit_fn, gpu_stand_ins, monkeypatch):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    record = next((tmp_path / "cubins").glob("scaled_sum.*.json"))
    record.write_text(record.read_text().replace('"OOOiiOO"', '"OOOii"'))  # a record the launcher refuses
    jit = FakeJit(jit_fn)
    kernel = make(tmp_path, jit)
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    kernel[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(jit.launches) == 2 and not gpu_stand_ins.launches


def test_a_module_of_hand_written_kernels_is_imported_only_for_a_launch_without_a_binary(
        tmp_path, jit_fn, gpu_stand_ins):
    source = tmp_path / "ops_kernels.py"
    source.write_text(KERNEL)
    imports = []

    def load(jit):
        imports.append(1)
        return SimpleNamespace(scaled_sum=jit)
    x, y, out = tensors()
    cold = cubin_launch.KernelModule(source, tmp_path / "kernels", lambda: load(FakeJit(jit_fn)))
    cold.scaled_sum[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert imports == [1] and cold.scaled_sum is cold.scaled_sum
    warm = cubin_launch.KernelModule(source, tmp_path / "kernels", lambda: load(None))
    warm.scaled_sum[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert imports == [1] and len(gpu_stand_ins.launches) == 1
    with pytest.raises(AttributeError):
        warm._private  # noqa: B018


def test_a_compile_workers_binary_is_launched_at_the_parents_first_launch(tmp_path, jit_fn, gpu_stand_ins):
    from ember.runtime import precompile
    module = tmp_path / "scaled_sum.py"  # a generated kernel's file is named after it
    module.write_text(KERNEL)
    job = precompile.job_for(module, "scaled_sum", [torch.float32] * 3 + [precompile.int_arg(64),
                                                                         precompile.int_arg(5)], {"XBLOCK": 64})
    job = precompile.dataclasses.replace(job, cubin_tag=cubin_launch.device_tag(0), cubin_folder=str(tmp_path))
    precompile._record_binary(job, compiled_for(jit_fn, flag_is_one=False))
    folder, name = cubin_launch.record_place(module, "scaled_sum", tmp_path)
    parent = CubinKernel(name, KERNEL, folder, lambda: pytest.fail("the parent went through Triton"))
    x, y, out = tensors()
    parent[(3,)](x, y, out, 64, 5, XBLOCK=64)
    assert len(gpu_stand_ins.launches) == 1 and gpu_stand_ins.launches[0][4] == "OOOiiOO"


def test_a_program_gets_a_cubin_kernel_on_a_gpu_and_tritons_function_when_turned_off(tmp_path, monkeypatch):
    from ember import config
    from ember.codegen.kernel_source import KernelSource
    from ember.runtime import kernels
    monkeypatch.setattr(cubin_launch, "available", lambda: True)
    header, body = KERNEL.split("\n\n\n", 1)
    ks = KernelSource(name="scaled_sum", source=body, digest="0" * 16, args=[], n_inputs=0, grid=1, meta={},
                      header=header, canonical=body)
    kernels.forget_loaded()
    try:
        fn = kernels.load_kernel(ks, tmp_path, interpret=False)
        assert isinstance(fn, CubinKernel) and fn.folder == tmp_path / "cubins" and fn._jit is None
        kernels.forget_loaded()
        with config.patch(cubin_launch=False):
            fn = kernels.load_kernel(ks, tmp_path, interpret=False)
        assert type(fn).__name__ == "JITFunction"
    finally:
        kernels.forget_loaded()


def test_explain_says_how_the_kernels_launched(monkeypatch):
    from ember.report.explain import explain
    monkeypatch.setattr(cubin_launch, "STATS", {"stored": 126, "kept": 1, "triton": 3, "recorded": 3})
    text = str(explain(lambda x: (x.sin() + 1).relu(), torch.randn(4, 8)))
    assert ("126 from recorded binaries (torch's static CUDA launcher), 3 through Triton's launch path and "
            "recorded for the next process, 1 kept on Triton's path") in " ".join(text.split())
    monkeypatch.setattr(cubin_launch, "STATS", {"stored": 0, "kept": 0, "triton": 0, "recorded": 0})
    assert "from recorded binaries" not in str(explain(lambda x: x.cos() * 2, torch.randn(4, 8)))


def test_each_device_loads_its_own_copy_of_the_binary(tmp_path, jit_fn, gpu_stand_ins, monkeypatch):
    x, y, out = tensors()
    make(tmp_path, FakeJit(jit_fn))[(3,)](x, y, out, 64, 5, XBLOCK=64)
    warm = make(tmp_path, None)
    warm[(3,)](x, y, out, 64, 5, XBLOCK=64)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1)
    warm[(3,)](x, y, out, 64, 5, XBLOCK=64)
    # The recording process loaded it on device 0, the warm one on device 0, then on device 1.
    assert [load[3] for load in gpu_stand_ins.loads] == [0, 0, 1] and len(gpu_stand_ins.launches) == 2
