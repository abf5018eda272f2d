"""Compile Ember's generated Triton kernels for an H100 (sm_90) on any machine, and time each.

Triton compiles to a cubin without a GPU when given the target explicitly (ptxas ships with
Triton), so where a model's cold compile goes can be studied on a CPU machine:

    PYTHONPATH=src python benchmarks/scripts/sm90_compile_time.py KERNELS.json [--json OUT] [--top 15]

KERNELS.json lists kernels as {"name", "path", "dtypes", "meta"} (what ``job_for`` records:
the kernel module file, its pointer argument dtypes and launch meta). Prints a table of the
slowest kernels, the total serial compile time and the totals per kernel family.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from collections import defaultdict

# A fresh Triton cache, so every kernel really compiles (set before Triton reads it).
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sm90_triton_cache_")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_TRITON_TYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def compile_seconds(entry: dict, target: GPUTarget) -> tuple[float, int]:
    """(seconds, PTX lines) of one kernel's compile for ``target``."""
    spec = importlib.util.spec_from_file_location(f"sm90_{entry['name']}", entry["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, entry["name"])
    meta = dict(entry["meta"])
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    pointers = [a for a in fn.arg_names if a not in meta]
    signature = {a: "*" + _TRITON_TYPE[d] for a, d in zip(pointers, entry["dtypes"])}
    signature.update({k: "constexpr" for k in meta})
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=meta), target=target, options=options)
    return time.perf_counter() - start, compiled.asm["ptx"].count("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels")
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    entries = json.load(open(args.kernels))
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for e in entries:
        try:
            secs, ptx = compile_seconds(e, target)
            rows.append({**e, "seconds": secs, "ptx_lines": ptx})
        except Exception as err:  # report and go on: one kernel must not hide the others
            rows.append({**e, "seconds": float("nan"), "error": f"{type(err).__name__}: {err}"[:300]})
    rows.sort(key=lambda r: -(r["seconds"] if r["seconds"] == r["seconds"] else 0))
    print(f"{'seconds':>8} {'ptx':>7}  kernel (meta)")
    for r in rows[: args.top]:
        print(f"{r['seconds']:8.2f} {r.get('ptx_lines', 0):7d}  {r['name']} {r['meta']} {r.get('error', '')}")
    family: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        family[r["name"].split("_")[1]].append(r["seconds"])
    total = sum(r["seconds"] for r in rows if r["seconds"] == r["seconds"])
    print(f"{len(rows)} kernels, serial compile {total:.1f} s; per family: "
          + ", ".join(f"{k} {len(v)} / {sum(v):.1f} s" for k, v in sorted(family.items())))
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} kernel(s) failed to compile, first: {errors[0]['name']}: {errors[0]['error']}")
    if args.json:
        json.dump({"triton": triton.__version__, "target": "cuda sm_90", "kernels": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
