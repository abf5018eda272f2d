"""Compile workers without torch (runtime/worker_triton.py): a worker given the parent's target
compiles real sm_90 binaries on this GPU-less machine, under the same Triton key a launch with
torch tensors computes, records them for the parent's static launch, and never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ember.runtime import cubin_records, precompile, worker_triton

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def ember_scale_rows(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, offs < n, other=0).to(tl.float32)
    tl.store(out_ptr + offs, tl.exp(x) * 2.0, offs < n)
'''

WORKER = textwrap.dedent('''
    import json, sys
    from ember.runtime import precompile as pc
    pc._start_worker(0)
    job = pc.CompileJob(sys.argv[1], "ember_scale_rows", ("bfloat16", "float32", pc.int_arg(64)),
                        (("BLOCK", 64),), cache_dir=sys.argv[2], niceness=0, cubin_tag="a GPU tag",
                        cubin_folder=sys.argv[2])
    error, _, _ = pc.compile_job(job)
    from triton.runtime import driver
    print(json.dumps({"error": error, "torch": "torch" in sys.modules,
                      "driver": type(driver.active).__name__}))
''')

KEYS = textwrap.dedent('''
    import importlib.util, json, os, sys
    import torch
    from ember.runtime import worker_triton
    assert worker_triton.install_target_driver("cuda:90:32")
    spec = importlib.util.spec_from_file_location("kernel", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.ember_scale_rows
    ours = fn.warmup(worker_triton.pointer_arg("bfloat16"), worker_triton.pointer_arg("float32"), 64,
                     grid=(1,), BLOCK=64)
    fn.device_caches.clear()  # torch's dtypes below must reach Triton's compile, not its memory
    torchs = fn.warmup(torch.bfloat16, torch.float32, 64, grid=(1,), BLOCK=64)
    other = fn.warmup(worker_triton.pointer_arg("float16"), worker_triton.pointer_arg("float32"), 64,
                      grid=(1,), BLOCK=64)
    print(json.dumps({"ours": ours.hash, "torch": torchs.hash, "other": other.hash,
                      "typed": worker_triton.typed_arguments(ours)}))
''')


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    env = {**os.environ, "EMBER_COMPILE_WORKER": "1", worker_triton.TARGET_ENV: "cuda:90:32",
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def kernel_file(tmp_path: Path) -> Path:
    path = tmp_path / "kernels" / "ember_scale_rows.py"  # a generated kernel's file is named after it
    path.parent.mkdir()
    path.write_text(KERNEL)
    return path


def test_a_worker_compiles_and_records_a_binary_without_torch(tmp_path, kernel_file):
    out = _run(WORKER, str(kernel_file), str(tmp_path / "kernels"), tmp_path=tmp_path)
    assert out == {"error": None, "torch": False, "driver": "TargetOnlyDriver"}
    folder, name = cubin_records.record_place(kernel_file, "ember_scale_rows", tmp_path / "kernels")
    record = cubin_records.record_path(folder, name, KERNEL, "a GPU tag")
    key = cubin_records.key_text(((("BLOCK", 64),), (("bfloat16", True), ("float32", True), 64)))
    entry = cubin_records.read_records(record, name)[key]
    binary = cubin_records.Binary.from_json(entry)
    # the pointers and n reach the binary (BLOCK is folded); Triton adds its scratch pointers
    assert binary.passed == (0, 1, 2) and binary.arg_tys.startswith("OOi") and binary.function == "ember_scale_rows"
    cubin = folder / binary.cubin
    assert cubin_records.intact(cubin) and cubin.read_bytes()[:4] == b"\x7fELF"


def test_stand_in_dtypes_give_the_key_torchs_dtypes_give(tmp_path, kernel_file):
    out = _run(KEYS, str(kernel_file), tmp_path=tmp_path)
    assert out["ours"] == out["torch"] and out["other"] != out["ours"]
    assert out["typed"]["x_ptr"] == "*bf16" and out["typed"]["out_ptr"] == "*fp32"


def test_only_a_cuda_target_is_passed_on():
    class Target:
        def __init__(self, backend, arch, warp_size):
            self.backend, self.arch, self.warp_size = backend, arch, warp_size

    assert worker_triton.target_text(Target("cuda", 90, 32)) == "cuda:90:32"
    assert worker_triton.target_text(Target("hip", "gfx942", 64)) == ""
    assert not worker_triton.install_target_driver("") and not worker_triton.install_target_driver("cuda:x:32")


def test_a_worker_whose_first_compile_fails_goes_back_to_tritons_driver(monkeypatch):
    from triton.runtime import driver

    from ember.runtime import compile_warmup
    previous = driver._active
    calls = []
    monkeypatch.setenv(worker_triton.TARGET_ENV, "cuda:90:32")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # the worker sets it
    monkeypatch.setattr(precompile, "_lower_priority", lambda niceness: None)
    monkeypatch.setattr(compile_warmup, "compile_warmup_kernel", lambda: calls.append("compile") or 1 / 0)
    # Triton's own driver needs a GPU; here it stands in for it with the target-only one
    monkeypatch.setattr(worker_triton, "uninstall_target_driver",
                        lambda: calls.append("uninstall") or worker_triton.install_target_driver("cuda:90:32"))
    try:
        precompile._start_worker(0)
    finally:
        driver.set_active(previous)
    assert calls == ["compile", "uninstall", "compile"]


def test_torch_is_refused_only_inside_and_only_where_not_imported():
    script = textwrap.dedent('''
        import sys
        from ember.runtime.worker_triton import torch_import_refused
        with torch_import_refused():
            try:
                import torch
                print("imported inside")
            except ModuleNotFoundError:
                print("refused inside")
        import torch
        with torch_import_refused():
            import torch.nn  # already imported: nothing refused
        print("imported after", "torch" in sys.modules)
    ''')
    env = {**os.environ, "EMBER_COMPILE_WORKER": "1"}  # ``import ember`` as a worker's: no torch
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:2] == ["refused inside", "imported after True"], done.stderr[-2000:]
