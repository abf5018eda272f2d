"""The device fingerprint a tuning result belongs to: what makes a timing valid elsewhere.

GPU: name, compute capability, driver, CUDA, Triton and torch versions. CPU: model name and the
ISA flags that change generated code (AVX2, AVX-512 ...), the thread count kernels may use, and
the numba/llvmlite/torch versions. The key is a short hash of the canonical JSON.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from pathlib import Path

import torch

# The ISA flags that change what LLVM or Triton emit (others, e.g. "pni", do not matter).
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
              "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            have = set(value.split())
            flags = [f for f in _ISA_FLAGS if f in have]
    return model, flags


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - an absent library is part of the fingerprint, not an error
        return "none"


@functools.lru_cache(maxsize=4)
def fingerprint(device_type: str) -> dict[str, object]:
    """What a tuning result for ``device_type`` ("cuda" or "cpu") depends on."""
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        try:
            driver = str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") else "unknown"
        except Exception:  # noqa: BLE001
            driver = "unknown"
        return {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "sms": props.multi_processor_count, "driver": driver, "cuda": torch.version.cuda or "none",
                "cudnn": str(torch.backends.cudnn.version()), "triton": _version("triton"),
                "torch": torch.__version__.split("+")[0]}
    model, flags = _cpuinfo()
    return {"kind": "cpu", "name": model, "isa": flags, "threads": torch.get_num_threads(),
            "numba": _version("numba"), "llvmlite": _version("llvmlite"), "triton": _version("triton"),
            "torch": torch.__version__.split("+")[0]}


def device_key(device_type: str) -> str:
    """A short stable key for ``fingerprint(device_type)``."""
    text = json.dumps(fingerprint(device_type), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(device_type: str) -> str:
    fp = fingerprint(device_type)
    if fp["kind"] == "cuda":
        return f"{fp['name']} (sm {fp['capability']}, CUDA {fp['cuda']}, triton {fp['triton']}, torch {fp['torch']})"
    return f"{fp['name']} ({', '.join(fp['isa']) or 'no ISA flags'}; {fp['threads']} threads)"  # type: ignore[arg-type]
