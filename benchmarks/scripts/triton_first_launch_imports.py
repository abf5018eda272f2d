import sys, time
t=time.perf_counter()
import torch, triton, triton.language as tl
print("after import triton: gluon loaded:", any(m.startswith("triton.experimental.gluon") for m in sys.modules))
@triton.jit
def k(x, n, B: tl.constexpr):
    i = tl.arange(0, B); tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)
x = torch.zeros(16, device="cuda")
import builtins
orig = builtins.__import__
def imp(name, *a, **kw):
    if "gluon" in name and not any(m.startswith("triton.experimental.gluon") for m in sys.modules):
        import traceback; traceback.print_stack(limit=8)
    return orig(name, *a, **kw)
builtins.__import__ = imp
t=time.perf_counter(); k[(1,)](x, 16, B=16); torch.cuda.synchronize(); print(f"first launch {time.perf_counter()-t:.3f} s")
builtins.__import__ = orig
print("after launch: gluon loaded:", any(m.startswith("triton.experimental.gluon") for m in sys.modules))
t=time.perf_counter(); k[(1,)](x, 16, B=16); torch.cuda.synchronize(); print(f"second launch {time.perf_counter()-t:.6f} s")
