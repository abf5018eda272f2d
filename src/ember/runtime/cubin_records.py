"""The records of generated kernels' binaries: what a static launch needs, kept on disk.

A binary Triton compiled (``CompiledKernel``) becomes a ``Binary``: its cubin kept by content
hash under ``<kernel dir>/cubins/``, its launch facts (function, warps, shared memory, the
arguments it takes and their types) in a JSON file named by the kernel and a tag of its text,
Triton's key, torch's version and the GPU (``record_path``), one entry per launch key
(``key_text``). ``cubin_launch`` reads them to launch; compile workers write them. Nothing here
imports torch: a worker compiling for the parent's target does not load it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.runtime.kernel_module import replace_atomic

# Triton's signature types -> the static launcher's argument codes (as Inductor maps them).
_ARG_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
              "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
_SCRATCH_FIELDS = ("global_scratch_size", "profile_scratch_size")
_LOCK = threading.Lock()


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


class OnTriton:
    """A key launched through Triton's own path (with why, for the log)."""

    def __init__(self, why: str) -> None:
        self.why = why


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


def binary_of(compiled: Any, n_args: int) -> tuple[Binary, bytes] | OnTriton:
    """The launch facts and cubin of Triton's ``CompiledKernel`` for a call with ``n_args``
    positional arguments, or why the static launcher cannot run it."""
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1:
        return OnTriton("more than one CTA")
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return OnTriton("cooperative or programmatic-dependent launch")
    if tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in ((1, 1, 1), (1,), ()):
        return OnTriton("cluster launch")
    if getattr(md, "tensordesc_meta", None):
        return OnTriton("tensor descriptors")
    scratch = 0
    for name in _SCRATCH_FIELDS:
        if hasattr(md, name):
            if getattr(md, name):
                return OnTriton(f"{name} {getattr(md, name)}")
            scratch += 1
    cubin = getattr(compiled, "asm", {}).get("cubin")
    if not isinstance(cubin, bytes | bytearray):
        return OnTriton("no cubin")
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
            return OnTriton(f"argument {names[i]} passed by name")
        code = "O" if isinstance(ty, str) and ty.startswith("*") else _ARG_CODES.get(ty)
        if code is None:
            return OnTriton(f"argument type {ty}")
        passed.append(i)
        codes.append(code)
    digest = hashlib.sha256(bytes(cubin)).hexdigest()[:32]
    return Binary(f"{digest}.cubin", str(md.name), int(md.num_warps), int(md.shared), "".join(codes) + "O" * scratch,
                  tuple(passed), scratch), bytes(cubin)


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


def save_record(path: Path, name: str, key: str, found: tuple[Binary, bytes] | OnTriton,
                records: dict[str, dict] | None = None) -> None:
    """Add ``found`` under ``key`` to the record file ``path`` (its cubin beside it), merged with
    what another process recorded meanwhile; ``records``: this process's copy, updated in place."""
    if isinstance(found, OnTriton):
        entry = {"triton": found.why}
    else:
        binary, data = found
        if not intact(path.parent / binary.cubin):
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
    return not isinstance(found, OnTriton)


def intact(path: Path) -> bool:
    """Whether the cubin file exists and its bytes hash to its name: a damaged one is never loaded."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32] == path.stem
    except OSError:
        return False
