"""What a compiled Triton kernel records about itself, and launching its binary without Triton.

    PYTHONPATH=src python benchmarks/scripts/cubin_launch_probe.py [--out DIR]

On a CUDA machine: compiles two small kernels through Triton's JIT (one with an integer argument
equal to 1, one with unaligned pointers), prints what each ``CompiledKernel`` holds (its source's
signature, constants and attributes, its metadata), loads the same binary through torch's static
CUDA launcher, launches it, and compares the results with the JIT launch's; then times 20,000
launches each way. ``--out`` also gets torch's static launcher module source.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
import time
from pathlib import Path

SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def scale_add(x_ptr, y_ptr, out_ptr, n, alpha, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha + y, mask=mask)
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"static launcher {hasattr(torch._C, '_StaticCudaLauncher')}")
    launcher = torch._C._StaticCudaLauncher
    for name in ("_load_kernel", "_launch_kernel", "_unload_kernel"):
        print(f"  {name}: {getattr(launcher, name, None).__doc__!r}" if hasattr(launcher, name) else f"  {name}: absent")
    for modname in ("torch._inductor.runtime.static_cuda_launcher", "torch._inductor.runtime.static_triton_launcher"):
        spec = importlib.util.find_spec(modname)
        print(f"  {modname}: {spec.origin if spec else None}")
        if spec and args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, modname.rsplit('.', 1)[1] + ".py.txt").write_text(Path(spec.origin).read_text())

    folder = Path(tempfile.mkdtemp())
    path = folder / "probe_kernels.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("probe_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.scale_add
    dev = torch.device("cuda")
    n = 1000
    x = torch.randn(2 * n + 1, device=dev)
    y = torch.randn(n + 3, device=dev)
    cases = {
        "aligned, stride 1": (x[:n], y[:n], 1),
        "x unaligned, stride 2": (x[1:], y[:n], 2),
        "y unaligned": (x[:n], y[3:], 1),
    }
    for label, (xa, ya, stride) in cases.items():
        out = torch.empty(n, device=dev)
        fn[(triton.cdiv(n, 256),)](xa, ya, out, n, 0.5, stride, BLOCK=256)
        torch.cuda.synchronize()
        ref = xa[: n * stride: stride][:n] * 0.5 + ya[:n]
        print(f"\n[{label}] JIT launch max error {(out - ref).abs().max().item():.3g}")
    caches = fn.device_caches[torch.cuda.current_device()]
    kernels = caches[0]
    print(f"\n{len(kernels)} compiled variants; device_caches entry has {len(caches)} parts")
    for key, kernel in kernels.items():
        print(f"\nkey: {key!r}")
        src = kernel.src
        for attr in ("signature", "constants", "attrs"):
            print(f"  src.{attr}: {getattr(src, attr, None)!r}")
        md = kernel.metadata
        fields = md._asdict() if hasattr(md, "_asdict") else vars(md)
        print("  metadata: " + ", ".join(f"{k}={v!r}" for k, v in fields.items() if k not in ("target",)))
        print(f"  asm keys {list(kernel.asm.keys())}, name {kernel.name!r}, hash {kernel.hash!r}")
        print(f"  shared {getattr(kernel, 'shared', None)}, packed_metadata? {hasattr(kernel, 'packed_metadata')}")
    # The static launcher, by hand.
    key, kernel = next(iter(kernels.items()))
    cubin = folder / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    shared = kernel.metadata.shared
    loaded = launcher._load_kernel(str(cubin), kernel.name, shared, torch.cuda.current_device())
    print(f"\n_load_kernel returned {len(loaded)} values: {[type(v).__name__ for v in loaded]}")
    function = loaded[1] if len(loaded) == 4 else loaded[0]
    sig = inspect.signature(fn.fn)
    print(f"  python signature {sig}")
    stream = torch.cuda.current_stream().cuda_stream
    xa, ya, stride = cases["aligned, stride 1"]
    out = torch.empty(n, device=dev)
    extra = ""
    args_static: tuple = (xa, ya, out, n, 0.5, stride)
    types = "OOOifi"
    # Arguments Triton folded into constants (an int equal to 1) are not passed to the binary.
    consts = getattr(kernel.src, "constants", {})
    names = fn.arg_names
    keep = [i for i, nm in enumerate(names[:6]) if (i,) not in consts and nm not in consts and i not in consts]
    args_static = tuple(args_static[i] for i in keep)
    types = "".join(types[i] for i in keep)
    for field in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(kernel.metadata, field):
            types += "O"
            args_static += (None,)
            extra += f" +{field}"
    print(f"  passing {types!r}{extra}")
    try:
        launcher._launch_kernel(function, triton.cdiv(n, 256), 1, 1, kernel.metadata.num_warps, shared,
                                types, args_static, stream)
        torch.cuda.synchronize()
        ref = xa * 0.5 + ya
        print(f"  static launch max error {(out - ref).abs().max().item():.3g}")
    except Exception as err:  # noqa: BLE001 - a probe: report and go on
        print(f"  static launch failed: {type(err).__name__}: {err}")
        sys.exit(0)
    grid = (triton.cdiv(n, 256),)
    for label, call in (
        ("Triton JIT", lambda: fn[grid](xa, ya, out, n, 0.5, stride, BLOCK=256)),
        ("static launcher", lambda: launcher._launch_kernel(function, grid[0], 1, 1, kernel.metadata.num_warps,
                                                            shared, types, args_static, stream)),
    ):
        for _ in range(100):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20000):
            call()
        torch.cuda.synchronize()
        print(f"  {label}: {(time.perf_counter() - t0) / 20000 * 1e6:.2f} us per launch")


if __name__ == "__main__":
    main()
