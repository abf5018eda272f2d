import os, time
os.environ["TRITON_INTERPRET"]="1"
import torch, ember
def f(x):
    return torch.softmax(x, -1), x.amax(-1), x.amin(1), (x*2).max(dim=-1).values
x = torch.randn(2, 12, 128, 128)
x[0,0,3,5] = float("nan")
x[1,2,:,7] = float("nan")
c = ember.compile(f, target="triton-interpret")
t=time.time(); out = c(x); print("first", time.time()-t)
t=time.time(); out = c(x); print("second", time.time()-t)
ref = f(x)
for a,b in zip(out, ref): torch.testing.assert_close(a,b, equal_nan=True)
xi = torch.randint(-100,100,(64,33))
g = lambda x: (x.amax(-1), x.amin(0))
ci = ember.compile(g, target="triton-interpret")
for a,b in zip(ci(xi), g(xi)): torch.testing.assert_close(a,b)
xb = torch.randn(64, 40, dtype=torch.bfloat16); xb[3,4]=float('nan')
cb = ember.compile(lambda x: x.amax(-1) + 1, target="triton-interpret")
torch.testing.assert_close(cb(xb), xb.amax(-1)+1, equal_nan=True)
print("ok")
