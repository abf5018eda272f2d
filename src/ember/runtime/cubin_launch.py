"""Generated Triton kernels launched from their stored binaries, without Triton's launch path.

Triton launches a ``@triton.jit`` function by binding its arguments to a specialisation key,
looking the binary up (in memory, else in its on-disk cache: a cache key, the metadata file, the
module load and a launcher library) and calling it. In a process that loads a saved program that
is most of the first call's Triton work (resnet50 training on an H200 host: the kernel modules'
182 ``@triton.jit`` decorations 0.33 s, 120 loads from Triton's cache 0.43 s, the first launch
importing Triton's ``gluon`` package 0.18 s), and every launch outside a CUDA graph binds again.

``CubinKernel`` stands where a program names a generated kernel. A launch is keyed by what a
binary is specialised on: the launch's meta and, per argument, a tensor's dtype and whether its
address is 16-byte aligned (an integer by its value). A key with a recorded binary launches it
through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``, the one Inductor uses).
A key without one takes Triton's own path (the kernel module is imported then, not before), and
the binary Triton ran is recorded: its cubin kept by content hash under ``<kernel dir>/cubins/``,
its launch facts (function, warps, shared memory, the arguments it takes and their types) in a
JSON file named by the kernel and a tag of its text, Triton's key, torch's version and the GPU.
A record of another tag is never read; a damaged or missing file, or a binary the static launcher
cannot run (more than one CTA, scratch memory, a cluster or cooperative launch), leaves that key
on Triton's path. ``cubin_launch`` (``EMBER_CUBIN_LAUNCH=0``) turns this off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember.runtime.cubin_records import (
    Binary,
    OnTriton,
    binary_of,
    intact,
    key_text,
    read_records,
    record_path,
    record_place,
    save_record,
)

log = logging.getLogger(__name__)

# Launch keys resolved in this process: from a recorded binary; kept on Triton's path by a record;
# through Triton's path (then recorded). ``ember.explain`` reports them.
STATS = {"stored": 0, "kept": 0, "triton": 0, "recorded": 0}


def available() -> bool:
    """Whether this torch has the static CUDA launcher and a GPU is present."""
    return hasattr(torch._C, "_StaticCudaLauncher") and torch.cuda.is_available()


def enabled() -> bool:
    """Whether kernels launch recorded binaries here: the ``cubin_launch`` setting on, and available."""
    from ember.config import settings
    return settings().cubin_launch and available()


def default_folder() -> Path:
    """The kernel folder of hand-written kernel modules' binaries (they have no compile of their own)."""
    from ember.config import Options
    return Options().kernel_dir()


def _arg_key(a: Any) -> object:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool | int) or a is None:
        return a
    return type(a).__name__


_DEVICE_TAGS: dict[int, str] = {}


def device_tag(device: int) -> str:
    """What a binary recorded for ``device`` is valid for: Triton's key, torch's version, the GPU."""
    tag = _DEVICE_TAGS.get(device)
    if tag is None:
        import triton.runtime.cache as triton_cache

        from ember.runtime import triton_key
        triton_key.install()
        props = torch.cuda.get_device_properties(device)
        tag = "\n".join([triton_cache.triton_key(), torch.__version__, props.name, f"{props.major}.{props.minor}"])
        _DEVICE_TAGS[device] = tag
    return tag


class CubinKernel:
    """A generated kernel as a program names it: ``kernel[(grid,)](*args, **meta)`` launches the
    stored binary for the call's key, else goes through Triton (``load_jit`` gives the function)."""

    def __init__(self, name: str, text: str, folder: Path, load_jit: Callable[[], Any]) -> None:
        self.name = name  # the record's name (record_place)
        self.folder = folder  # where its binaries are kept
        self._text = text
        self._load_jit = load_jit
        self._jit: Any = None
        self._table: dict[tuple, Binary | OnTriton] = {}
        self._records: dict[int, dict[str, dict]] = {}  # device -> key text -> stored JSON entry

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **meta: self.launch(grid, args, meta)

    def jit(self) -> Any:
        """Triton's function for this kernel (its module imported at the first need)."""
        if self._jit is None:
            self._jit = self._load_jit()
        return self._jit

    def launch(self, grid: tuple, args: tuple, meta: dict) -> None:
        device = torch._C._cuda_getDevice()  # Triton launches on the current device too
        key = (tuple(meta.items()), tuple(map(_arg_key, args)))
        binary = self._table.get((device, key))
        if binary is None:
            binary = self._resolve(device, key, grid, args, meta)
            if binary is None:
                return  # launched through Triton while recording it
        if isinstance(binary, OnTriton):
            self.jit()[grid](*args, **meta)
            return
        function = binary.loaded[device]
        passed = tuple(args[i] for i in binary.passed) + (None,) * binary.scratch
        try:
            torch._C._StaticCudaLauncher._launch_kernel(
                function, grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                binary.num_warps, binary.shared, binary.arg_tys, passed, torch._C._cuda_getCurrentRawStream(device))
        except Exception as err:  # noqa: BLE001 - the launcher refused before launching: Triton's path
            log.warning("ember: %s launches through Triton: the static launcher refused its binary (%s)",
                        self.name, err)
            self._table[(device, key)] = OnTriton(f"{type(err).__name__}: {err}")
            self.jit()[grid](*args, **meta)

    # -- records ---------------------------------------------------------------------------------

    def _record_path(self, device: int) -> Path:
        return record_path(self.folder, self.name, self._text, device_tag(device))

    def _stored(self, device: int) -> dict[str, dict]:
        records = self._records.get(device)
        if records is None:
            records = self._records[device] = read_records(self._record_path(device), self.name)
        return records

    def _resolve(self, device: int, key: tuple, grid: tuple, args: tuple, meta: dict) -> Binary | OnTriton | None:
        """The binary (or Triton's path) for ``key`` on ``device``, from its record; without a usable
        record, launch through Triton, record what it ran and return None (launched)."""
        entry = self._stored(device).get(key_text(key))
        if entry is not None:
            try:
                binary: Binary | OnTriton = (OnTriton(str(entry["triton"])) if "triton" in entry
                                             else Binary.from_json(entry))
                if isinstance(binary, Binary):
                    self._load(binary, device)
                STATS["stored" if isinstance(binary, Binary) else "kept"] += 1
                self._table[(device, key)] = binary
                return binary
            except Exception:  # noqa: BLE001 - a damaged record or cubin: Triton's path below
                log.debug("stored binary of %s unusable", self.name, exc_info=True)
        fn = self.jit()
        fn[grid](*args, **meta)
        STATS["triton"] += 1
        try:
            found = binary_of(fn.warmup(*args, grid=grid, **meta), len(args))
            self._save(found, key, device)
            binary = found if isinstance(found, OnTriton) else found[0]
            if isinstance(binary, Binary):
                self._load(binary, device)  # the next launch of this key goes to it
        except Exception as err:  # noqa: BLE001 - not recorded, or not loadable here: Triton's path
            log.debug("no stored binary for %s", self.name, exc_info=True)
            binary = OnTriton(f"{type(err).__name__}: {err}")
        self._table[(device, key)] = binary
        return None

    def _save(self, found: tuple[Binary, bytes] | OnTriton, key: tuple, device: int) -> None:
        save_record(self._record_path(device), self.name, key_text(key), found, self._stored(device))
        STATS["recorded"] += 1

    def _load(self, binary: Binary, device: int) -> int:
        path = self.folder / binary.cubin
        if not intact(path):
            raise ValueError(f"{path.name} is missing or does not match its hash")
        loaded = torch._C._StaticCudaLauncher._load_kernel(str(path), binary.function, binary.shared, device)
        # torch 2.11 returns (function, registers, spills); later ones put the module first.
        function = loaded[1] if len(loaded) == 4 else loaded[0]
        binary.loaded[device] = function
        return function


class KernelModule:
    """A module of hand-written ``@triton.jit`` kernels as ops launch them
    (``module.kernel[grid](...)``): each kernel named is a ``CubinKernel``, and the module itself
    is imported (``load``) only for a launch that has no recorded binary. Every public name asked
    of it is taken as a kernel: ops read nothing else from these modules."""

    def __init__(self, path: Path, folder: Path, load: Callable[[], Any]) -> None:
        self._path, self._folder, self._load = path, folder, load  # folder: the default kernel folder
        self._text = path.read_text()
        self._module: Any = None
        self._kernels: dict[str, CubinKernel] = {}

    def _real(self) -> Any:
        if self._module is None:
            self._module = self._load()
        return self._module

    def __getattr__(self, name: str) -> CubinKernel:
        if name.startswith("_"):
            raise AttributeError(name)
        kernel = self._kernels.get(name)
        if kernel is None:
            folder, record_name = record_place(self._path, name, self._folder)
            kernel = CubinKernel(record_name, self._text, folder, lambda: getattr(self._real(), name))
            self._kernels[name] = kernel
        return kernel


def describe_launches() -> str | None:
    """One line on how this process's generated GPU kernels launched (None when none did)."""
    if not any(STATS[k] for k in ("stored", "kept", "triton")):
        return None
    return (f"GPU kernel launch keys in this process: {STATS['stored']} from recorded binaries (torch's "
            f"static CUDA launcher), {STATS['triton']} through Triton's launch path and recorded for the "
            f"next process, {STATS['kept']} kept on Triton's path by their record")
