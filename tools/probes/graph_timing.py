# A probe helper, not part of the project (docs/performance.md, thirteenth session).
import torch


def time_graph(fn, n, reps=20):
    """Mean device time of one fn(i) call, i in 0..n, in us: the n calls captured in one CUDA
    graph (after one warm-up pass on a side stream), 3 warm-up replays, then the median of
    three timings of `reps` replays between CUDA events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (reps * n))
    return sorted(ts)[1]
