# A probe, not part of the project (docs/performance.md, thirteenth session).
# What a plain in-place tile read-modify-write reaches with eager decode's decomposition:
# one program per (head, column block), [K rows x CW columns] of a K-first head, no pipeline.
import torch, triton, triton.language as tl, json, sys
from graph_timing import time_graph

@triton.jit
def tile_rmw(S, scale, K: tl.constexpr, CW: tl.constexpr, V: tl.constexpr, VB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    head = pid // VB
    cb = (pid % VB) * CW
    r = tl.arange(0, K)[:, None]
    c = tl.arange(0, CW)[None, :]
    ptr = S + head * K * V + r * V + cb + c
    x = tl.load(ptr)
    tl.store(ptr, (x.to(tl.float32) * scale).to(x.dtype))

def bench(fn, bufs):
    return time_graph(lambda i: fn(bufs[i]), len(bufs))

K = V = 128
only = sys.argv[1] if len(sys.argv) > 1 else None
for heads in [768, 8192]:
    for dt in [torch.float16, torch.float32]:
        esz = 2 if dt == torch.float16 else 4
        by = heads * K * V * esz
        nb = max(2, int(800e6 // by))
        bufs = [torch.randn(heads * K * V, device="cuda", dtype=dt) for _ in range(nb)]
        res = dict(heads=heads, dtype=str(dt), bytes_rw=2 * by, nbufs=nb)
        res["mul_"] = bench(lambda b: b.mul_(0.999), bufs)
        for cw in [32, 64, 128]:
            for nw in [4, 8]:
                vb = V // cw
                res[f"tile_cw{cw}_w{nw}"] = bench(lambda b: tile_rmw[(heads * vb,)](b, 0.999, K, cw, V, vb, num_warps=nw), bufs)
        for k, v in list(res.items()):
            if k == "mul_" or k.startswith("tile"):
                res[k + "_tbs"] = round(2 * by / v / 1e6, 3)
        print(json.dumps(res), flush=True)
        del bufs; torch.cuda.empty_cache()
