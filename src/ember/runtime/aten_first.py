"""A CPU program whose kernels are still compiling: ATen now, the generated kernels once ready.

numba compiles a kernel module in 0.2-1.4 s on a 2-core CPU, and a transformer's training step
has a few dozen of them: most of a cold first call. Yet every fused group also runs correctly op
by op through ATen (the ``aten`` target's path). So, where numba has not cached a graph's kernels,
the compile hands them to worker processes (runtime/cpu_compile.compile_behind) and links two
programs from one plan: one with every fused group on ATen, used at once, and one with the
kernels, linked at the first call after the workers finish (loading their machine code from
numba's cache then takes milliseconds per module, plus numba's own import once per process).

Both programs compute the same graph with the same inputs and outputs; results differ only by
float rounding (fused kernels keep intermediates in registers), as Ember's kernels differ from
eager anyway. The ATen program is no less accurate than the kernels' program: in float64 both match
eager to ~1e-10 on style_transfer's training step. In float32 either may flip a ReLU mask whose
input is within rounding of zero (float64 pre-activations of 0.7-3e-6 against 2.4e-6 rms float32
error) where eager does not, and one flip moves gradients 2e-4 to 4e-3 off float64: of
style_transfer's seed checks at seeds 0-11, the ATen program failed eager's 4x bound on 2, the
kernels' program on 4, each time by such a flip.
``EMBER_CPU_ATEN_FIRST=0`` makes the first call wait for the kernels instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class AtenFirstRun:
    """``run(args)`` of the ATen program until the kernels' compile is done, then of the kernels'
    program. ``status`` says which runs and why (``ember.explain`` shows it)."""

    def __init__(self, aten_run: Callable[[list], object], pending: Any, link_kernels: Callable[[], Callable[[list], object]],
                 on_status: Callable[[str], None]) -> None:
        self._aten = aten_run
        self._pending = pending
        self._link_kernels = link_kernels
        self._on_status = on_status
        self._fast: Callable[[list], object] | None = None
        self.aten_calls = 0
        on_status(f"ATen until its {len(pending.jobs)} uncompiled kernel module(s) are compiled by the workers")

    def __call__(self, args: list) -> object:
        if self._fast is None and self._pending.done():
            self._switch()
        if self._fast is not None:
            return self._fast(args)
        self.aten_calls += 1
        return self._aten(args)

    def _switch(self) -> None:
        try:
            self._fast = self._link_kernels()
        except Exception as err:  # noqa: BLE001 - the ATen program stays: slower, never wrong
            self._on_status(f"ATen: linking the compiled kernels failed ({type(err).__name__}: {str(err)[:200]})")
            self._fast = self._aten
        else:
            seconds = self._pending.seconds or 0.0
            self._on_status(f"generated kernels from call {self.aten_calls + 1} (the first {self.aten_calls} ran "
                            f"through ATen while {len(self._pending.jobs)} module(s) compiled in {seconds:.2f} s)")
        self._aten = None  # type: ignore[assignment] - its buffers and frozen values can go
