"""Every Ember option and setting, with its environment variable, type, default and doc.

Two kinds, each a dataclass whose fields carry their environment variable and doc:

- ``Options``: one ``ember.compile(..., **options)`` call. Precedence: the argument, then
  ``config.patch``, then the environment variable, then the default below.
- ``Settings``: process-wide (the ``DEBUG`` level, strict mode, compile workers, runtime switches,
  code generation's block sizes). Read them through ``settings()`` (one accessor; a snapshot taken
  when called). Precedence: ``config.patch``, then the environment variable, then the default.

One parser reads every variable (``parse``): booleans take ``1 true yes on`` / ``0 false no off``
(any case); integers and floats are Python literals; an empty variable counts as unset (the
default). Any other value is a ``ConfigError`` naming the variable, raised when Ember reads it
(``ember.compile`` reads them all up front).

``patch(**values)`` (a context manager and a decorator) sets options and settings for the
process while it is active and restores them on exit, also on an exception: the seam for tests
and benchmarks, instead of changing module globals or ``os.environ``. Worker processes do not see
a patch; the few settings a worker uses travel with its jobs (runtime/precompile.py).

Variables Ember reads that are not its own options stay where they are used: ``XDG_CACHE_HOME``
(below), Triton's ``TRITON_CACHE_DIR``/``TRITON_INTERPRET``/``TRITON_PTXAS_PATH``, torch's
logging variables (capture/aot_settings.py), and ``EMBER_COMPILE_WORKER`` and
``EMBER_WORKER_TRITON_TARGET``, which Ember sets for its own compile workers (runtime/precompile.py,
runtime/worker_triton.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

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

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """An environment variable or ``patch`` value Ember cannot use (the message names it)."""


def _item(default: object, doc: str, env: str | None = None, kind: str = "", *, choices: tuple[str, ...] = (),
          false_words: tuple[str, ...] = (), public: bool = True) -> Any:
    """A field of ``Options`` or ``Settings``. ``kind``: bool, int, float, str or path (default:
    the default's type); a ``None`` default means "optional". ``public``: user-facing (in the
    README's tables; needs an ``env``); the others are tuning constants for tests and benchmarks."""
    kind = kind or type(default).__name__
    meta = {"env": env, "doc": doc, "kind": kind, "choices": choices, "false_words": false_words,
            "public": public and env is not None}
    return dataclasses.field(default=default, metadata=meta)


def _cpu_compile(device: str, target: str) -> bool:
    """Whether a compile with these options runs on the CPU whatever the model's tensors are."""
    if device == "cpu" or target == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one option or setting is: the field's name, environment variable, type, default, doc."""

    name: str
    env: str | None
    kind: str
    default: object
    doc: str
    choices: tuple[str, ...]
    false_words: tuple[str, ...]
    public: bool
    scope: str  # "option" (per ember.compile) or "setting" (process-wide)


def parse(spec: Spec, text: str) -> object:
    """The value of ``spec``'s environment variable ``text`` (the one parser)."""
    word = text.strip()
    where = f"environment variable {spec.env}={text!r}"
    if spec.kind == "bool":
        if word.lower() in TRUE_WORDS:
            return True
        if word.lower() in FALSE_WORDS or word.lower() in spec.false_words:
            return False
        false = sorted(FALSE_WORDS | set(spec.false_words))
        raise ConfigError(f"{where} is not a boolean: use one of {', '.join(sorted(TRUE_WORDS))} "
                          f"or {', '.join(false)}")
    if spec.kind in ("int", "float"):
        try:
            return int(word) if spec.kind == "int" else float(word)
        except ValueError:
            raise ConfigError(f"{where} is not {'an integer' if spec.kind == 'int' else 'a number'}") from None
    if spec.choices and word not in spec.choices:
        raise ConfigError(f"{where}: unknown {spec.name} {word!r}; choose one of {', '.join(spec.choices)}")
    return word


def _check(spec: Spec, value: object) -> object:
    """A value given to ``patch``: of the setting's type (ints pass as floats; None where optional)."""
    if value is None and spec.default is None:
        return None
    want = {"bool": bool, "int": int, "float": (int, float), "str": str, "path": (str, os.PathLike)}[spec.kind]
    if not isinstance(value, want) or (spec.kind in ("int", "float") and isinstance(value, bool)):
        raise ConfigError(f"config.patch: {spec.name}={value!r} is not of type {spec.kind}")
    if spec.choices and value not in spec.choices:
        raise ConfigError(f"config.patch: unknown {spec.name} {value!r}; choose one of {', '.join(spec.choices)}")
    return str(value) if spec.kind == "path" else value


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ember"


@dataclasses.dataclass
class Options:
    """Options of one ``ember.compile`` call."""

    target: str = _item("auto", "where Fused kernels run (see TARGETS)", "EMBER_TARGET", choices=TARGETS)
    check: bool = _item(False, "compare each compiled graph with eager on its first call and raise on mismatch",
                        "EMBER_CHECK")
    debug_dir: str | None = _item(None, "folder that receives the graph after each pass, every kernel's source "
                                        "and the program", "EMBER_DEBUG_DIR", "path")
    cache_dir: str | None = _item(None, "folder of generated kernel modules and compiled programs "
                                        "(default ~/.cache/ember)", "EMBER_CACHE_DIR", "path")
    max_recompiles: int = _item(8, "static shape specialisations per compiled frame; then one dynamic-shape "
                                   "graph (capture/backend.py)")
    cudagraphs: bool = _item(True, "replay CUDA programs as CUDA graphs where the capture rule "
                                   "(runtime/cudagraphs/rules.py) allows",
                             "EMBER_CUDAGRAPHS")
    whole_call: bool = _item(False, "CUDA, gradients off: replay the whole module call (Dynamo's frame included) as "
                                    "one CUDA graph behind Dynamo's own guards, parameter addresses and versions "
                                    "(runtime/cudagraphs/whole_call.py); Python side effects inside forward run at "
                                    "capture only", "EMBER_WHOLE_CALL")
    cache: bool = _item(True, "keep compiled programs in <cache_dir>/programs.sqlite for the next process",
                        "EMBER_CACHE")
    device: str = _item("auto", "the device the compiled model runs on: auto follows the tensors; cpu / cuda "
                                "insist on it (inputs elsewhere are an error that says so)", "EMBER_DEVICE",
                        choices=DEVICES)
    freeze: bool = _item(True, "inference: compute parameter-only values (CPU: folded batch norm, packed weights; "
                               "GPU: autocast's weight casts, padded weights) once per parameter version "
                               "(passes/freeze.py)", "EMBER_FREEZE")
    channels_last: bool = _item(True, "GPU targets: convolutional graphs run in channels_last (passes/layout.py; "
                                      "off: eager's NCHW everywhere)", "EMBER_LAYOUT", false_words=("nchw",))
    warm_start: bool | None = _item(None, "an nn.Module or function (compile_step's train_fn) captured as one graph "
                                           "is saved with Dynamo's guards and Ember's programs; a new process loads "
                                           "it instead of tracing again (capture/warm_start.py, warm_function.py; a "
                                           "module in eval mode called with gradients on keeps Dynamo's path); "
                                           "unset: on for CPU compiles (device or target cpu, or no CUDA device) and "
                                           "for whole-step programs replayed as one CUDA graph (a replay checks no "
                                           "saved guard), off for other compiles where a GPU may run the model "
                                           "(torch 2.11 checks the saved guards slower than its own, per call)",
                                    "EMBER_WARM_START", "bool")
    frame_cache: bool = _item(True, "every Dynamo frame Ember compiles is kept (AOTAutograd's forward/backward split "
                                    "with Ember's programs) in <cache_dir>/programs.sqlite, keyed by its Dynamo graph; "
                                    "a new process that traces the same graph skips AOTAutograd and Ember's stages "
                                    "(capture/frame_cache.py)", "EMBER_FRAME_CACHE")
    pad_matmul: str = _item("auto", "GPU targets: pad bf16/fp16 (and TF32) matmul dims that are not a multiple of 16 "
                                    "bytes with zeros where the rule says it pays (passes/matmul_padding_rule.py); "
                                    "always: every such matmul; off: none", "EMBER_PAD_MATMUL",
                            choices=("auto", "always", "off"))
    fuse_cat: bool = _item(True, "Triton targets: cat, stack and slice_scatter become masked, shifted loads inside "
                                 "generated kernels, fused with their producers and consumers "
                                 "(schedule/range_select.py); off: ATen's kernels", "EMBER_FUSE_CAT")
    fuse_reshapes: bool = _item(True, "generated kernels: a reshape that splits or merges dims of a fused value joins "
                                      "its kernel (the kernel's iteration space is refined, schedule/dim_map.py); off: "
                                      "such a reshape ends the kernel and the next one reads the stored value",
                                "EMBER_FUSE_RESHAPES")
    merge_groups: bool = _item(True, "generated kernels: a fused group merges into a later one over the same iteration "
                                     "space that reads it, where the steps between allow and the merged kernels move "
                                     "fewer bytes (schedule/group_merge.py: ResNet's two batch norms of a downsampling "
                                     "block in one kernel); off: each stays a kernel and stores what the other reads",
                               "EMBER_MERGE_GROUPS")
    recompute_values: bool = _item(True, "generated kernels: a pointwise value of a group's inputs that a later group "
                                         "reads over the same iteration space is computed again there when that "
                                         "moves fewer bytes than storing and reading it (schedule/recompute.py: a "
                                         "LayerNorm backward's weight and bias sums from the bf16 inputs); off: "
                                         "stored", "EMBER_RECOMPUTE")
    batch_casts: bool = _item(True, "Triton targets: casts of graph inputs (autocast's weight casts) run as a few "
                                    "multi-tensor copies (torch._foreach_copy_) at the first one's place instead of "
                                    "a kernel each (schedule/batched_casts.py); off: a kernel each",
                              "EMBER_BATCH_CASTS")
    merge_matmuls: bool = _item(True, "GPU inference: matmuls that read one activation with parameter-only "
                                      "weights (attention's query, key and value projections; a gated MLP's gate "
                                      "and up) run as one matmul over the weights side by side, concatenated once "
                                      "per parameter version (passes/sibling_matmuls.py); off: one matmul each",
                                "EMBER_MERGE_MATMULS")
    trace_rnn: bool = _item(True, "inference (gradients off): Dynamo traces nn.LSTM / GRU / RNN (its allow_rnn "
                                  "setting, on during such calls), so the recurrence joins the model's graph as "
                                  "per-step matmuls and fused gate kernels inside its CUDA graph; training keeps "
                                  "Dynamo's graph break and cuDNN's RNN, whose backward is faster than the per-step "
                                  "one (off: the break in inference too)", "EMBER_TRACE_RNN")
    dict_tag_guards: bool | None = _item(None, "Dynamo's recursive dict-tag guards while Ember's calls build a frame's "
                                                "guards (a module whose __dict__ is unchanged since the last call skips "
                                                "its subtree of guards). Unset: torch's own setting (on in torch 2.11, "
                                                "off in later versions after use-after-free segfaults in the fast path, "
                                                "pytorch/pytorch#181873); on: that fast path, at that risk; off: every "
                                                "guard checked", "EMBER_DICT_TAG_GUARDS", "bool")
    progress: bool | None = _item(None, "one updating line on stderr while a compile runs longer than about 2 s "
                                        "(report/progress.py); unset: on when stderr is a terminal",
                                  "EMBER_PROGRESS", "bool")

    def __post_init__(self) -> None:
        if self.warm_start is None:  # frozen: the resolved value replaces "unset" once, here
            object.__setattr__(self, "warm_start", _cpu_compile(self.device, self.target))
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
        """The options of one compile: ``overrides`` (the arguments), then ``config.patch``, then
        ``EMBER_*`` environment variables, then the defaults. Every setting's variable is checked
        here too, so a bad value is an error at ``ember.compile``, not in the middle of a compile."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"ember.compile: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        settings()
        values = {s.name: _value(s) for s in _OPTION_SPECS}
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def cache_root(self) -> Path:
        """Ember's cache folder: kernel modules and the compiled-program database."""
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def kernel_dir(self) -> Path:
        return self.cache_root() / "kernels"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Process-wide settings; read them with ``settings()``."""

    debug: int = _item(0, "1 prints the kernel plan, 2 also every generated kernel and program, 3 also the graph "
                          "after each pass", "DEBUG")
    strict: bool = _item(False, "internal compile errors raise instead of falling back to ATen (tests; bug "
                                "reports)", "EMBER_STRICT")
    compile_workers: int | None = _item(None, "worker processes compiling kernels (default: cores - 1; the CPU "
                                              "target also checks the load; 0: this process only)",
                                        "EMBER_COMPILE_WORKERS", "int")
    cudagraphs_training: bool = _item(True, "capture training graphs (forward, backward) as CUDA graphs; off: "
                                            "only inference graphs", "EMBER_CUDAGRAPHS_TRAINING")
    pooled_inputs: bool = _item(True, "copy buffers of inputs a captured program only reads live in the graph's "
                                      "pool (runtime/cudagraphs/runner.py)", "EMBER_POOLED_INPUTS")
    pool_presize: bool = _item(True, "reserve a CUDA-graph pool as one segment of the size the first calls "
                                     "measured (runtime/cudagraphs/pool.py)", "EMBER_POOL_PRESIZE")
    first_call_pool: bool = _item(True, "a graph's first, uncaptured call allocates from a private pool "
                                        "(runtime/cudagraphs/pool.py)", "EMBER_FIRST_CALL_POOL")
    clear_workspaces: bool = _item(True, "hand back cuBLAS's workspaces around CUDA-graph captures "
                                         "(runtime/cudagraphs/device.py)", "EMBER_CLEAR_WORKSPACES")
    reflection_pad: bool = _item(True, "GPU targets: reflection padding runs as Ember's kernels; off: ATen's "
                                       "(capture/decompositions.py)", "EMBER_REFLECTION_PAD")
    small_bmm: bool = _item(True, "GPU targets: batched bf16/fp16 products of small matrices with a size that is not a "
                                  "multiple of 8 (window attention) run as Ember's Triton kernel; off: cuBLAS's "
                                  "(ops/small_bmm.py)", "EMBER_SMALL_BMM")
    depthwise_kernels: bool = _item(False, "GPU targets: depthwise convolutions in channels_last run as Ember's Triton "
                                           "kernels, no cuDNN kernel build at each shape's first call (off by default: "
                                           "2.5x slower than cuDNN's per step on an H100; ops/depthwise_conv.py)",
                                    "EMBER_DEPTHWISE")
    triton_key_cache: bool = _item(True, "Triton's own cache key (a hash of its sources and libtriton, 0.4-0.8 s per "
                                         "process) is kept in Triton's cache folder and reused while its files are "
                                         "unchanged (runtime/triton_key.py)", "EMBER_TRITON_KEY_CACHE")
    kernel_load_cache: bool = _item(True, "a generated kernel module's code object and Triton's cache key of its "
                                          "kernel are kept beside the file and reused while the text and Triton are "
                                          "unchanged: a process loading saved kernels skips compiling the module and "
                                          "Triton's walk over the kernel (runtime/kernel_module.py); a stored "
                                          "program's code object is kept the same way (pipeline._program_code)",
                                    "EMBER_KERNEL_LOAD_CACHE")
    cubin_launch: bool = _item(True, "a generated Triton kernel launches its recorded binary through torch's "
                                     "static CUDA launcher, without importing its module or Triton's launch "
                                     "path; a launch with no recorded binary goes through Triton and records "
                                     "it (runtime/cubin_launch.py)", "EMBER_CUBIN_LAUNCH")
    input_mutations_in_graph: bool = _item(True, "a graph's writes into its inputs (batch norm's running "
                                                 "statistics, buffer updates) stay in Ember's program as copy_ "
                                                 "into the input; off: AOTAutograd copies them back after each "
                                                 "call (capture/backend.py)", "EMBER_INPUT_MUTATIONS_IN_GRAPH")
    one_pass_var_mean: str = _item("auto", "var_mean (batch norm's statistics) over large rows of a tensor already "
                                           "in memory as two shifted sums in one pass over it. auto: where that "
                                           "tensor is bfloat16/float16 (autocast), whose own rounding is far above "
                                           "the shifted sums' cancellation; always: float32 tensors too (on instance "
                                           "norm, cyclegan's and style_transfer's float32 gradients moved 40-60x "
                                           "further from float64 than eager's); off: mean, then centred squares, one "
                                           "more pass (capture/var_mean.py)", "EMBER_ONE_PASS_VAR_MEAN",
                                    choices=("auto", "always", "off"))
    one_pass_var_mean_min: int = _item(4096, "fewest elements per row for which var_mean takes the one-pass form "
                                             "(capture/var_mean.py)")
    explain_steps: int = _item(3, "steps ember.explain times after the first call and two warm-up steps, for "
                                  "the host time per step (0: none)", "EMBER_EXPLAIN_STEPS")
    fuse_merged_row_sums: bool = _item(False, "a sum over rows that a reshape merged (a Linear's bias gradient over "
                                              "batch x tokens) joins the group computing the summed value even where "
                                              "that group also stores the full-size value (the matmuls read it): one "
                                              "pass instead of the stored value read again (schedule/plan.py). Off: "
                                              "convnext_t's training step was 2% slower with it on an H100",
                                       "EMBER_FUSE_MERGED_ROW_SUMS")
    store_before_reductions: bool = _item(True, "a looped Triton reduction stores its full-size outputs that no "
                                                 "reduction of the group feeds in the first reduction loop (a split "
                                                 "reduction: in its partial-result kernel), instead of computing "
                                                 "them again in a last loop (codegen/triton_reductions.py)",
                                          "EMBER_STORE_BEFORE_REDUCTIONS")
    whole_step_cudagraph: bool = _item(True, "whole-step programs on CUDA replay one CUDA graph per step; off: "
                                             "uncaptured (compiled model, eager optimizer)",
                                       "EMBER_WHOLE_STEP_CUDAGRAPH")
    fused_optimizers: bool = _item(True, "whole-step programs on CUDA: a foreach (or default) SGD, Adam or AdamW "
                                         "runs as torch's fused kernel (fused=True: the update in one pass over "
                                         "parameters, gradients and state instead of several foreach passes; lr a "
                                         "0-d tensor; GradScaler capturable); off: the optimizer as constructed",
                                   "EMBER_FUSED_OPTIMIZERS")
    whole_step_warmup: int = _item(3, "optimizer steps a whole-step program runs uncaptured on CUDA before it "
                                      "captures (PyTorch's whole-network capture recipe warms up)",
                                   "EMBER_WHOLE_STEP_WARMUP")
    compact_optimizer_state: bool = _item(True, "whole-step programs on CUDA: before the first capture, the optimizer "
                                                "state the warm-up made (up to 4 GiB) moves to fresh memory through "
                                                "the host (each tensor kept), so the segments it shared with the "
                                                "warm-up's temporaries are released (train/capture.compact_tensors; "
                                                "cyclegan's peak reserved 378 -> 318 MiB on an H100)",
                                          "EMBER_COMPACT_OPTIMIZER_STATE")
    tuning: bool = _item(True, "compile uses the tuning database's kernel configurations and library choices "
                               "(ember tune); off: the fixed rules only", "EMBER_TUNING")
    tuning_db: str | None = _item(None, "the user's tuning database (default <cache_dir>/tuning.sqlite)",
                                  "EMBER_TUNING_DB", "path")
    tuning_shared: str | None = _item(None, "a read-only tuning database a team or project ships; the user's own "
                                            "entries win over it", "EMBER_TUNING_SHARED", "path")
    cpu_background_load: bool = _item(False, "warm start on the CPU target: numba's import and the cached CPU "
                                             "kernels load on a background thread from ember.compile() (off: no "
                                             "gain measured on a 2-core CPU; runtime/cpu_background.py)",
                                      "EMBER_CPU_BACKGROUND_LOAD")
    cpu_aten_first: bool = _item(True, "CPU target: kernels numba has not cached compile in worker processes while "
                                       "the program's first calls run their fused groups op by op through ATen; "
                                       "the program switches to the kernels at the first call after they are ready "
                                       "(runtime/aten_first.py)",
                                 "EMBER_CPU_ATEN_FIRST")
    library_warmup: bool = _item(True, "CUDA: a program's library calls (cuDNN, cuBLAS, attention) run once on "
                                       "scratch tensors where the process waits anyway: beside a warm start's load, "
                                       "in the first call's wait for kernels (runtime/library_warmup.py)",
                                 "EMBER_LIBRARY_WARMUP")
    git_commit: str | None = _item(None, "the commit `ember bench` records, for runs from a copy of the working "
                                         "tree without its .git", "EMBER_GIT_COMMIT", "str")
    target_compile_python: str | None = _item(None, "the Python that compiles kernels for a GPU that is not here "
                                                    "(runtime/target_compile.py): another environment's, one with "
                                                    "the GPU machine's Triton (torch not needed there)",
                                              "EMBER_TARGET_COMPILE_PYTHON", "path")

    # Tuning constants (no environment variable): tests and benchmarks change them with patch().
    cpu_background_fault: str = _item("", "tests: every background CPU load job raises RuntimeError(this text) "
                                          "(runtime/cpu_background.py)")
    worker_niceness: int = _item(10, "niceness of the Triton compile workers (runtime/precompile.py)")
    cpu_worker_timeout_s: float = _item(300.0, "seconds a CPU compile worker may take for one kernel before this "
                                               "process compiles it (runtime/cpu_compile.py)")
    layout_incremental: bool = _item(True, "the layout pass recomputes metadata only where an input's changed; "
                                           "tests set False to check both give the same program")
    layout_min_activation_to_weight: float = _item(1.0, "channels_last only where activation bytes reach this "
                                                        "multiple of convolution weight bytes; tests set 0")
    pad_matmul_min_flops_per_byte: float = _item(128.0, "matmul padding (auto): FLOPs of the matmul per byte the "
                                                        "padding copies, at least (passes/matmul_padding_rule.py)")
    pad_matmul_min_gflop: float = _item(1.0, "matmul padding (auto): the smallest matmul padded, in GFLOP")
    rnn_unroll_max_steps: int = _item(256, "inference: an RNN traced into the graph (trace_rnn) of more steps x layers "
                                           "x directions runs as one ATen RNN call (ops/rnn.py) instead of unrolled "
                                           "per step: the unrolled capture grows with the sequence")
    merge_matmuls_max_copy_mb: float = _item(256.0, "merged sibling matmuls: at most this many MB of parameters "
                                                    "copied into concatenated weights per graph (weights a frozen "
                                                    "cast already copies, autocast's, cost nothing extra)")
    # Triton block sizes (codegen/triton_kernel.py); part of the compiled-program cache key.
    input_writes_as_stores: bool = _item(True, "a kept write into a graph input whose value a generated kernel "
                                               "computes is that kernel's store into the input, not a copy_ after "
                                               "it (codegen/input_writes.py)")
    persistent_rblock_max: int = _item(2048, "longest reduction done in one block (persistent)")
    loop_rblock: int = _item(16384, "block of a looped reduction; 4.3x faster than 1024 for batch-norm "
                                    "statistics on the H100 (benchmarks/scripts/kernel_bench.py, 2026-11-23)")
    tile_elements: int = _item(2048, "elements per program of a persistent reduction")
    pointwise_xblock: int = _item(1024, "elements per program of a pointwise kernel")
    transpose_tile: int = _item(64, "side of the 2-D tile of a pointwise kernel reading a transposed input "
                                    "(codegen/triton_tiles.transposed_dims; 0: such kernels walk one index, as others)",
                                "EMBER_TRANSPOSE_TILE", public=False)
    transpose_warps: int = _item(0, "warps of a transposed pointwise tile (0: by tile size, as other kernels)")
    interpret_tile_elements: int = _item(1 << 16, "tile size in Triton's interpreter (it pays per program, not "
                                                  "per element)")
    xcontig_xblock: int = _item(64, "consecutive channels per tile of a channel-contiguous reduction")
    xcontig_tile: int = _item(4096, "elements per looped tile of a channel-contiguous reduction")
    xcontig_persistent_rmax: int = _item(256, "longest channel-contiguous reduction done persistent")
    split_target_programs: int = _item(528, "looped reductions with fewer programs are split along the reduced "
                                            "dims (0: never); 4 per SM of a 132-SM H100")
    interpret_split_target_programs: int = _item(0, "the same in the interpreter; tests raise it to run the "
                                                    "split path")
    split_store_tiles: int = _item(4, "tiles per program of the kernel that stores a split reduction's full-size "
                                      "outputs (its results are combined already, so it runs as a tiled pointwise "
                                      "kernel; 0: one program per chunk of the reduction, looping over the chunk). resnet50 "
                                      "training on one H100, Ember alone: 4 tiles 23.68 / 23.76 ms a step, 1 tile 24.14 / 24.27, "
                                      "0 24.30 / 24.17 (benchmarks/results/h100/2026-11-27_group_merge_bn_kernels)",
                                   "EMBER_SPLIT_STORE_TILES", public=False)


def specs(scope: str | None = None) -> list[Spec]:
    """Every option (``scope="option"``) and setting (``"setting"``), or both, in definition order."""
    out = []
    for cls, kind in ((Options, "option"), (Settings, "setting")):
        if scope in (None, kind):
            for f in dataclasses.fields(cls):
                m = f.metadata
                out.append(Spec(f.name, m["env"], m["kind"], f.default, m["doc"], m["choices"], m["false_words"],
                                m["public"], kind))
    return out


_SPECS = {s.name: s for s in specs()}
_OPTION_SPECS = tuple(specs("option"))
_SETTING_SPECS = tuple(specs("setting"))
assert len(_SPECS) == len(dataclasses.fields(Options)) + len(dataclasses.fields(Settings)), "a name is used twice"
_PATCHED: dict[str, object] = {}


def _value(spec: Spec) -> object:
    if spec.name in _PATCHED:
        return _PATCHED[spec.name]
    text = os.environ.get(spec.env, "") if spec.env else ""
    return parse(spec, text) if text.strip() else spec.default


def settings() -> Settings:
    """The process-wide settings now: ``config.patch``, then the environment, then the defaults."""
    return Settings(**{s.name: _value(s) for s in _SETTING_SPECS})


class patch(contextlib.ContextDecorator):
    """Set options and settings while active (``with config.patch(strict=True): ...`` or as a
    decorator); the previous values come back on exit, also on an exception. Values are checked
    against each one's type; ``None`` restores an optional one's default behaviour."""

    def __init__(self, **values: object) -> None:
        unknown = sorted(set(values) - set(_SPECS))
        if unknown:
            raise TypeError(f"config.patch: unknown option(s)/setting(s) {unknown}; known: {sorted(_SPECS)}")
        self.values = {k: _check(_SPECS[k], v) for k, v in values.items()}
        self._saved: list[dict[str, object]] = []

    def _recreate_cm(self) -> patch:  # a decorated function may run re-entrantly: one state per call
        return patch(**self.values)

    def __enter__(self) -> patch:
        self._saved.append({k: _PATCHED.get(k, _UNSET) for k in self.values})
        _PATCHED.update(self.values)
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self._saved.pop().items():
            if v is _UNSET:
                _PATCHED.pop(k, None)
            else:
                _PATCHED[k] = v


_UNSET = object()


def left_unset(name: str) -> bool:
    """Whether the user left the option ``name`` unset (no argument aside: neither ``patch`` nor its
    environment variable gives it a value), so a caller may choose its own default."""
    return _value(_SPECS[name]) is None


def patched() -> dict[str, object]:
    """The values ``patch`` sets now (empty outside any patch)."""
    return dict(_PATCHED)


def env_names() -> list[str]:
    """Every environment variable Ember reads as an option or setting."""
    return [s.env for s in specs() if s.env]


__all__ = ["ConfigError", "DEVICES", "Options", "Settings", "Spec", "TARGETS", "default_cache_dir", "env_names",
           "parse", "patch", "patched", "settings", "specs"]


# Shorthands for the settings read most often.

def debug_level() -> int:
    """``DEBUG=1`` prints the kernel plan, ``DEBUG=2`` also every generated kernel and program,
    ``DEBUG=3`` also the graph after each pass."""
    return settings().debug


def strict() -> bool:
    """``EMBER_STRICT=1``: internal compile errors raise instead of falling back to ATen (tests)."""
    return settings().strict


def explain_steps() -> int:
    return max(0, settings().explain_steps)


def whole_step_cudagraph_enabled() -> bool:
    return settings().whole_step_cudagraph


def fused_optimizers_enabled() -> bool:
    """``EMBER_FUSED_OPTIMIZERS=0``: a whole-step program keeps a foreach SGD/Adam/AdamW as constructed."""
    return settings().fused_optimizers


def whole_step_warmup() -> int:
    return max(1, settings().whole_step_warmup)


def compact_optimizer_state_enabled() -> bool:
    return settings().compact_optimizer_state


def quiet_profiler_logs() -> None:
    """The torch profiler's tracing library (Kineto) prints ``USDT: ... profiler_start/stop`` at
    every start and stop and, on a CUDA build without a GPU, ``ERROR: ... gpuGetDeviceCount
    failed``, straight to stderr. Ember's CPU memory measurement (bench/memory.py) uses the
    profiler; its level 6 (above Kineto's highest) silences it. Kineto reads the variable once,
    when the process first starts the profiler; a value the user set (``KINETO_LOG_LEVEL=0``
    to see everything) is kept. (``KINETO_LOG_LEVEL`` is the profiler's variable, not Ember's.)"""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# Block-size rules of the Triton kernels (codegen/triton_kernel.py); tests lower them with config.patch
# to exercise the looped path on small shapes.
BLOCK_SETTINGS = ("persistent_rblock_max", "loop_rblock", "tile_elements", "pointwise_xblock", "transpose_tile", "transpose_warps",
                  "interpret_tile_elements", "xcontig_xblock", "xcontig_tile", "xcontig_persistent_rmax",
                  "split_target_programs", "interpret_split_target_programs", "split_store_tiles",
                  "store_before_reductions", "fuse_merged_row_sums")


def block_settings() -> tuple:
    """Every block-size and code-shape setting (part of the compiled-program cache key: tests and
    A/B runs change them, and a program compiled under other values must not load). Here
    rather than in codegen/triton_kernel.py so a warm start's key does not import Triton's codegen."""
    now = settings()
    return tuple(getattr(now, name) for name in BLOCK_SETTINGS)


# Tuning (src/ember/tune/): results of ``ember tune`` kept per kernel and device.
def tuning_enabled() -> bool:
    """``EMBER_TUNING=0``: compile ignores the tuning database (the fixed block-size rules only)."""
    return settings().tuning


def tuning_db_path(cache_root: Path) -> Path:
    """The user's tuning database: ``EMBER_TUNING_DB`` or ``<cache_dir>/tuning.sqlite``."""
    value = settings().tuning_db
    return Path(value) if value else cache_root / "tuning.sqlite"


def tuning_shared_path() -> Path | None:
    """``EMBER_TUNING_SHARED``: a read-only tuning database a team or project ships; the user's
    own entries win over it."""
    value = settings().tuning_shared
    return Path(value) if value else None
