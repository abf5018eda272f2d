"""Importing generated kernel modules (runtime/kernel_module.py): the code object kept beside the
file by source hash, Triton's per-function cache key kept with a check of Triton and the text,
and module headers that hold only the helpers a kernel calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.codegen.triton_kernel import module_header
from ember.runtime import kernel_module
from ember.runtime.kernels import jit_mode

KERNEL = '''

@triton.jit
def ember_pw_test(in0, out0, n, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xindex < n
    t1 = tl.load(in0 + xindex, xmask, other=0)
    t2 = _round_to_bf16(t1 * SCALE)
    tl.store(out0 + xindex, t2, xmask)
'''


def _write(tmp_path: Path, scale: str = "2.0", name: str = "ember_pw_test") -> tuple[Path, str]:
    text = module_header(KERNEL, interpret=False) + f"\nSCALE = tl.constexpr({scale})\n" + KERNEL
    text = text.replace("ember_pw_test", name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path, text


def _compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file names ``kernel_module.compile_kept`` compiles from source (not from a kept code object)."""
    seen: list[str] = []

    def counting(source, filename, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(filename)
        return compile(source, filename, *args, **kwargs)
    monkeypatch.setattr(kernel_module, "compile", counting, raising=False)  # shadows the builtin there
    return seen


def test_header_holds_only_the_helpers_the_kernel_calls() -> None:
    header = module_header(KERNEL, interpret=False)
    assert "def _round_to_bf16" in header and "import triton.language as tl" in header
    for unused in ("_round_to_fp16", "_sum", "_max", "_min"):
        assert f"def {unused}(" not in header
    reduction = "    t2 = tl.reduce(t1, 1, _max)\n    t3 = tl.reduce(t1, 1, tl.standard._sum_combine)\n"
    header = module_header(reduction, interpret=True)
    assert "def _max(" in header and "def _sum(" not in header  # _sum_combine is Triton's own
    assert "def _round_to_bf16" not in header


def test_code_object_is_kept_by_source_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.dont_write_bytecode", True)  # Python's own .pyc is off: ours still works
    compiles = _compiles(monkeypatch)
    path, _ = _write(tmp_path)
    with jit_mode(True):
        first = kernel_module.import_file("ember_kernels.t1", path)
        again = kernel_module.import_file("ember_kernels.t2", path)
    assert len(compiles) == 1, "the second import takes the kept code object"
    assert first.SCALE == again.SCALE == 2.0

    path.write_text(path.read_text().replace("SCALE = tl.constexpr(2.0)", "SCALE = tl.constexpr(3.0)"))
    with jit_mode(True):
        edited = kernel_module.import_file("ember_kernels.t3", path)
    assert edited.SCALE == 3.0 and len(compiles) == 2, "an edited file is compiled, never the old code"

    cached = kernel_module._code_path(path)
    cached.write_bytes(cached.read_bytes()[:40] + b"damaged")
    with jit_mode(True):
        repaired = kernel_module.import_file("ember_kernels.t4", path)
    assert repaired.SCALE == 3.0 and len(compiles) == 3


def test_kept_code_is_keyed_by_source_and_takes_the_callers_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles = _compiles(monkeypatch)
    cached = tmp_path / "__pycache__" / "p.code"
    source = b"VALUE = 41 + 1\n"
    for _ in range(2):
        namespace: dict = {}
        exec(kernel_module.compile_kept(source, "<program a>", cached), namespace)
        assert namespace["VALUE"] == 42
    assert compiles == ["<program a>"]
    source = b"def f():\n    return 1\n"
    kernel_module.compile_kept(source, "<program a>", cached)
    code = kernel_module.compile_kept(source, "<program b>", cached)  # the kept code, renamed
    namespace = {}
    exec(code, namespace)
    assert compiles == ["<program a>", "<program a>"]
    assert code.co_filename == namespace["f"].__code__.co_filename == "<program b>"  # tracebacks name it
    monkeypatch.setattr(kernel_module.sys, "version", "another interpreter")
    kernel_module.compile_kept(source, "<program b>", cached)  # marshalled by another Python: not used
    assert compiles == ["<program a>", "<program a>", "<program b>"]


def test_code_cache_switch_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_KERNEL_LOAD_CACHE", "0")
    path, _ = _write(tmp_path)
    with jit_mode(True):
        module = kernel_module.import_file("ember_kernels.off", path)
    assert module.SCALE == 2.0
    assert not kernel_module._code_path(path).exists()


def _compiled_fn(path: Path, tag: str):  # noqa: ANN202 - a triton JITFunction
    with jit_mode(False):  # a compiled (not interpreted) function: its cache key is plain Python
        return getattr(kernel_module.import_file(f"ember_kernels.{tag}", path), path.stem)


def test_triton_cache_key_is_kept_and_checked(tmp_path: Path) -> None:
    path, text = _write(tmp_path)
    record = path.with_name(path.name + ".triton-key")
    first = _compiled_fn(path, "k1")
    kernel_module.preset_cache_key(first, path, text)  # none stored: Triton computes it, we keep it
    assert json.loads(record.read_text())["key"] == first.cache_key

    loaded = _compiled_fn(path, "k2")
    kernel_module.preset_cache_key(loaded, path, text)
    assert loaded.hash == first.cache_key, "a new load takes the kept key without Triton's walk"
    fresh = _compiled_fn(path, "k3")
    assert fresh.cache_key == loaded.hash, "the kept key is the one Triton computes"

    # Another text (a constant global changed) never takes the record of the old one.
    path2, text2 = _write(tmp_path / "other", scale="3.0")
    record2 = path2.with_name(path2.name + ".triton-key")
    record2.write_text(record.read_text())
    other = _compiled_fn(path2, "k4")
    kernel_module.preset_cache_key(other, path2, text2)
    assert other.cache_key != first.cache_key
    assert json.loads(record2.read_text())["key"] == other.cache_key

    record.write_text("{not json")  # damaged: computed again and stored again
    damaged = _compiled_fn(path, "k5")
    kernel_module.preset_cache_key(damaged, path, text)
    assert damaged.cache_key == first.cache_key
    assert json.loads(record.read_text())["key"] == first.cache_key


def test_generated_kernels_still_match_eager_through_the_interpreter() -> None:
    import ember

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x * 2 + y).sum(dim=1) + x.amax(dim=1)).to(torch.bfloat16)

    x, y = torch.randn(6, 37), torch.randn(6, 37)
    compiled = ember.compile(f, target="triton-interpret", cache=False)
    torch.testing.assert_close(compiled(x, y), f(x, y), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled(x, y), f(x, y), rtol=2e-2, atol=2e-2)  # loaded kernels again
