"""One updating line on stderr while a compile takes long: the stage, graphs and kernels.

A scope is one call of a compiled model (``EmberBackend.shape_policy`` enters it around every
call) or, outside such a call, one backend compile (``torch.compile(backend="ember")``, a backward
compiled when autograd first reaches it). Entering a scope costs a clock read; nothing is drawn
unless a compile happens in it and is still running ``SHOW_AFTER_S`` seconds after the scope began.
The line then shows, updated a few times a second and on every stage change:

    ember compiling: kernel compile | graphs 1/2 | kernels 37/52 | 4.1 s

Stages: capture (Dynamo and AOTAutograd), passes, schedule, codegen, kernel compile, program
(the pipeline's stages, seen through ``ember.instruments`` hooks), then first run (the program's
first call, or capture going on with the next graph). Graphs: compiled / begun;
kernels: compiled / written. The line is erased when the call returns, and one summary line is
left. On by default when stderr is a terminal; ``progress=False`` / ``EMBER_PROGRESS=0`` turns it
off, ``progress=True`` / ``EMBER_PROGRESS=1`` forces it on (a log file then receives the line).
Display only: it never changes what is compiled or run.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ember.instruments import instrument

SHOW_AFTER_S = 2.0  # a compile shorter than this draws nothing
STAGE_NAMES = {"passes": "passes", "schedule": "schedule", "codegen": "codegen",
               "kernel_compile": "kernel compile", "program": "program", "cache_load": "cache load"}


def enabled(setting: bool | None) -> bool:
    """The option (None: not set) decides; else whether stderr is a terminal."""
    if setting is not None:
        return setting
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class CompileProgress:
    """What one scope's compiles have done so far, and the live line that shows it."""

    def __init__(self, forced: bool, began: float | None = None) -> None:
        self.forced = forced
        self.began = time.perf_counter() if began is None else began
        self.stage = "capture"
        self._begun: set[int] = set()  # ids of the graphs' records
        self._done: set[int] = set()
        self.kernels_written = 0
        self.kernels_built = 0  # compiled in this process (numba, serial Triton)
        self.pending: list[Any] = []  # PendingCompile objects handed to the workers
        self.stages_seen: list[str] = []
        self._timer: threading.Timer | None = None
        self._live: Any = None
        self._lock = threading.Lock()
        self._hooks = contextlib.ExitStack()  # the stage hooks, installed by the first compile
        self._hooked = False

    # -- what the pipeline reports -------------------------------------------------------------
    def compiling(self) -> None:
        """A compile happens in this scope: watch its stages, show the line once SHOW_AFTER_S have passed."""
        if not self._hooked:
            self._hooked = True
            self._hooks.enter_context(instrument(before=self.before, after=self.after))
        if self._timer is None and self._live is None:
            delay = max(0.0, SHOW_AFTER_S - (time.perf_counter() - self.began))
            self._timer = threading.Timer(delay, self._show)
            self._timer.daemon = True
            if delay > 0:
                self._timer.start()
            else:  # due already: shown now, before the stages go by (a thread may start after them)
                self._show()

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        if stage not in self.stages_seen:
            self.stages_seen.append(stage)
        if self._live is not None:
            self._live.refresh()

    def before(self, name: str, record: Any, args: tuple) -> None:
        self._begun.add(id(record))
        self.set_stage(STAGE_NAMES.get(name, name))

    def after(self, name: str, record: Any, artifact: Any) -> None:
        if name == "codegen" and hasattr(artifact, "unique"):
            self.kernels_written += len(artifact.unique())
        elif name == "kernel_compile":
            if artifact is not None and hasattr(artifact, "futures"):
                self.pending.append(artifact)
            elif record is not None:
                self.kernels_built += getattr(record, "unique_kernels", 0)
        elif name in ("program", "cache_load"):
            self._done.add(id(record))
            # Then the program's first run, or AOTAutograd and Dynamo go on (a backward, the next frame).
            self.set_stage("first run")

    @property
    def graphs_begun(self) -> int:
        return len(self._begun)

    @property
    def graphs_done(self) -> int:
        return len(self._done)

    # -- the line ------------------------------------------------------------------------------
    def kernels_done(self) -> int:
        done = self.kernels_built
        for pending in self.pending:
            if pending.done or pending.results is not None:
                done += len(pending.todo)
            else:
                done += sum(f.done() for f in pending.futures)
        return done

    def line(self) -> str:
        text = f"ember compiling: {self.stage} | graphs {self.graphs_done}/{self.graphs_begun}"
        if self.kernels_written or self.pending:
            written = max(self.kernels_written, sum(len(p.todo) for p in self.pending))
            text += f" | kernels {self.kernels_done()}/{written}"
        return text + f" | {time.perf_counter() - self.began:.1f} s"

    def _show(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        with self._lock:
            if self._timer is None:  # stopped meanwhile
                return
            console = Console(stderr=True, force_terminal=True if self.forced else None)
            self._live = Live(get_renderable=lambda: Text(self.line()), console=console, transient=True,
                              refresh_per_second=4, redirect_stdout=False, redirect_stderr=False)
            self._live.start(refresh=True)

    def stop(self) -> None:
        self._hooks.close()
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            live, self._live = self._live, None
        if live is not None:
            live.stop()
            summary = (f"ember compiled {self.graphs_done} graph(s), {self.kernels_done()} kernel(s) in "
                       f"{time.perf_counter() - self.began:.1f} s")
            live.console.print(summary, highlight=False)


class Scope:
    """One open scope: when it began, and its progress line once something compiles in it."""

    __slots__ = ("setting", "began", "progress", "checked")

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.began = time.perf_counter()
        self.progress: CompileProgress | None = None
        self.checked = False  # whether ``enabled`` was asked (once per scope, at its first compile)


_CURRENT: list[Scope] = []


def open_scope(setting: bool | None) -> Scope | None:
    """Open a scope unless one is open (then None: this call joins it). Costs a clock read: the
    progress line is made only when something compiles (every call of a compiled model opens one)."""
    if _CURRENT:
        return None
    opened = Scope(setting)
    _CURRENT.append(opened)
    return opened


def close_scope(opened: Scope | None) -> None:
    if opened is None:
        return
    _CURRENT.pop()
    if opened.progress is not None:
        opened.progress.stop()


@contextlib.contextmanager
def scope(setting: bool | None) -> Iterator[None]:
    """One call of a compiled model, or one compile: joins the scope already open, if any."""
    opened = open_scope(setting)
    try:
        yield
    finally:
        close_scope(opened)


def _active() -> CompileProgress | None:
    """The open scope's progress line, made at its first compile when the line is on."""
    if not _CURRENT:
        return None
    current = _CURRENT[-1]
    if not current.checked:
        current.checked = True
        if enabled(current.setting):
            current.progress = CompileProgress(forced=bool(current.setting), began=current.began)
    return current.progress


def compiling() -> None:
    """The backend compiles a frame in the open scope (if any)."""
    progress = _active()
    if progress is not None:
        progress.compiling()


def waiting_for_kernels(pending: Any) -> None:
    """A program's first call waits for its kernels (runtime/precompile.py PendingCompile)."""
    progress = _active()
    if progress is not None:
        if pending not in progress.pending:
            progress.pending.append(pending)
        progress.compiling()
        progress.set_stage("kernel compile")
