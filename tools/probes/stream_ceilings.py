# A probe, not part of the project (docs/performance.md, thirteenth session).
# Streaming ceilings on this GPU: a copy to a distinct buffer against a read-modify-write in
# place, same bytes, torch's vectorised elementwise kernels, CUDA graphs, rotating buffers.
import torch, json, sys
dev = torch.device("cuda")
from graph_timing import time_graph


def bench(make, run, nbufs):
    bufs = [make() for _ in range(nbufs)]
    us = time_graph(lambda i: run(bufs[i]), nbufs)
    del bufs
    torch.cuda.empty_cache()
    return us


for mb in [50.331648, 100.663296, 268.435456, 536.870912, 1073.741824]:
    by = int(mb * 1e6 / 2)  # bytes read (= written)
    nb = max(2, int(800e6 // by))
    for dt in [torch.float16, torch.float32]:
        n = by // (2 if dt == torch.float16 else 4)
        cp = bench(lambda: (torch.randn(n, device=dev, dtype=dt), torch.empty(n, device=dev, dtype=dt)), lambda b: b[1].copy_(b[0]), nb)
        ip = bench(lambda: torch.randn(n, device=dev, dtype=dt), lambda b: b.mul_(0.999), nb)
        op = bench(lambda: (torch.randn(n, device=dev, dtype=dt), torch.empty(n, device=dev, dtype=dt)), lambda b: torch.mul(b[0], 0.999, out=b[1]), nb)
        r = dict(bytes_rw=2 * by, dtype=str(dt), copy_us=cp, inplace_mul_us=ip, outofplace_mul_us=op,
                 copy_tbs=2 * by / cp / 1e6, inplace_tbs=2 * by / ip / 1e6, oop_tbs=2 * by / op / 1e6, nbufs=nb)
        print(json.dumps(r), flush=True)
