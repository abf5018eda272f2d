"""What Ember shows and writes: the debug dump folder, the generated program, generated kernel
files, ``check=True``, the ``EMBER_TARGET`` environment variable and ``DEBUG`` printing.

Triton cases use ``target="triton-interpret"`` (Triton's CPU interpreter) on tiny shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from core_helpers import assert_compiled_cleanly, check_against_eager, log_of

import ember
from ember.config import Options
from ember.instruments import instrument
from ember.pipeline import debug_folder

aten = torch.ops.aten


def softmax_mul_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.softmax(-1) * y + 1


def tiny_inputs() -> list[torch.Tensor]:
    return [torch.randn(4, 8), torch.randn(4, 8)]


def slug(title: str) -> str:
    slugged = debug_folder(title)
    assert re.fullmatch(r"[\w.-]+", slugged), slugged
    return slugged


# -- debug_dir --------------------------------------------------------------------------------------

def test_debug_dir_has_every_artefact_of_every_graph(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    compiled = ember.compile(softmax_mul_add, target="triton-interpret", debug_dir=str(dump),
                             cache_dir=str(tmp_path / "cache"))
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert sorted(g.kind for g in log.graphs) == ["backward", "forward"]

    folders = sorted(p.name for p in dump.iterdir())
    assert folders == sorted(slug(g.title) for g in log.graphs)
    for g in log.graphs:
        folder = dump / slug(g.title)
        assert g.target == "triton-interpret"
        names = sorted(p.name for p in folder.iterdir())
        pass_files = [f"{i + 1:02d}_{name}.py" for i, (name, _, _) in enumerate(g.passes)]
        assert pass_files == ["01_eliminate_dead_code.py", "02_replace_functional_copies.py",
                              "03_fold_constants.py", "04_eliminate_common_subexpressions.py",
                              "05_eliminate_dead_code.py", "06_pad_matmul_dims.py",
                              "07_generate_small_bmms.py", "08_channels_last_layout.py",
                              "09_remove_layout_preserving_clones.py"]
        # GPU targets: pad_matmul.py, small_bmm.py, layout.py, cleanup.py
        assert names == sorted(["00_captured.py", *pass_files, "plan.txt", "program.py", "kernels"])
        assert "def forward" in (folder / "00_captured.py").read_text()
        for f in pass_files:
            assert "torch.ops.aten." in (folder / f).read_text()
        assert (folder / "plan.txt").read_text() == g.plan_text and "fused-" in g.plan_text
        program = (folder / "program.py").read_text()
        assert program == g.program
        assert program.startswith(f"# Ember program: {g.title}") and "def run(args):" in program

        kernels = sorted((folder / "kernels").glob("*.py"))
        assert len(kernels) == g.unique_kernels >= 1 and g.kernels >= g.unique_kernels
        assert {k.stem for k in kernels} == set(g.kernel_sources)
        for k in kernels:
            text = k.read_text()
            assert "@triton.jit" in text and f"def {k.stem}(" in text
            assert "# source ops:" in text
            assert f"{k.stem}[(" in program  # the program launches every dumped kernel
        assert set(g.stage_seconds) >= {"passes", "schedule", "codegen", "program"}
        assert all(v >= 0.0 for v in g.stage_seconds.values())

    forward = next(g for g in log.graphs if g.kind == "forward")
    # The forward program names the ATen ops each line came from.
    for op in ("amax", "sub", "exp", "sum", "div", "mul", "add"):
        assert op in forward.program, op
    assert "[generated ember_" in forward.program
    kernel_text = next((dump / slug(forward.title) / "kernels").glob("*.py")).read_text()
    assert "amax.default(" in kernel_text and "tl.exp" in kernel_text


def test_aten_program_says_where_each_op_ran(tmp_path: Path) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).cumsum(-1).relu() * 2.0

    compiled = ember.compile(fn, target="aten", debug_dir=str(tmp_path))
    check_against_eager(compiled, fn, [torch.randn(4, 5), torch.randn(5, 3)])
    forward = next(g for g in log_of(compiled).graphs if g.kind == "forward")
    program = (tmp_path / slug(forward.title) / "program.py").read_text()
    assert "aten.mm.default(" in program and "# [library]" in program
    assert "aten.cumsum.default(" in program and "# [fallback: no Ember lowering for cumsum" in program
    assert "# [fused via ATen" in program and "aten.relu.default(" in program
    assert not list((tmp_path / slug(forward.title)).glob("kernels/*.py"))  # aten: no generated kernels


# -- check=True ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["aten", "triton-interpret"])
def test_check_option_passes_for_a_correct_function(target: str, tmp_path: Path) -> None:
    compiled = ember.compile(softmax_mul_add, target=target, check=True, cache_dir=str(tmp_path))
    assert compiled._ember_backend.options.check is True
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())  # later calls skip the check
    assert_compiled_cleanly(log_of(compiled))


def _add_becomes_sub(gm: torch.fx.GraphModule) -> int:
    """A wrong 'optimisation': every aten.add.Tensor becomes aten.sub.Tensor."""
    changed = 0
    for n in gm.graph.nodes:
        if n.target == aten.add.Tensor:
            n.target = aten.sub.Tensor
            changed += 1
    return changed


@pytest.mark.parametrize("check", [True, False])
def test_check_option_catches_a_miscompile(check: bool) -> None:
    def miscompile(stage: str, record: object, gm: object) -> None:
        if stage == "passes":  # a pass that turns add into sub, after the real ones
            _add_becomes_sub(gm)
            gm.recompile()

    compiled = ember.compile(softmax_mul_add, target="aten", check=check)
    x, y = tiny_inputs()
    with instrument(after=miscompile):
        if check:
            with pytest.raises(ember.EmberMismatchError, match="differs from eager"):
                compiled(x, y)
        else:  # without the check the miscompile goes unnoticed: what check=True is for
            assert not torch.allclose(compiled(x, y), softmax_mul_add(x, y))


# -- EMBER_TARGET -----------------------------------------------------------------------------------

def test_ember_target_environment_variable_selects_the_target(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    assert Options.from_env().target == "auto"
    monkeypatch.setenv("EMBER_TARGET", "triton-interpret")
    assert Options.from_env().target == "triton-interpret"
    assert Options.from_env(target="aten").target == "aten"  # explicit options beat the environment

    compiled = ember.compile(softmax_mul_add, cache_dir=str(tmp_path))
    assert compiled._ember_backend.options.target == "triton-interpret"
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert {g.target for g in log.graphs} == {"triton-interpret"}
    assert all(g.kernels >= 1 for g in log.graphs)


def test_ember_target_environment_variable_aten_and_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_TARGET", "aten")
    compiled = ember.compile(softmax_mul_add)
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())
    assert {g.target for g in log_of(compiled).graphs} == {"aten"}
    assert all(g.kernels == 0 for g in log_of(compiled).graphs)

    monkeypatch.setenv("EMBER_TARGET", "tpu")
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        Options.from_env()
    with pytest.raises(ValueError, match="unknown target"):
        ember.compile(softmax_mul_add)


def test_other_environment_variables_and_unknown_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_CHECK", "1")
    monkeypatch.setenv("EMBER_DEBUG_DIR", str(tmp_path))
    opts = Options.from_env()
    assert opts.check is True and opts.debug_dir == str(tmp_path)
    monkeypatch.setenv("EMBER_CHECK", "0")
    assert Options.from_env().check is False
    with pytest.raises(TypeError, match="unknown option"):
        ember.compile(softmax_mul_add, targt="aten")


# -- DEBUG printing --------------------------------------------------------------------------------

def test_debug_1_prints_the_plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DEBUG", "1")
    compiled = ember.compile(softmax_mul_add, target="aten")
    x, y = tiny_inputs()
    with torch.no_grad():
        out = compiled(x, y)
    torch.testing.assert_close(out, softmax_mul_add(x, y), rtol=1e-4, atol=1e-5)
    printed = capsys.readouterr().out
    (graph,) = log_of(compiled).graphs
    assert f"# ember: kernel plan of {graph.title}" in printed
    assert graph.plan_text in printed and "fused-reduction" in printed
    assert "# Ember program" not in printed  # programs and kernels print from DEBUG=2 on


def test_debug_2_prints_kernels_and_program(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("DEBUG", "2")
    compiled = ember.compile(softmax_mul_add, target="triton-interpret", cache_dir=str(tmp_path))
    x, y = tiny_inputs()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), softmax_mul_add(x, y), rtol=1e-4, atol=1e-5)
    printed = capsys.readouterr().out
    (graph,) = log_of(compiled).graphs
    assert "# ember: kernel plan of" in printed and "# ember: kernel ember_" in printed
    assert graph.program in printed
    assert "after eliminate_dead_code" not in printed  # graphs after each pass need DEBUG=3


def test_no_debug_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    compiled = ember.compile(softmax_mul_add, target="aten")
    check_against_eager(compiled, softmax_mul_add, tiny_inputs())
    assert "# ember" not in capsys.readouterr().out


def test_the_first_call_waits_for_what_the_program_needs_once() -> None:
    from ember.runtime.program import CompiledGraph

    events: list[str] = []
    graph = CompiledGraph("g", "", lambda args: events.append(f"run {len(args)}") or len(args))
    graph.before_first_call = lambda: events.append("wait")
    assert graph([1, 2]) == 2 and graph([3]) == 1
    assert events == ["wait", "run 2", "run 1"] and graph.first_call_s is not None
