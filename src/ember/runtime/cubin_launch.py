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

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember.runtime.kernel_module import replace_atomic

log = logging.getLogger(__name__)

# Triton's signature types -> the static launcher's argument codes (as Inductor maps them).
_ARG_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
              "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
_SCRATCH_FIELDS = ("global_scratch_size", "profile_scratch_size")
_LOCK = threading.Lock()
# Launch keys resolved in this process: from a recorded binary; kept on Triton's path by a record;
# through Triton's path (then recorded). ``ember.explain`` reports them.
STATS = {"stored": 0, "kept": 0, "triton": 0, "recorded": 0}


@dataclass
class Binary:
    """One compiled variant of a kernel, as the static launcher runs it."""

    cubin: str  # file name under the cubin folder (the SHA-256 of its bytes)
    function: str  # the kernel's name inside the cubin
    num_warps: int
    shared: int
    arg_tys: str  # one code per argument the binary takes (the scratch pointers' included)
    passed: tuple[int, ...]  # positions of the call's arguments the binary takes (constexprs folded)
    scratch: int = 0  # trailing null pointers the binary expects (unused scratch buffers)
    loaded: dict[int, int] = field(default_factory=dict, repr=False)  # device -> function handle

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("loaded")
        out["passed"] = list(self.passed)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Binary:
        return cls(str(data["cubin"]), str(data["function"]), int(data["num_warps"]), int(data["shared"]),
                   str(data["arg_tys"]), tuple(int(i) for i in data["passed"]), int(data.get("scratch", 0)))


class _OnTriton:
    """A key launched through Triton's own path (with why, for the log)."""

    def __init__(self, why: str) -> None:
        self.why = why


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


def key_text(key: tuple) -> str:
    """The JSON name of a launch key: ``BLOCK=256;bfloat16:A,float32:U,4`` (meta by name)."""
    meta, args = key
    parts = []
    for a in args:
        if isinstance(a, tuple):
            parts.append(f"{str(a[0]).removeprefix('torch.')}:{'A' if a[1] else 'U'}")
        else:
            parts.append(repr(a))
    return ";".join([",".join(f"{k}={v}" for k, v in sorted(meta)), ",".join(parts)])


def binary_of(compiled: Any, n_args: int) -> tuple[Binary, bytes] | _OnTriton:
    """The launch facts and cubin of Triton's ``CompiledKernel`` for a call with ``n_args``
    positional arguments, or why the static launcher cannot run it."""
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1:
        return _OnTriton("more than one CTA")
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return _OnTriton("cooperative or programmatic-dependent launch")
    if tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in ((1, 1, 1), (1,), ()):
        return _OnTriton("cluster launch")
    if getattr(md, "tensordesc_meta", None):
        return _OnTriton("tensor descriptors")
    scratch = 0
    for name in _SCRATCH_FIELDS:
        if hasattr(md, name):
            if getattr(md, name):
                return _OnTriton(f"{name} {getattr(md, name)}")
            scratch += 1
    cubin = getattr(compiled, "asm", {}).get("cubin")
    if not isinstance(cubin, bytes | bytearray):
        return _OnTriton("no cubin")
    src = compiled.src
    names = list(src.fn.arg_names)

    def position(k: Any) -> int:
        if isinstance(k, str):
            return names.index(k)
        return k[0] if isinstance(k, tuple) else int(k)

    signature = {position(k): v for k, v in src.signature.items()}
    constants = {position(k) for k in getattr(src, "constants", {})}
    passed, codes = [], []
    for i in range(len(names)):
        ty = signature.get(i, "constexpr")
        if ty == "constexpr" or i in constants:
            continue
        if i >= n_args:
            return _OnTriton(f"argument {names[i]} passed by name")
        code = "O" if isinstance(ty, str) and ty.startswith("*") else _ARG_CODES.get(ty)
        if code is None:
            return _OnTriton(f"argument type {ty}")
        passed.append(i)
        codes.append(code)
    digest = hashlib.sha256(bytes(cubin)).hexdigest()[:32]
    return Binary(f"{digest}.cubin", str(md.name), int(md.num_warps), int(md.shared), "".join(codes) + "O" * scratch,
                  tuple(passed), scratch), bytes(cubin)


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


def record_place(path: Path, name: str, default_folder: Path) -> tuple[Path, str]:
    """Where kernel ``name`` of the module file ``path`` keeps its binaries, and its record's name:
    a generated kernel (its file is named after it, in a kernel folder) beside its file; a kernel
    of a hand-written module (in Ember's package) under ``default_folder`` as ``module.kernel``."""
    if path.stem == name:
        return path.parent / "cubins", name
    return default_folder / "cubins", f"{path.stem}.{name}"


def record_path(folder: Path, name: str, text: str, tag: str) -> Path:
    """The record file of kernel ``name`` with module text ``text`` for the device ``tag``."""
    text_hash = hashlib.sha256(text.encode()).hexdigest()
    tag_hash = hashlib.sha256(f"{text_hash}\n{tag}".encode()).hexdigest()[:16]
    return folder / f"{name}.{tag_hash}.json"


def read_records(path: Path, name: str) -> dict[str, dict]:
    """Key text -> stored entry of a record file ({} when missing or damaged)."""
    try:
        data = json.loads(path.read_text())
        records = data["binaries"] if data.get("kernel") == name else {}
        return records if isinstance(records, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save_record(path: Path, name: str, key: str, found: tuple[Binary, bytes] | _OnTriton,
                records: dict[str, dict] | None = None) -> None:
    """Add ``found`` under ``key`` to the record file ``path`` (its cubin beside it), merged with
    what another process recorded meanwhile; ``records``: this process's copy, updated in place."""
    if isinstance(found, _OnTriton):
        entry = {"triton": found.why}
    else:
        binary, data = found
        if not _intact(path.parent / binary.cubin):
            replace_atomic(path.parent / binary.cubin, data)
        entry = binary.to_json()
    with _LOCK:
        records = records if records is not None else {}
        records[key] = entry
        records.update({k: v for k, v in read_records(path, name).items() if k not in records})
        replace_atomic(path, json.dumps({"kernel": name, "binaries": records}, indent=1).encode())


def record_compiled(module_path: Path, name: str, default_folder: Path, tag: str, key: str,
                    compiled: Any, n_args: int) -> bool:
    """Record a binary a compile worker built (``key``: what the parent's launch will look up);
    False where the static launcher cannot run it (recorded as such: the launch takes Triton's path)."""
    folder, record_name = record_place(module_path, name, default_folder)
    found = binary_of(compiled, n_args)
    save_record(record_path(folder, record_name, module_path.read_text(), tag), record_name, key, found)
    return not isinstance(found, _OnTriton)


def _intact(path: Path) -> bool:
    """Whether the cubin file exists and its bytes hash to its name: a damaged one is never loaded."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32] == path.stem
    except OSError:
        return False


class CubinKernel:
    """A generated kernel as a program names it: ``kernel[(grid,)](*args, **meta)`` launches the
    stored binary for the call's key, else goes through Triton (``load_jit`` gives the function)."""

    def __init__(self, name: str, text: str, folder: Path, load_jit: Callable[[], Any]) -> None:
        self.name = name  # the record's name (record_place)
        self.folder = folder  # where its binaries are kept
        self._text = text
        self._load_jit = load_jit
        self._jit: Any = None
        self._table: dict[tuple, Binary | _OnTriton] = {}
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
        if isinstance(binary, _OnTriton):
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
            self._table[(device, key)] = _OnTriton(f"{type(err).__name__}: {err}")
            self.jit()[grid](*args, **meta)

    # -- records ---------------------------------------------------------------------------------

    def _record_path(self, device: int) -> Path:
        return record_path(self.folder, self.name, self._text, device_tag(device))

    def _stored(self, device: int) -> dict[str, dict]:
        records = self._records.get(device)
        if records is None:
            records = self._records[device] = read_records(self._record_path(device), self.name)
        return records

    def _resolve(self, device: int, key: tuple, grid: tuple, args: tuple, meta: dict) -> Binary | _OnTriton | None:
        """The binary (or Triton's path) for ``key`` on ``device``, from its record; without a usable
        record, launch through Triton, record what it ran and return None (launched)."""
        entry = self._stored(device).get(key_text(key))
        if entry is not None:
            try:
                binary: Binary | _OnTriton = (_OnTriton(str(entry["triton"])) if "triton" in entry
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
            binary = found if isinstance(found, _OnTriton) else found[0]
            if isinstance(binary, Binary):
                self._load(binary, device)  # the next launch of this key goes to it
        except Exception as err:  # noqa: BLE001 - not recorded, or not loadable here: Triton's path
            log.debug("no stored binary for %s", self.name, exc_info=True)
            binary = _OnTriton(f"{type(err).__name__}: {err}")
        self._table[(device, key)] = binary
        return None

    def _save(self, found: tuple[Binary, bytes] | _OnTriton, key: tuple, device: int) -> None:
        save_record(self._record_path(device), self.name, key_text(key), found, self._stored(device))
        STATS["recorded"] += 1

    def _load(self, binary: Binary, device: int) -> int:
        path = self.folder / binary.cubin
        if not _intact(path):
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
