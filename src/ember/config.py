"""Every Ember option and environment variable, in one place.

Options passed to ``ember.compile(..., **options)`` override the environment; the
environment overrides the defaults below.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

# Where Fused kernels run.
#   "auto"             Triton on CUDA tensors; on CPU tensors "cpu" when numba can be imported,
#                      else "aten" (explain reports why)
#   "triton"           generated Triton kernels (CUDA)
#   "triton-interpret" the same Triton kernels through Triton's CPU interpreter (tests, CI)
#   "cpu"              generated numba kernels on CPU tensors (codegen/cpu_kernel.py); a group the
#                      generator does not cover (float16 ...) runs through ATen, with the reason
#   "aten"             the ops of each Fused group run one by one through ATen
TARGETS = ("auto", "triton", "triton-interpret", "cpu", "aten")


DEVICES = ("auto", "cpu", "cuda")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


def debug_level() -> int:
    """``DEBUG=1`` prints the kernel plan, ``DEBUG=2`` also every generated kernel and program,
    ``DEBUG=3`` also the graph after each pass."""
    return _env_int("DEBUG", 0)


def strict() -> bool:
    """``EMBER_STRICT=1``: internal compile errors raise instead of falling back to ATen (tests)."""
    return os.environ.get("EMBER_STRICT", "0") not in ("0", "")


def explain_steps() -> int:
    """``EMBER_EXPLAIN_STEPS``: steps ``ember.explain`` times after the first call and two warm-up
    steps, for the host time per step (default 3; 0: none)."""
    return max(0, _env_int("EMBER_EXPLAIN_STEPS", 3))


def quiet_profiler_logs() -> None:
    """The torch profiler's tracing library (Kineto) prints ``USDT: ... profiler_start/stop`` at
    every start and stop and, on a CUDA build without a GPU, ``ERROR: ... gpuGetDeviceCount
    failed``, straight to stderr. Ember's CPU memory measurement (bench/memory.py) uses the
    profiler; its level 6 (above Kineto's highest) silences it. Kineto reads the variable once,
    when the process first starts the profiler; a value the user set (``KINETO_LOG_LEVEL=0``
    to see everything) is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ember"


@dataclasses.dataclass
class Options:
    """Options of one ``ember.compile`` call."""

    target: str = "auto"
    # Compare against eager on the first call of each compiled graph and raise on mismatch.
    check: bool = False
    # Folder that receives the graph after each pass, every kernel's source and the program.
    debug_dir: str | None = None
    # Folder for generated kernel modules (content-addressed).
    cache_dir: str | None = None
    # Static shape specialisations per compiled frame; then one dynamic-shape graph (capture/backend.py).
    max_recompiles: int = 8
    # Replay CUDA programs as CUDA graphs where runtime.cudagraphs allows (EMBER_CUDAGRAPHS=0: off).
    cudagraphs: bool = True
    # Keep compiled programs in <cache_dir>/programs.sqlite for the next process (EMBER_CACHE=0: off).
    cache: bool = True
    # Which device the compiled model runs on: "auto" follows the tensors (CUDA -> Triton kernels,
    # CPU -> CPU code); "cpu" / "cuda" insist on it, and inputs elsewhere are an error that says so.
    device: str = "auto"
    # CPU inference: compute parameter-only values (folded batch norm, packed weights) once per
    # parameter version (passes/freeze.py; EMBER_FREEZE=0: off).
    freeze: bool = True
    # GPU targets: convolutional graphs run in channels_last (passes/layout.py; EMBER_LAYOUT=0: off,
    # eager's NCHW everywhere).
    channels_last: bool = True

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"ember: unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.target not in TARGETS:
            raise ValueError(f"ember: unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if isinstance(self.max_recompiles, bool) or not isinstance(self.max_recompiles, int) \
                or self.max_recompiles < 0:
            raise ValueError(f"ember: max_recompiles must be an integer >= 0 (static shape specialisations per "
                             f"frame), got {self.max_recompiles!r}")

    @classmethod
    def from_env(cls, **overrides: object) -> Options:
        """Options from ``EMBER_*`` environment variables, then ``overrides``."""
        env: dict[str, object] = {}
        if os.environ.get("EMBER_TARGET"):
            env["target"] = os.environ["EMBER_TARGET"]
        if os.environ.get("EMBER_DEBUG_DIR"):
            env["debug_dir"] = os.environ["EMBER_DEBUG_DIR"]
        if os.environ.get("EMBER_CACHE_DIR"):
            env["cache_dir"] = os.environ["EMBER_CACHE_DIR"]
        if os.environ.get("EMBER_DEVICE"):
            env["device"] = os.environ["EMBER_DEVICE"]
        if os.environ.get("EMBER_FREEZE"):
            env["freeze"] = os.environ["EMBER_FREEZE"] not in ("0", "false")
        if os.environ.get("EMBER_LAYOUT"):
            env["channels_last"] = os.environ["EMBER_LAYOUT"] not in ("0", "false", "nchw")
        if os.environ.get("EMBER_CHECK"):
            env["check"] = os.environ["EMBER_CHECK"] not in ("0", "", "false")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"ember.compile: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        env.update(overrides)
        return cls(**env)  # type: ignore[arg-type]

    def cache_root(self) -> Path:
        """Ember's cache folder: kernel modules and the compiled-program database."""
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def kernel_dir(self) -> Path:
        return self.cache_root() / "kernels"


# Whole-step training programs (ember.compile_step, src/ember/train/).
def whole_step_cudagraph_enabled() -> bool:
    """``EMBER_WHOLE_STEP_CUDAGRAPH=0``: whole-step programs on CUDA run uncaptured (compiled model,
    eager optimizer) instead of replaying one CUDA graph per step."""
    return os.environ.get("EMBER_WHOLE_STEP_CUDAGRAPH", "1") not in ("0", "false", "")


def whole_step_warmup() -> int:
    """Optimizer steps a whole-step program runs uncaptured on CUDA before it captures
    (``EMBER_WHOLE_STEP_WARMUP``, default 3, as PyTorch's whole-network capture recipe warms up)."""
    return max(1, _env_int("EMBER_WHOLE_STEP_WARMUP", 3))


# Tuning (src/ember/tune/): results of ``ember tune`` kept per kernel and device.
def tuning_enabled() -> bool:
    """``EMBER_TUNING=0``: compile ignores the tuning database (the fixed block-size rules only)."""
    return os.environ.get("EMBER_TUNING", "1") not in ("0", "false", "")


def tuning_db_path(cache_root: Path) -> Path:
    """The user's tuning database: ``EMBER_TUNING_DB`` or ``<cache_dir>/tuning.sqlite``."""
    value = os.environ.get("EMBER_TUNING_DB", "")
    return Path(value) if value else cache_root / "tuning.sqlite"


def tuning_shared_path() -> Path | None:
    """``EMBER_TUNING_SHARED``: a read-only tuning database a team or project ships; the user's
    own entries win over it."""
    value = os.environ.get("EMBER_TUNING_SHARED", "")
    return Path(value) if value else None
