"""numba's set-up without scipy.linalg (runtime/numba_import.py), each case in a fresh interpreter:
Ember's CPU kernels, cold and warm-started, still match eager, and numba's np.dot still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parents[2]

# Compiles (or, with a warm-start file from an earlier process, loads) a small model on Ember's
# CPU target, compares forward and gradients with eager, then checks numba's np.dot.
_MODEL_SCRIPT = r"""
import json, sys
import numpy as np
import torch
import ember

torch.set_num_threads(1)  # the user's setting: Ember's kernels (numba's thread pool) must keep it
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
x = torch.randn(5, 8)
cot = torch.randn(5, 4)
xe = x.clone().requires_grad_(True)
(model(xe) * cot).sum().backward()
eager = [xe.grad] + [p.grad.clone() for p in model.parameters()]
out_eager = model(x).detach()
model.zero_grad()

compiled = ember.compile(model, target="cpu")
xc = x.clone().requires_grad_(True)
out = compiled(xc)
(out * cot).sum().backward()
got = [xc.grad] + [p.grad for p in model.parameters()]
result = {
    "forward_err": (out.detach() - out_eager).abs().max().item(),
    "grad_err": max((a - b).abs().max().item() for a, b in zip(got, eager)),
    "scipy_linalg_after_kernels": "scipy.linalg" in sys.modules,
    "threads_after_kernels": torch.get_num_threads(),
    "set_up": "numba.np.arraymath" in sys.modules,
    "have_blas": getattr(sys.modules.get("numba.np.arraymath"), "_HAVE_BLAS", None),
    "graphs": [(g.title, g.target, g.kernels, g.error) for g in compiled._ember_backend.log.graphs],
    "warm_start": list(compiled._ember_backend.log.warm_start),
}

import numba

@numba.njit
def dot(a, b):
    return np.dot(a, b)

a, b = np.random.rand(3, 4), np.random.rand(4, 2)
result["dot_err"] = float(np.abs(dot(a, b) - a @ b).max())
result["scipy_linalg_after_dot"] = "scipy.linalg" in sys.modules
print(json.dumps(result))
"""


def _run(script: str, env: dict[str, str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}
    env.pop("EMBER_STRICT", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_model_run(result: dict, compiled_here: bool) -> None:
    assert result["forward_err"] < 1e-5 and result["grad_err"] < 1e-5, result
    assert any(target == "cpu" and kernels >= 1 and error is None for _, target, kernels, error in result["graphs"]), \
        result["graphs"]
    assert not result["scipy_linalg_after_kernels"], "numba's set-up imported scipy.linalg"
    assert result["threads_after_kernels"] == 1, "numba's thread pool changed torch's thread count"
    # A process that compiled kernels ran numba's set-up (without the BLAS check's scipy.linalg);
    # one that only loaded cached kernels skipped the set-up altogether.
    assert result["set_up"] is compiled_here, result
    assert result["have_blas"] is (False if compiled_here else None), result
    # np.dot's codegen imports scipy's BLAS itself (numba/np/linalg.py ensure_blas).
    assert result["dot_err"] < 1e-12 and result["scipy_linalg_after_dot"], result


def test_cpu_kernels_cold_and_warm_without_scipy_linalg(tmp_path: Path) -> None:
    env = {"EMBER_CACHE_DIR": str(tmp_path / "cache"), "EMBER_WARM_START": "1", "XDG_CACHE_HOME": str(tmp_path),
           "EMBER_COMPILE_WORKERS": "0"}
    cold = _run(_MODEL_SCRIPT, env)
    _check_model_run(cold, compiled_here=True)
    warm = _run(_MODEL_SCRIPT, env)
    _check_model_run(warm, compiled_here=False)
    assert any("loaded" in line for line in warm["warm_start"]), warm["warm_start"]


# Without ember/__init__ (no torch), as the compile workers import it (runtime/cpu_compile.py).
_NO_OP_SCRIPT = r"""
import json, sys, types
for name, path in (("ember", sys.argv[2]), ("ember.runtime", sys.argv[2] + "/runtime")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
first = sys.argv[1]
if first == "scipy":
    import scipy.linalg
elif first == "numba":
    import numba
    from numba.core.registry import cpu_target
    cpu_target.target_context.refresh()
finders = list(sys.meta_path)
from ember.runtime.numba_import import import_numba_without_scipy_blas
import_numba_without_scipy_blas()
import_numba_without_scipy_blas()
from numba.core.registry import cpu_target
cpu_target.target_context.refresh()  # after scipy.linalg the helper only imports numba
print(json.dumps({"have_blas": sys.modules["numba.np.arraymath"]._HAVE_BLAS,
                  "scipy_linalg": "scipy.linalg" in sys.modules,
                  "finders_restored": [type(f).__name__ for f in sys.meta_path] == [type(f).__name__ for f in finders]}))
"""


@pytest.mark.parametrize("first", ["nothing", "scipy", "numba"])
def test_no_op_when_scipy_linalg_or_numba_set_up_already(first: str) -> None:
    # The helper alone in a fresh interpreter, after scipy.linalg, numba's own set-up, or nothing.
    proc = subprocess.run([sys.executable, "-c", _NO_OP_SCRIPT, first, str(ROOT / "src" / "ember")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finders_restored"], result
    # Only a fresh interpreter skips the BLAS check; after scipy.linalg or numba's set-up it ran as usual.
    assert result["have_blas"] is (first != "nothing"), result
    assert result["scipy_linalg"] is (first != "nothing"), result


# numba's cached loads inside and outside `numba_for_cached_code`, without torch: a cached
# parallel function (numba's runtime needed) and a plain one, loaded in a second interpreter.
_CACHED_LOAD_SCRIPT = r"""
import json, sys, types
for name, path in (("ember", sys.argv[2]), ("ember.runtime", sys.argv[2] + "/runtime")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
sys.path.insert(0, sys.argv[1])
import numpy as np
from ember.runtime.numba_import import numba_for_cached_code
with numba_for_cached_code():
    import cached_fns
    x = np.random.rand(1000)
    total = float(cached_fns.parallel_sum(x))
    inside = "numba.np.arraymath" in sys.modules
    if sys.argv[3] == "compile-inside":
        plus = float(cached_fns.fresh(2.0))  # not in the cache yet: compiled here, after numba's set-up
if sys.argv[3] != "compile-inside":
    plus = float(cached_fns.plain(2.0))  # cached, loaded outside the block: numba's own load
print(json.dumps({"sum_err": abs(total - float(x.sum())), "set_up_inside": inside, "plus": plus,
                  "set_up_after": "numba.np.arraymath" in sys.modules,
                  "scipy_linalg": "scipy.linalg" in sys.modules}))
"""

_CACHED_FNS = """
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def parallel_sum(x):
    s = 0.0
    for i in prange(x.shape[0]):
        s += x[i]
    return s


@njit(cache=True)
def plain(a):
    return a + 1.5


@njit(cache=True)
def fresh(a):
    return a + 1.5
"""


def test_cached_code_loads_without_numbas_set_up_and_compiles_with_it(tmp_path: Path) -> None:
    (tmp_path / "cached_fns.py").write_text(_CACHED_FNS)
    warm_up = ("import sys; sys.path.insert(0, sys.argv[1]); import numpy as np, cached_fns; "
               "cached_fns.parallel_sum(np.ones(4)); cached_fns.plain(1.0)")
    subprocess.run([sys.executable, "-c", warm_up, str(tmp_path)], check=True, timeout=300)

    def run(mode: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _CACHED_LOAD_SCRIPT, str(tmp_path), str(ROOT / "src" / "ember"), mode],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    outside = run("load-outside")
    assert outside["sum_err"] < 1e-9 and outside["plus"] == 3.5, outside
    assert not outside["set_up_inside"], "a cached load inside the block ran numba's set-up"
    assert outside["set_up_after"], "a load outside the block skipped numba's set-up"
    inside = run("compile-inside")
    assert inside["sum_err"] < 1e-9 and inside["plus"] == 3.5, inside
    assert not inside["set_up_inside"] and inside["set_up_after"], inside
    assert not inside["scipy_linalg"], "the set-up before a compile inside the block imported scipy.linalg"
