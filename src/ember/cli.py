"""The ``ember`` command line: ``bench``, ``env``, ``explain``, ``cache``, ``tune``.

The compiler core (``ember.compile``, ``ember.explain``, ``ember.runtime.cache``) is
imported only by the subcommands that need it, so ``ember env`` and ``ember bench
--backend eager`` work even when the core is missing or broken.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

GPU_DEFAULT_MODELS = ["resnet50", "bert"]
CPU_DEFAULT_MODELS = ["resnet18", "tiny_transformer"]


def _split(values: Sequence[str] | None) -> list[str]:
    """Flatten repeatable, comma-separated options: ``--mode train --mode infer,train``."""
    out: list[str] = []
    for value in values or []:
        for item in value.split(","):
            item = item.strip()
            if item and item not in out:
                out.append(item)
    return out


def _positive_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; anything else is a one-line usage error."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose auto, cpu, cuda or cuda:N")


def _batch_sizes(text: str) -> str:
    """A batch size or comma list of them, checked here so a bad value names the option."""
    for item in filter(None, (s.strip() for s in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers (e.g. 8 or 8,16), got {text!r}")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ember", description="Ember: compile PyTorch models and see what ran where.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    b = sub.add_parser("bench", help="benchmark eager vs torch.compile vs ember on the model suite",
                       description="Benchmark models in one process: eager, Inductor (default mode, and with "
                       "CUDA graphs on a GPU) and Ember, each step timed with the device synchronised after it. "
                       "Without MODELS: resnet50 and bert on GPU, resnet18 and tiny_transformer on CPU.")
    b.add_argument("models", nargs="*", metavar="MODEL",
                   help="registry models or suite names (seed, zoo, quick; see --list)")
    b.add_argument("--list", action="store_true", help="list the suites, models and backends and exit")
    b.add_argument("--suite", action="append", metavar="NAME", help="add a suite's models (seed|zoo|quick), repeatable")
    b.add_argument("--mode", action="append", metavar="MODE", help="train|infer, repeatable or comma list (default train)")
    b.add_argument("--backend", action="append", metavar="NAME",
                   help="repeatable or comma list (default eager,inductor,ember; on a GPU "
                   "eager,inductor,inductor-cudagraphs,ember); opt-in: inductor-max-autotune, "
                   "inductor-cudagraphs-compiled-optimizer")
    b.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="bf16 autocast or fp32 (auto: bf16 on GPU, fp32 on CPU)")
    b.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],  # bench.harness.OPTIMIZERS
                   help="training rows' optimizer, as a user constructs it (sgd: momentum 0.9, lr 0.01; "
                   "adam: lr 1e-4; adamw: lr 1e-4, weight decay 0.01)")
    b.add_argument("--device", default="auto", type=_device, help="auto|cuda|cpu (auto: cuda if available)")
    b.add_argument("--batch", action="append", metavar="N", type=_batch_sizes,
                   help="batch size(s), repeatable or comma list (default: the model's batch for the mode)")
    b.add_argument("--warmup", type=_nonneg_int, default=None, help="warm-up steps (default 10 on GPU, 3 on CPU)")
    b.add_argument("--iters", type=_positive_int, default=None, help="timed steps (default 30)")
    b.add_argument("--json", metavar="PATH", help="write results (with environment) as JSON")
    b.add_argument("--plot", metavar="PATH",
                   help="write a PNG bar chart of Ember's speedup against every peer (vs eager without Ember)")
    b.add_argument("--small", action="store_true", help="small inputs (64x64 images, seq 32), for quick checks")
    b.add_argument("--no-progress", action="store_true", help="no progress display")
    b.add_argument("--first-call", action="store_true",
                   help="each backend's first call in new processes, cold (empty Ember/Triton/Inductor caches) "
                        "and warm (the caches the cold process left); rows with cache and first_call_s")
    b.add_argument("--data", action="store_true",
                   help="input pipeline bench: JPEG decoding DataLoader feeding training, with and without "
                   "ember.data.prefetch, and the starvation doctor's verdict (ember.data.bench)")
    b.add_argument("--workers", type=_nonneg_int, default=2, help="--data: DataLoader num_workers (default 2)")
    b.add_argument("--depth", type=_positive_int, default=2, help="--data: prefetch depth (default 2)")
    b.add_argument("--jpeg-size", type=_positive_int, default=None,
                   help="--data: pixels a side of the JPEG files, resized to the model's input after decoding")

    e = sub.add_parser("env", help="print the device and versions")
    e.add_argument("--json", action="store_true", help="print as JSON")

    x = sub.add_parser("explain", help="print ember.explain() for a registry model")
    x.add_argument("model", metavar="MODEL")
    x.add_argument("--mode", default="infer", choices=["train", "infer"])
    x.add_argument("--small", action="store_true", help="small inputs (64x64 images, seq 32)")
    x.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's)")
    x.add_argument("--device", default="auto", type=_device, help="auto|cuda|cpu")
    x.add_argument("--html", metavar="PATH", help="also write the report as HTML")

    t = sub.add_parser("tune", help="tune a model's generated kernels and library choices for this machine "
                       "(ember/tune/)",
                       description="Compile MODEL (a registry name or a script defining `model` and "
                       "`example_inputs`), then time the library implementations of its convolutions and linear "
                       "layers (CPU inference) and the best candidate configurations of its generated kernels, "
                       "each checked against a reference, within --budget seconds; results go to the "
                       "tuning database, which later compiles use. What the database or the shared one "
                       "(EMBER_TUNING_SHARED) already answers is not measured again.")
    t.add_argument("model", nargs="?", metavar="MODEL|script.py")
    t.add_argument("--device", default="auto", type=_device, help="auto|cuda|cpu")
    t.add_argument("--budget", type=float, default=300.0, help="seconds of tuning (default 300)")
    t.add_argument("--db", metavar="PATH", help="tuning database (default <cache_dir>/tuning.sqlite)")
    t.add_argument("--mode", default="infer", choices=["train", "infer"])
    t.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    t.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's)")
    t.add_argument("--small", action="store_true", help="small inputs (64x64 images, seq 32)")
    t.add_argument("--target", default="auto", help="Ember target (auto, triton, cpu, triton-interpret)")
    t.add_argument("--top", type=_positive_int, default=4, help="candidates timed per kernel (default 4)")
    t.add_argument("--force", action="store_true", help="measure again kernels the database has")
    t.add_argument("--no-model-check", dest="model_check", action="store_false",
                   help="skip the last step: the whole model timed with and without the tuned choices, "
                   "those that do not pay in the model demoted (tune/model_check.py)")
    t.add_argument("--export", dest="export_path", metavar="PATH", help="write the database to PATH (.json or SQLite)")
    t.add_argument("--import", dest="import_path", metavar="PATH", help="merge the results in PATH")

    c = sub.add_parser("cache", help="show or clear Ember's compile cache")
    c.add_argument("action", choices=["info", "clear"])
    return parser


def _err(msg: str) -> None:
    print(f"ember: {msg}", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.data:
        from ember.data.bench import run_data_bench
        return run_data_bench(args)
    from ember.bench import backends, harness, models, report

    if args.list:
        for suite, members in models.SUITES.items():
            print(f"suite {suite}: {' '.join(members)}")
        for name, case in models.CASES.items():
            print(f"{name:18s} train bs{case.batch_train:<4d} infer bs{case.batch_infer:<4d} {case.description}")
        for name in harness.BACKENDS:
            opt_in = " (opt-in)" if getattr(harness.BACKENDS[name], "opt_in", False) else ""
            print(f"backend {name}: {backends.peer_mode(name)}{opt_in}")
        return 0
    try:
        device = harness.resolve_device(args.device)
        precision = harness.resolve_precision(args.precision, device)
        batches = [int(b) for b in _split(args.batch)] or None
    except ValueError as err:
        _err(str(err))
        return 2
    if batches and min(batches) < 1:
        _err("batch sizes must be positive")
        return 2
    asked = list(args.models) + _split(args.suite)
    names = models.expand_names(asked or (GPU_DEFAULT_MODELS if device.type == "cuda" else CPU_DEFAULT_MODELS))
    modes = _split(args.mode) or ["train"]
    backend_names = _split(args.backend) or backends.default_backends(device)
    problems = [f"unknown suite {s!r}" for s in _split(args.suite) if s not in models.SUITES]
    problems += [f"unknown model {n!r}" for n in names if n not in models.CASES and n not in _split(args.suite)]
    problems += [f"unknown mode {m!r} (train|infer)" for m in modes if m not in harness.MODES]
    problems += [f"unknown backend {b!r}" for b in backend_names if b not in harness.BACKENDS]
    if problems:
        _err("; ".join(problems))
        _err(f"suites: {', '.join(models.SUITES)}; models: {', '.join(models.CASES)}; "
             f"backends: {', '.join(harness.BACKENDS)}")
        return 2

    if args.first_call:
        from ember.bench.first_call import run_first_calls
        from ember.bench.report import write_json
        rows = run_first_calls(names, modes, backend_names, str(device.type), precision, batches, args.small)
        if args.json:
            write_json(args.json, rows, config={"argv": sys.argv[1:] if args.argv is None else list(args.argv),
                                                "first_call": True, "small": args.small})
            print(f"results written to {args.json}")
        return 0 if any(r.get("first_call_s") is not None for r in rows) else 1

    iters = args.iters if args.iters is not None else 30  # >= 30 unless asked otherwise
    config: dict[str, Any] = {
        "argv": sys.argv[1:] if args.argv is None else list(args.argv),
        "models": names, "modes": modes, "backends": backend_names, "precision": precision,
        "device": str(device), "batch": batches, "warmup": args.warmup, "iters": iters, "small": args.small,
        "optimizer": args.optimizer,
    }
    env = report.env_info()
    print(f"ember bench on {env['device']} | torch {env['torch']} | {precision} | "
          f"models {', '.join(names)} | modes {', '.join(modes)} | backends {', '.join(backend_names)} | "
          f"timer sync_each_step",
          flush=True)

    def save(rows: list[dict[str, Any]]) -> None:
        # Rewritten after every row: a run cut short by a time limit keeps what it measured.
        if args.json:
            report.write_json(args.json, rows, env=env, config=config)

    results = harness.run_benchmark(
        names, modes=modes, backends=backend_names, precision=precision, device=device, batch=batches,
        warmup=args.warmup, iters=iters, progress=not args.no_progress, small=args.small, on_result=save,
        optimizer=args.optimizer,
    )
    report.print_table(results)
    if args.json:
        save(results)
        print(f"results written to {args.json}")
    if args.plot:
        report.plot(results, args.plot)
        print(f"plot written to {args.plot}")
    # A failing backend is a result, not a crash; only a run where nothing worked fails.
    return 0 if any(not r.get("error") for r in results) else 1


# ---------------------------------------------------------------------------------------
# env, explain, cache
# ---------------------------------------------------------------------------------------


def _cmd_env(args: argparse.Namespace) -> int:
    from ember.bench import report

    env = report.env_info()
    if args.json:
        print(json.dumps(env, indent=2, default=str))
    else:
        report.print_env(env)
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    import torch

    from ember.bench import harness, models

    try:
        case = models.get_case(args.model)
        device = harness.resolve_device(args.device)
    except ValueError as err:
        _err(str(err))
        return 2
    try:
        from ember import explain
    except ImportError as err:
        _err(f"ember.explain is not available ({err})")
        return 1
    try:
        torch.manual_seed(0)
        model = case.build(args.small).to(device)
    except models.MissingDependencyError as err:
        _err(str(err))
        return 1
    model.train(args.mode == "train")
    batch = args.batch or case.default_batch(args.mode)
    (inputs, _target), *_ = models.make_batches(case, batch, device, small=args.small, count=1)
    grad = torch.enable_grad() if args.mode == "train" else torch.no_grad()
    try:
        with grad:
            result = explain(model, *inputs)
    except ImportError as err:
        # ember.explain exists but a module it needs does not (the core is still growing).
        _err(f"ember.explain is not available ({type(err).__name__}: {err})")
        return 1
    print(result)
    if args.html:
        to_html = getattr(result, "to_html", None)
        if to_html is None:
            _err("this explain report has no to_html()")
            return 1
        to_html(args.html)
        print(f"HTML report written to {args.html}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    try:
        from ember.runtime import cache
    except ImportError as err:
        _err(f"the compile cache is not available: ember.runtime.cache cannot be imported ({err})")
        return 1
    fn_name = "cache_info" if args.action == "info" else "clear_cache"
    fn = getattr(cache, fn_name, None)
    if fn is None:
        _err(f"the compile cache is not available: ember.runtime.cache has no {fn_name}()")
        return 1
    result = fn()
    if args.action == "info":
        if isinstance(result, dict):
            width = max((len(str(k)) for k in result), default=0)
            for key, value in result.items():
                print(f"{str(key):{width}s}  {value}")
        else:
            print(result)
    else:
        print("ember cache cleared" + (f": {result}" if result not in (None, True) else ""))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from ember.tune.session import run_cli
    try:
        return run_cli(args)
    except (ValueError, FileNotFoundError) as err:
        _err(str(err))
        return 2


_COMMANDS = {"bench": _cmd_bench, "env": _cmd_env, "explain": _cmd_explain, "cache": _cmd_cache, "tune": _cmd_tune}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ember`` console script and ``python -m ember``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
