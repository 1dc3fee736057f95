# A probe, not part of the project (docs/performance.md, thirteenth session): a plain
# one-tile-per-program KDA decode step in Triton (K-first state [K][V], activated f32 inputs),
# to see what a non-persistent kernel with the full arithmetic reaches.
# `python3 triton_decode.py` times H 12/32 x N 64/256; `--once fp32 64` launches one case 4x.
import torch, triton, triton.language as tl, json, sys
from graph_timing import time_graph

@triton.jit
def kda_tile(S, Q, Kk, D, Vv, B, O, slots, HV: tl.constexpr, K: tl.constexpr, CW: tl.constexpr,
             V: tl.constexpr, VB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nh = pid // VB
    cb = (pid % VB) * CW
    n = nh // HV
    hv = nh % HV
    slot = tl.load(slots + n).to(tl.int64)
    r = tl.arange(0, K)
    c = tl.arange(0, CW)
    sp = S + (slot * HV + hv) * K * V + r[:, None] * V + cb + c[None, :]
    s = tl.load(sp).to(tl.float32)
    q = tl.load(Q + nh * K + r)
    k = tl.load(Kk + nh * K + r)
    d = tl.load(D + nh * K + r)
    v = tl.load(Vv + nh * V + cb + c)
    b = tl.load(B + nh)
    s = s * d[:, None]
    u = tl.sum(s * k[:, None], axis=0)
    delta = b * (v - u)
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(sp, s.to(S.dtype.element_ty))
    tl.store(O + nh * V + cb + c, o)

def bench(fn, nsets):
    return time_graph(fn, nsets)


def once(state, cw, H=32, N=256):
    """One H x N call of cw columns a program (4 warps), four launches: for a profiler."""
    K = V = 128
    dev = "cuda"
    dt = torch.float32 if state == "fp32" else torch.float16
    S = (torch.randn(N * H * K * V, device=dev) * 0.1).to(dt)
    slots = torch.arange(N, device=dev, dtype=torch.int32)
    Q = torch.randn(N * H * K, device=dev) * 0.1
    Kk = torch.randn(N * H * K, device=dev) * 0.1
    D = torch.rand(N * H * K, device=dev)
    Vv = torch.randn(N * H * V, device=dev)
    B = torch.rand(N * H, device=dev)
    O = torch.empty(N * H * V, device=dev)
    for _ in range(4):
        kda_tile[(N * H * (V // cw),)](S, Q, Kk, D, Vv, B, O, slots, H, K, cw, V, V // cw, num_warps=4)
    torch.cuda.synchronize()


def main():
    K = V = 128
    dev = "cuda"
    for H, N in [(12, 64), (32, 64), (12, 256), (32, 256)]:
        for dt in [torch.float16, torch.float32]:
            esz = 2 if dt == torch.float16 else 4
            per = N * H * K * V * esz
            nsets = max(2, int(800e6 // per))
            S = (torch.randn(nsets * N * H * K * V, device=dev) * 0.1).to(dt)
            slots = [torch.arange(i * N, (i + 1) * N, device=dev, dtype=torch.int32) for i in range(nsets)]
            Q = torch.randn(N * H * K, device=dev) * 0.1
            Kk = torch.nn.functional.normalize(torch.randn(N * H, K, device=dev), dim=-1).reshape(-1)
            D = torch.rand(N * H * K, device=dev) * 0.1 + 0.9
            Vv = torch.randn(N * H * V, device=dev)
            B = torch.rand(N * H, device=dev)
            O = torch.empty(N * H * V, device=dev)
            res = dict(H=H, N=N, dtype=str(dt), bytes_rw=2 * per, nsets=nsets)
            for cw in [32, 64, 128]:
                for nw in [4, 8]:
                    vb = V // cw
                    try:
                        res[f"cw{cw}_w{nw}"] = round(bench(lambda i: kda_tile[(N * H * vb,)](S, Q, Kk, D, Vv, B, O, slots[i], H, K, cw, V, vb, num_warps=nw), nsets), 2)
                    except Exception as e:
                        res[f"cw{cw}_w{nw}"] = str(e)[:80]
            if dt == torch.float16:
                # check one step against torch (fp32 arithmetic)
                s0 = S[: N * H * K * V].view(N * H, K, V).float().clone()
                kda_tile[(N * H * 2,)](S, Q, Kk, D, Vv, B, O, slots[0], H, K, 64, V, 2, num_warps=4)
                sd = s0 * D.view(N * H, K, 1)
                u = (sd * Kk.view(N * H, K, 1)).sum(1)
                de = B.view(-1, 1) * (Vv.view(N * H, V) - u)
                s1 = sd + Kk.view(N * H, K, 1) * de.view(N * H, 1, V)
                o = (s1 * Q.view(N * H, K, 1)).sum(1)
                res["max_err_o"] = float((o - O.view(N * H, V)).abs().max())
            print(json.dumps(res), flush=True)
            del S; torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--once":
        once(sys.argv[2], int(sys.argv[3]))
    else:
        main()
