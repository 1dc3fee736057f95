"""fla-core 0.6.0 prefill on the shapes of `kda-pool bench --op prefill`: chunked (chunk_kda,
fp32 initial state) and token by token (fused_recurrent_kda_fwd, fp32 pool updated in place),
device time per call as the sum of its kernels' device times under torch.profiler. One JSON
line per row; a failing call is a row with its error. Arguments: which kinds to run (chunk,
recurrent; default both): run each in a process of its own, as a fault in one (an illegal
address) leaves the process's CUDA context unusable."""
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

dev = "cuda"
torch.manual_seed(1)
K = V = 128
kinds = sys.argv[1:] or ["chunk", "recurrent"]


def device_us(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters


def row(**kw):
    print(json.dumps(kw), flush=True)


# FLA_HEADS (default 12,32): the value heads to run (its Triton autotuning takes minutes per shape)
heads = [int(h) for h in os.environ.get("FLA_HEADS", "12,32").split(",")]
for H in heads:
    for nseq, L in ((1, 256), (32, 256), (1, 2048), (8, 4096), (1, 32768)):
        if H == 32 and L == 32768:
            continue
        T = nseq * L
        r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
        q, k, v, g = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H, K)
        beta = r(1, T, H)
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H * K, device=dev) * 0.1
        cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
        h0 = torch.randn(nseq, H, K, V, device=dev) * 0.1
        flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        cases = {
            "chunk": lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu.long(), **flags),
            "recurrent": lambda: fused_recurrent_kda_fwd(
                q, k, v, g, beta, initial_state=h0, inplace_final_state=True, cu_seqlens=cu,
                ssm_state_indices=torch.arange(nseq, device=dev, dtype=torch.int32), **flags),
        }
        for name, fn in cases.items():
            if name not in kinds:
                continue
            try:
                us = device_us(fn)
                row(kind="fla-prefill-" + name, H=H, nseq=nseq, L=L, T=T, device_us=us,
                    mtok_per_s=T / us)
            except Exception as e:  # noqa: BLE001
                row(kind="fla-prefill-" + name, H=H, nseq=nseq, L=L, error=str(e)[:300])
        del q, k, v, g, beta, h0
        torch.cuda.empty_cache()
