# A probe, not part of the project (docs/performance.md, thirteenth session).
# Streaming ceilings on this GPU: a copy to a distinct buffer against a read-modify-write in
# place, same bytes, torch's vectorised elementwise kernels, CUDA graphs, rotating buffers.
import torch, json, sys
dev = torch.device("cuda")
def bench(make, run, nbufs, reps=20):
    bufs = [make() for _ in range(nbufs)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for b in bufs: run(b)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for b in bufs: run(b)
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps): g.replay()
        e1.record(); torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) * 1e3 / (reps * nbufs))
    del bufs, g
    torch.cuda.empty_cache()
    return sorted(best)[1]
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
