"""ember/config.py: one definition of every option and setting, one parser, one precedence
(argument > config.patch > environment > default), and the README's tables kept true to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember import config
from ember.config import ConfigError, Options, settings

ROOT = Path(__file__).resolve().parents[1]
BOOL_OPTIONS = [s for s in config.specs("option") if s.kind == "bool"]


@pytest.fixture(autouse=True)
def no_ember_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in config.env_names():
        monkeypatch.delenv(name, raising=False)
    assert config.patched() == {}, "a config.patch leaked out of an earlier test"


# -- the README's tables ---------------------------------------------------------------------------

def _readme_table(header: str) -> dict[str, str | None]:
    """{name: env or None} of the README table whose first column is ``header``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\|\s*{header}\s*\|\s*env\s*\|", line))
    rows: dict[str, str | None] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, env = cells[0].strip("`"), cells[1].strip("`") or None
        assert name not in rows, f"README lists {name} twice"
        rows[name] = env
    return rows


def test_readme_option_table_matches_config() -> None:
    want = {s.name: s.env for s in config.specs("option")}  # every option is user-facing
    assert _readme_table("option") == want


def test_readme_settings_table_matches_config() -> None:
    want = {s.name: s.env for s in config.specs("setting") if s.public}
    assert _readme_table("setting") == want
    # Tuning constants have no variable and stay out of the README; user-facing ones have one.
    assert all(s.env for s in config.specs() if s.public)


def test_every_ember_variable_read_under_src_is_defined_in_config() -> None:
    # EMBER_COMPILE_WORKER and EMBER_WORKER_TRITON_TARGET are not options: Ember sets them for its
    # own compile workers.
    defined = set(config.env_names()) | {"EMBER_COMPILE_WORKER", "EMBER_WORKER_TRITON_TARGET"}
    used = set()
    for path in (ROOT / "src" / "ember").rglob("*.py"):
        used |= set(re.findall(r"[\"'](EMBER_[A-Z_]+)[\"']", path.read_text()))  # in string literals
    assert used - defined == set()
    # ... and read through config alone (the worker marker aside)
    direct = {f"{p.name}: {name}" for p in (ROOT / "src" / "ember").rglob("*.py") if p.name != "config.py"
              for name in re.findall(r"environ[^\n]*?\"(EMBER_\w+|DEBUG)\"", p.read_text())
              if name != "EMBER_COMPILE_WORKER"}
    assert direct == set()


# -- precedence ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", BOOL_OPTIONS, ids=[s.name for s in BOOL_OPTIONS])
def test_boolean_option_precedence(spec: config.Spec, monkeypatch: pytest.MonkeyPatch) -> None:
    default = getattr(Options.from_env(), spec.name)  # an unset default resolves when the options are made
    assert default is spec.default or spec.default is None
    monkeypatch.setenv(spec.env, "0" if default else "1")  # the environment beats the default
    assert getattr(Options.from_env(), spec.name) is (not default)
    # An explicit argument beats the environment, also when it repeats the default (it used to be
    # AND-ed with EMBER_CUDAGRAPHS / EMBER_CACHE, so cudagraphs=True lost to EMBER_CUDAGRAPHS=0).
    assert getattr(Options.from_env(**{spec.name: default}), spec.name) is default
    with config.patch(**{spec.name: default}):  # patch beats the environment, the argument beats patch
        assert getattr(Options.from_env(), spec.name) is default
        assert getattr(Options.from_env(**{spec.name: not default}), spec.name) is (not default)


def test_cudagraphs_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.runtime.cudagraphs.rules import cudagraphs_enabled

    monkeypatch.setenv("EMBER_CUDAGRAPHS", "0")
    assert cudagraphs_enabled(True) and not cudagraphs_enabled(False)
    assert not cudagraphs_enabled()  # no argument: the environment decides
    with config.patch(cudagraphs=True):
        assert cudagraphs_enabled()


def test_settings_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings().strict is False and settings().compile_workers is None and settings().debug == 0
    monkeypatch.setenv("EMBER_STRICT", "yes")
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", " 3 ")
    monkeypatch.setenv("DEBUG", "2")
    assert settings().strict is True and settings().compile_workers == 3 and settings().debug == 2
    with config.patch(strict=False, compile_workers=None, debug=0):
        assert settings().strict is False and settings().compile_workers is None and settings().debug == 0
    assert settings().compile_workers == 3


# -- the parser ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [("1", True), ("true", True), ("Yes", True), ("ON", True),
                                             ("0", False), ("false", False), ("No", False), ("off", False)])
def test_boolean_words(text: str, value: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CHECK", text)
    monkeypatch.setenv("EMBER_POOL_PRESIZE", text)
    assert Options.from_env().check is value and settings().pool_presize is value


def test_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EMBER_CUDAGRAPHS", "EMBER_CHECK", "EMBER_TARGET", "DEBUG", "EMBER_COMPILE_WORKERS"):
        monkeypatch.setenv(name, "")
    assert Options.from_env() == Options()
    assert settings() == config.Settings()


def test_layout_takes_nchw_as_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_LAYOUT", "nchw")
    assert Options.from_env().channels_last is False


@pytest.mark.parametrize(("name", "text", "says"), [
    ("EMBER_CUDAGRAPHS", "maybe", "is not a boolean"),
    ("EMBER_STRICT", "2", "is not a boolean"),
    ("EMBER_LAYOUT", "nhwc", "is not a boolean"),
    ("DEBUG", "verbose", "is not an integer"),
    ("EMBER_COMPILE_WORKERS", "many", "is not an integer"),
    ("EMBER_DEVICE", "gpu", "unknown device 'gpu'"),
])
def test_bad_values_name_the_variable(name: str, text: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=rf"{name}='{text}'.*{says}"):
        Options.from_env()  # checks every variable, settings included: the error comes at ember.compile


def test_bad_value_fails_ember_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import ember

    monkeypatch.setenv("EMBER_POOLED_INPUTS", "sometimes")
    with pytest.raises(ConfigError, match="EMBER_POOLED_INPUTS"):
        ember.compile(lambda x: x + 1)


# -- config.patch ----------------------------------------------------------------------------------

def test_patch_restores_on_exit_and_on_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_TARGET", "aten")
    with config.patch(target="cpu", loop_rblock=8):
        assert Options.from_env().target == "cpu" and settings().loop_rblock == 8
        with config.patch(loop_rblock=16):  # nested: the inner value, then the outer one again
            assert settings().loop_rblock == 16
        assert settings().loop_rblock == 8
    assert Options.from_env().target == "aten" and settings().loop_rblock == 16384
    with pytest.raises(RuntimeError, match="boom"), config.patch(strict=True):
        assert settings().strict
        raise RuntimeError("boom")
    assert settings().strict is False and config.patched() == {}


def test_patch_as_a_decorator() -> None:
    @config.patch(debug=3)
    def level(depth: int) -> list[int]:
        inner = level(depth - 1) if depth else []  # re-entrant: each call has its own saved state
        return [settings().debug, *inner]

    assert level(2) == [3, 3, 3]
    assert settings().debug == 0 and config.patched() == {}


def test_patch_checks_names_and_types() -> None:
    with pytest.raises(TypeError, match="unknown option"):
        config.patch(cuda_graphs=False)
    with pytest.raises(ConfigError, match="strict='1' is not of type bool"):
        config.patch(strict="1")
    with pytest.raises(ConfigError, match="is not of type int"):
        config.patch(loop_rblock=True)
    with pytest.raises(ConfigError, match="unknown target 'tpu'"):
        config.patch(target="tpu")
    with config.patch(cache_dir=ROOT, layout_min_activation_to_weight=0):  # a path; an int for a float
        assert Options.from_env().cache_dir == str(ROOT) and settings().layout_min_activation_to_weight == 0


@pytest.mark.parametrize("change", [{"loop_rblock": 8}, {"store_before_reductions": False},
                                    {"fuse_merged_row_sums": True}])
def test_code_shape_settings_are_part_of_the_program_cache_key(change: dict) -> None:
    before = config.block_settings()
    with config.patch(**change):
        assert config.block_settings() != before
    assert config.block_settings() == before


def test_compile_jobs_carry_the_worker_niceness_a_patch_sets(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers are separate processes: a patch reaches them only through their jobs.
    from ember.runtime import precompile as pc

    monkeypatch.setattr(pc, "_DONE", set())
    seen = []
    monkeypatch.setattr(pc, "compile_job", lambda j: seen.append(j) or (None, 0.0, 0.0))
    job = pc.job_for(tmp_path / "k.py", "ember_config_probe", ["torch.float32"], {"N": 8})
    with config.patch(worker_niceness=3, compile_workers=0):
        pc.precompile([job])
    assert [j.niceness for j in seen] == [3]


def test_warm_start_unset_is_on_for_cpu_compiles_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Options.from_env().warm_start is True  # a machine without a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Options.from_env().warm_start is False  # a GPU may run the model
    assert Options.from_env(device="cpu").warm_start is True
    assert Options.from_env(target="cpu").warm_start is True
    assert Options.from_env(device="cpu", warm_start=False).warm_start is False
    monkeypatch.setenv("EMBER_WARM_START", "1")
    assert Options.from_env().warm_start is True


def test_a_captured_whole_step_warm_starts_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ember.train.step import whole_step_options

    monkeypatch.delenv("EMBER_WARM_START", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where a GPU may run the model
    params = [torch.nn.Parameter(torch.randn(3))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert Options.from_env(**whole_step_options({}, sgd, cudagraph=True)).warm_start is True
    assert Options.from_env(**whole_step_options({"target": "triton"}, sgd, cudagraph=True)).warm_start is True
    # A step that will not replay as one graph keeps the usual default (off where a GPU may run it).
    assert Options.from_env(**whole_step_options({}, sgd, cudagraph=False)).warm_start is False
    lbfgs = torch.optim.LBFGS(params)
    assert Options.from_env(**whole_step_options({}, lbfgs, cudagraph=True)).warm_start is False
    # The user's word wins: an argument, config.patch, the environment.
    assert Options.from_env(**whole_step_options({"warm_start": False}, sgd, cudagraph=True)).warm_start is False
    with config.patch(warm_start=False):
        assert Options.from_env(**whole_step_options({}, sgd, cudagraph=True)).warm_start is False
    monkeypatch.setenv("EMBER_WARM_START", "0")
    assert Options.from_env(**whole_step_options({}, sgd, cudagraph=True)).warm_start is False
