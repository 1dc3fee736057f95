// Decode, spec_verify and replay over the replay ring: the pipelined kernel in chunked form
// (kda_ring), the default for K-first pools with a ring (docs/architecture.md, "The replay
// ring"). Compiled in the same module as kda_decode.cu, after it (its helpers, the plan and the
// ring layout are shared).
//
// Math. With the state S0 of the slot unchanged in shared memory, the tokens t = 0..ntok-1 of
// an item (the pending ring entries, then the new tokens) unroll to (G_t = prod_{m<=t} d_m,
// R_{j,t} = prod_{m=j+1..t} d_m, per key row; d the decay exp(g)):
//   u_t = beta_t (v_t - (k_t o G_t)^T S0 - sum_{j<t} A_tj u_j),  A_tj = sum_r k_t R_{j,t} k_j
//   o_t = (q_t o G_t)^T S0 + sum_{j<=t} B_tj u_j,                 B_tj = sum_r q_t R_{j,t} k_j
//   S_end = diag(G_{pend-1}) S0 + sum_{j<pend} (k_j o R_{j,pend-1}) u_j^T      (a commit)
// so one pass over S0 computes every projection at once (no chain of reductions and rank-1
// updates per token), and the state is written only when the ring commits. Products of decays
// only (never a quotient), so a decay that underflows cannot make a 0/0. The results equal
// kda_step's up to the order of f32 operations (fp32 pools within 1e-5, not bit for bit).
//
// Work split. Items (sequence, value head, block of RCW columns: one 128-byte row of the tile)
// are looped over by persistent CTAs of RT threads, two stages: the next item's token rows
// (ring entries and new inputs), dt_bias and state tile are copied into shared memory with
// cp.async while the current one computes. Thread 0 looks the items up ahead (slot, then ring
// record and accepted count one iteration later), so no copy waits on a dependent load. In the
// projection pass a thread owns two adjacent columns of one segment of K rows; the segments'
// partial sums are added in shared memory.
//
// Ring data. Without a commit an item appends its own part of the new tokens' entries (rows
// beyond the pending entries, which no item reads). A commit overwrites entries 0.., which the
// other items of the slot may still read, so the CTA that finishes the slot's last item (the
// `arrive` counter) copies the whole slot's new entries, and writes the new record, one item
// later (its atomic's result is not waited for in the item that issues it).
#include "kda_decode.cu"

namespace kda {

constexpr int RT = 128;                                // threads of a kda_ring CTA
constexpr int RCW = sizeof(ST) == 4 ? 32 : 64;         // columns of an item: a 128-byte tile row
constexpr int RPAIRS = RCW / 2;                        // a thread owns two adjacent columns
constexpr int RSEGS = RT / RPAIRS;                     // segments of K rows (4 or 8)
constexpr int RPS = K / RSEGS;                         // rows per segment (host: K % (4 RSEGS) == 0)
constexpr int MTC = 16;                                // most tokens of an item (host checks)
constexpr int RK = round16(K * (int)sizeof(IT));       // bytes of a raw K row in a stage
constexpr int RTILE = K * RCW * (int)sizeof(ST);       // bytes of the tile in a stage

// Byte offsets in dynamic shared memory (mirrored by `ring_plan` in backend.rs). A stage: the
// tile [K][RCW], then per token t at RTILE + t tokb its raw k, g ([K] each) and v ([RCW]), the
// raw q of new token t at qrow + (t - pend) RK, then dt_bias (f32 [K]). After the two stages,
// f32 arrays: ka, da [mt][KS] and qa [mq][KS] (activated keys and decays of every token,
// queries of the new ones; the projection pass reuses them for its partial sums
// [RSEGS][pmax][RCW]), proj [pmax][KS] (pmax a multiple of 4, zero rows past an item's
// projections), kr [mt][KS], gend [KS], us [mt][RCW], the pair sums A [MTC][MTC] and B
// [mq][MTC], their warp partials [MTC][MTC][2] and [mq][MTC][2], beta [MTC], raw beta [2][MTC]
// (per stage), a_log [2] (per stage).
struct RingLayout {
    int tokb, qrow, bias, stage, x, proj, kr, gend, us, a, b, pa, pb, sbeta, braw, alog, bytes;
    __device__ __forceinline__ RingLayout(int mt, int mq, int pmax) {
        tokb = 2 * RK + round16(RCW * (int)sizeof(IT));
        qrow = RTILE + mt * tokb;
        bias = qrow + mq * RK;
        stage = bias + round16(K * 4);
        x = 2 * stage;
        const int xf = cmax((2 * mt + mq) * KS, RSEGS * pmax * RCW);
        proj = x + 4 * xf;
        kr = proj + 4 * pmax * KS;
        gend = kr + 4 * mt * KS;
        us = gend + 4 * KS;
        a = us + 4 * mt * RCW;
        b = a + 4 * MTC * MTC;
        pa = b + 4 * mq * MTC;
        pb = pa + 4 * MTC * MTC * 2;
        sbeta = pb + 4 * mq * MTC * 2;
        braw = sbeta + 4 * MTC;
        alog = braw + 4 * 2 * MTC;
        bytes = alog + 16;
    }
};

// One work item: sequence n (slot, first token, new tokens), value head, first column, plan.
struct RingItem {
    kda_u32 n, slot, bos, nnew;
    int hv, cb;
    Plan pl;
};

__device__ __forceinline__ kda_u32 ring_seq(const KdaParams& p, kda_u32 item) { return item / (p.hv * p.vblocks); }

__device__ __forceinline__ void ring_coords(const KdaParams& p, kda_u32 item, RingItem& it) {
    const kda_u32 rem = item % (p.hv * p.vblocks);
    it.n = ring_seq(p, item);
    it.hv = (int)(rem / p.vblocks);
    it.cb = (int)(rem % p.vblocks) * RCW;
}

// An item with its loads waited for here (thread 0 only: the plan may record errors).
__device__ __forceinline__ RingItem ring_lookup(const KdaParams& p, kda_u32 item) {
    RingItem it;
    ring_coords(p, item, it);
    const kda_u32* bounds = reinterpret_cast<const kda_u32*>(p.bounds);
    it.slot = reinterpret_cast<const kda_u32*>(p.slots)[it.n];
    it.bos = bounds[it.n];
    it.nnew = bounds[it.n + 1] - it.bos;
    it.pl = make_plan(p, it.n, it.slot, it.nnew, reinterpret_cast<const kda_u32*>(p.meta) + (size_t)it.slot * 4,
                      reinterpret_cast<kda_u32*>(p.err), it.hv == 0 && it.cb == 0);
    return it;
}

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
}
#else
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
#endif

// The lanes of a warp copy `bytes` (a multiple of gran) from src to dst, gran bytes at a time.
__device__ __forceinline__ void copy_row(unsigned char* dst, const void* src, int bytes, int gran, int lane) {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    if (gran == 16) {
        for (int j = 16 * lane; j < bytes; j += 16 * 32) cp_async16(dst + j, s + j);
    } else if (gran == 8) {
        for (int j = 8 * lane; j < bytes; j += 8 * 32) cp_async8(dst + j, s + j);
    } else {
        for (int j = 4 * lane; j < bytes; j += 4 * 32) cp_async4(dst + j, s + j);
    }
}

__device__ __forceinline__ size_t ring_entry_elems(const KdaParams& p) {
    return (size_t)p.h * K + (size_t)p.hv * V + (size_t)p.hv * K + p.hv;
}

// Issues the copies of one item into a stage as two cp.async groups (token rows and dt_bias,
// then the tile). Returns, loaded now and used when the item is computed, the raw beta of
// token threadIdx.x (< ntok) and, in thread RT - 1, a_log.
__device__ __forceinline__ void ring_issue(unsigned char* st, const RingLayout& L, const KdaParams& p,
                                           const RingItem& it, float& braw, float& alog) {
    const kda_u32 ntok = it.pl.pend + it.nnew;
    braw = 0.0f;
    alog = 0.0f;
    if (it.nnew == 0 && it.pl.store_after == KDA_NONE) {
        cp_async_commit();
        cp_async_commit();
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = it.hv / (int)(p.hv / p.h);
    const int cwv = cmin(RCW, V - it.cb);
    const size_t entry = ring_entry_elems(p);
    const size_t ok = (size_t)h * K, ov = (size_t)p.h * K + (size_t)it.hv * V + it.cb,
                 og = (size_t)p.h * K + (size_t)p.hv * V + (size_t)it.hv * K,
                 ob = (size_t)p.h * K + (size_t)p.hv * V + (size_t)p.hv * K + it.hv;
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)it.slot * p.ring_len * entry;
    for (int ri = warp; ri < (int)ntok * 4; ri += RT / 32) {
        const int t = ri >> 2, part = ri & 3;
        const IT* src;
        if ((kda_u32)t < it.pl.pend) {
            if (part == 0) continue; // ring entries hold no query
            const IT* e = ring + (size_t)t * entry;
            src = part == 1 ? e + ok : part == 2 ? e + og : e + ov;
        } else {
            const size_t tok = it.bos + ((kda_u32)t - it.pl.pend);
            src = part == 0   ? reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K
                  : part == 1 ? reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K
                  : part == 2 ? reinterpret_cast<const IT*>(p.g) + (tok * p.hv + it.hv) * K
                              : reinterpret_cast<const IT*>(p.v) + (tok * p.hv + it.hv) * V + it.cb;
        }
        const int bytes = (part == 3 ? cwv : K) * (int)sizeof(IT);
        unsigned char* dst = part == 0 ? st + L.qrow + (t - (int)it.pl.pend) * RK
                                       : st + RTILE + t * L.tokb + (part - 1) * RK;
        copy_row(dst, src, bytes, (int)p.ring_gran, lane);
    }
    if (p.gate_mode != 0u) {
        const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)it.hv * K;
        for (int j = (int)threadIdx.x; j < K / 4; j += RT) cp_async16(st + L.bias + 16 * j, bias + 4 * j);
    }
    cp_async_commit();
    // the tile: K rows of cwv columns (whole 16-byte chunks), unswizzled; a thread copies chunk o
    // of rows row0 + m RSTEP, unrolled with 32-bit shared offsets
    const ST* head = reinterpret_cast<const ST*>(p.ssm) + ((size_t)it.slot * p.hv + it.hv) * ((size_t)K * V) + it.cb;
    constexpr int CPR = RCW * (int)sizeof(ST) / 16; // 8 chunks per tile row
    constexpr int RSTEP = RT / CPR;
    constexpr int NRP = (K + RSTEP - 1) / RSTEP;
    const int o = (int)threadIdx.x % CPR, row0 = (int)threadIdx.x / CPR;
    if (o < cwv * (int)sizeof(ST) / 16) {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(head + (size_t)row0 * V) + 16 * o;
        const SmemAt dst(st);
        const kda_u32 off0 = (kda_u32)(row0 * (RCW * (int)sizeof(ST)) + 16 * o);
#pragma unroll
        for (int m = 0; m < NRP; ++m) {
            if (K % RSTEP == 0 || row0 + m * RSTEP < K)
                cp_async16_at(dst, off0 + (kda_u32)(m * RSTEP * RCW * (int)sizeof(ST)),
                              src + (size_t)m * RSTEP * V * sizeof(ST));
        }
    }
    cp_async_commit();
    if (threadIdx.x < ntok) {
        const kda_u32 t = threadIdx.x;
        const IT* b = t < it.pl.pend ? ring + (size_t)t * entry + ob
                                     : reinterpret_cast<const IT*>(p.beta) + (size_t)(it.bos + t - it.pl.pend) * p.hv + it.hv;
        braw = kda_load(*b);
    }
    if (threadIdx.x == RT - 1 && p.gate_mode != 0u) alog = reinterpret_cast<const float*>(p.a_log)[it.hv];
}

// The partial projections of 4 per-row vectors (proj [4][KS]) on the thread's two columns over
// its segment of rows, into red [RSEGS][P][RCW] at vector offset p0 (P: the vectors in red).
__device__ __forceinline__ void ring_project4(const ST* tile, const float* proj, int pair, int seg, float* red,
                                              int P, int p0) {
    constexpr int Q = 4;
    float y[Q][2];
#pragma unroll
    for (int t = 0; t < Q; ++t) y[t][0] = y[t][1] = 0.0f;
    const int r0 = seg * RPS;
#pragma unroll 2
    for (int r = r0; r < r0 + RPS; r += 4) {
        float s[4][2];
#pragma unroll
        for (int i = 0; i < 4; ++i) kda_load_vec<ST, 2>(tile + (r + i) * RCW + 2 * pair, s[i]);
#pragma unroll
        for (int t = 0; t < Q; ++t) {
            const float4 w = *reinterpret_cast<const float4*>(proj + t * KS + r);
            y[t][0] = fmaf(w.x, s[0][0], y[t][0]);
            y[t][1] = fmaf(w.x, s[0][1], y[t][1]);
            y[t][0] = fmaf(w.y, s[1][0], y[t][0]);
            y[t][1] = fmaf(w.y, s[1][1], y[t][1]);
            y[t][0] = fmaf(w.z, s[2][0], y[t][0]);
            y[t][1] = fmaf(w.z, s[2][1], y[t][1]);
            y[t][0] = fmaf(w.w, s[3][0], y[t][0]);
            y[t][1] = fmaf(w.w, s[3][1], y[t][1]);
        }
    }
#pragma unroll
    for (int t = 0; t < Q; ++t)
        *reinterpret_cast<float2*>(red + (seg * P + p0 + t) * RCW + 2 * pair) = make_float2(y[t][0], y[t][1]);
}

// A commit's new ring entries 0..nnew of a whole slot, from the call's inputs (every thread of
// the CTA; the ring entry is laid out like one token's k, v, g, beta rows of all heads).
__device__ __forceinline__ void ring_commit_copy(const KdaParams& p, kda_u32 slot, kda_u32 bos, kda_u32 nnew) {
    const size_t entry = ring_entry_elems(p);
    const size_t hk = (size_t)p.h * K, hvv = (size_t)p.hv * V, hvk = (size_t)p.hv * K;
    IT* ring = reinterpret_cast<IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    for (kda_u32 j = 0; j < nnew; ++j) {
        const size_t tok = bos + j;
        IT* e = ring + (size_t)j * entry;
        for (size_t i = threadIdx.x; i < entry; i += RT) {
            IT x;
            if (i < hk) {
                x = reinterpret_cast<const IT*>(p.k)[tok * hk + i];
            } else if (i < hk + hvv) {
                x = reinterpret_cast<const IT*>(p.v)[tok * hvv + (i - hk)];
            } else if (i < hk + hvv + hvk) {
                x = reinterpret_cast<const IT*>(p.g)[tok * hvk + (i - hk - hvv)];
            } else {
                x = reinterpret_cast<const IT*>(p.beta)[tok * p.hv + (i - hk - hvv - hvk)];
            }
            e[i] = x;
        }
    }
}

// What thread 0 remembers of the item whose arrival it has not looked at yet.
struct RingArrival {
    kda_u32 slot, new_len, new_pending, bos, nnew;
    bool copy; // a commit with new tokens: the last item's CTA writes the entries
};

} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::RT, 3) kda_ring(const KdaParams p) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ RingItem s_items[2];
    __shared__ RingItem s_next;
    __shared__ kda_u32 s_copy[3]; // slot, bos, nnew of entries this CTA must write (KDA_NONE: none)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RingLayout L((int)p.ring_mt, (int)p.ring_mq, (int)p.ring_pmax);
    const int mt = (int)p.ring_mt;
    float* ka = reinterpret_cast<float*>(dsm + L.x);
    float* da = ka + mt * KS;
    float* qa = da + mt * KS; // [mq][KS]: new token t at row t - pend
    float* red = ka; // the projection pass's partial sums, once ka/da/qa are dead
    float* proj = reinterpret_cast<float*>(dsm + L.proj);
    float* kr = reinterpret_cast<float*>(dsm + L.kr);
    float* gend = reinterpret_cast<float*>(dsm + L.gend);
    float* us = reinterpret_cast<float*>(dsm + L.us);
    float* A = reinterpret_cast<float*>(dsm + L.a);
    float* B = reinterpret_cast<float*>(dsm + L.b);
    float* PA = reinterpret_cast<float*>(dsm + L.pa);
    float* PB = reinterpret_cast<float*>(dsm + L.pb);
    float* sbeta = reinterpret_cast<float*>(dsm + L.sbeta);
    float* braw_s = reinterpret_cast<float*>(dsm + L.braw);
    float* alog_s = reinterpret_cast<float*>(dsm + L.alog);

    const kda_u32 per_seq = p.hv * p.vblocks;
    const kda_u32 total = p.n_seqs * per_seq;
    const kda_u32 grid = gridDim.x;
    kda_u32* err = reinterpret_cast<kda_u32*>(p.err);
    kda_u32* metas = reinterpret_cast<kda_u32*>(p.meta);
    const kda_u32* slots = reinterpret_cast<const kda_u32*>(p.slots);
    const kda_u32* bounds = reinterpret_cast<const kda_u32*>(p.bounds);
    const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;
    const int group = (int)(p.hv / p.h);
    const size_t entry = ring_entry_elems(p);

    kda_u32 item = blockIdx.x;
    if (item >= total) return;
    // Prologue (thread 0): the first two items, and the slot of the third.
    kda_u32 la_slot = 0; // thread 0: the slot of the item after the next one to issue
    if (threadIdx.x == 0) {
        s_items[0] = ring_lookup(p, item);
        if (item + grid < total) s_next = ring_lookup(p, item + grid);
        if (item + 2 * grid < total) la_slot = slots[ring_seq(p, item + 2 * grid)];
        s_copy[0] = KDA_NONE;
    }
    __syncthreads();
    float braw_next, alog_next;
    ring_issue(dsm, L, p, s_items[0], braw_next, alog_next);
    kda_u32 issued = item + grid;

    RingArrival prev{};
    bool have_prev = false;
    kda_u32 prev_old = 0;

    for (int i = 0; item < total; item += grid, ++i) {
        const int stage = i & 1;
        unsigned char* st = dsm + stage * L.stage;
        // this item's raw betas and a_log (loaded when it was issued)
        if ((int)threadIdx.x < MTC) braw_s[stage * MTC + threadIdx.x] = braw_next;
        if (threadIdx.x == RT - 1) alog_s[stage] = alog_next;
        cp_async_wait<1>(); // this item's token rows (its tile may still be in flight)
        __syncthreads();
        // entries of a committed slot this CTA arrived last on (published by thread 0)
        if (s_copy[0] != KDA_NONE) ring_commit_copy(p, s_copy[0], s_copy[1], s_copy[2]);
        const RingItem me = s_items[stage];

        // issue the next item; thread 0 starts the loads of the one after it (its slot is known)
        kda_u32 m_len = 0, m_pend = 0, m_acc = 0, m_b0 = 0, m_b1 = 0, z_slot = 0;
        if (issued < total) {
            const RingItem nx = s_next;
            ring_issue(dsm + (stage ^ 1) * L.stage, L, p, nx, braw_next, alog_next);
            if (threadIdx.x == 0) s_items[stage ^ 1] = nx;
            issued += grid;
            if (threadIdx.x == 0 && issued < total) {
                const kda_u32 n = ring_seq(p, issued);
                const volatile kda_u32* vm = metas + (size_t)la_slot * 4;
                m_len = vm[0];
                m_pend = vm[1];
                m_acc = p.accepted ? reinterpret_cast<const kda_u32*>(p.accepted)[n] : 0u;
                m_b0 = bounds[n];
                m_b1 = bounds[n + 1];
                if (issued + grid < total) z_slot = slots[ring_seq(p, issued + grid)];
            }
        } else {
            cp_async_commit();
            cp_async_commit();
        }

        const kda_u32 pend = me.pl.pend, nnew = me.nnew;
        const int ntok = (int)(pend + nnew);
        const bool store = me.pl.store_after != KDA_NONE;
        const int cwv = cmin(RCW, V - me.cb);
        const unsigned char* tokrow = st + RTILE;
        if (nnew > 0 || store) {
            // 1) activations: one warp per token (key, query of new tokens, decays, beta)
            const float a_exp = p.gate_mode ? expf(alog_s[stage]) : 0.0f;
            const float* bias = reinterpret_cast<const float*>(st + L.bias);
            for (int t = warp; t < ntok; t += RT / 32) {
                const unsigned char* row = tokrow + t * L.tokb;
                act_row(reinterpret_cast<const IT*>(row), ka + t * KS, p.l2norm != 0u, false, p.scale, lane);
                if (t >= (int)pend)
                    act_row(reinterpret_cast<const IT*>(st + L.qrow + (t - (int)pend) * RK), qa + (t - (int)pend) * KS,
                            p.l2norm != 0u, true, p.scale, lane);
                act_decay(reinterpret_cast<const IT*>(row + RK), bias, da + t * KS, p, a_exp, lane);
                for (int kk = K + lane; kk < KS; kk += 32) {
                    ka[t * KS + kk] = 0.0f;
                    if (t >= (int)pend) qa[(t - (int)pend) * KS + kk] = 0.0f;
                    da[t * KS + kk] = 1.0f;
                }
                if (lane == 0) sbeta[t] = act_beta(braw_s[stage * MTC + t], p);
            }
            cp_async_wait<2>(); // this item's tile
            __syncthreads();

            // 2) factors. Per key row: the projections k_t o G_t (every token) and q_t o G_t (new
            // tokens), and for a commit G_{pend-1} and k_j o R_{j,pend-1}.
            const int P = ntok + (int)nnew, P4 = (P + 3) & ~3;
            for (int r = (int)threadIdx.x; r < KS; r += RT) {
                float G = 1.0f;
                if (pend == 0) gend[r] = 1.0f;
                for (int t = 0; t < ntok; ++t) {
                    G *= da[t * KS + r];
                    proj[t * KS + r] = ka[t * KS + r] * G;
                    if (t >= (int)pend) proj[(ntok + t - (int)pend) * KS + r] = qa[(t - (int)pend) * KS + r] * G;
                    if (t + 1 == (int)pend) gend[r] = G;
                }
                for (int q = P; q < P4; ++q) proj[q * KS + r] = 0.0f;
                if (store) {
                    float R = 1.0f;
                    for (int j = (int)pend - 1; j >= 0; --j) {
                        kr[j * KS + r] = ka[j * KS + r] * R;
                        R *= da[j * KS + r];
                    }
                }
            }
            // The pair sums A_tj (j < t) and B_tj (j <= t, new t): one warp per token t, the
            // running product R_{j,t} of the lane's rows from j = t down; each pair reduced over 16
            // lanes here (2 partials to shared memory), the partials added in the next phase.
            for (int t = warp; t < ntok; t += RT / 32) {
                const bool fresh = t >= (int)pend;
                float kt[KL], qt[KL], rr[KL];
#pragma unroll
                for (int m = 0; m < KL; ++m) {
                    const int r = lane + 32 * m;
                    kt[m] = r < K ? ka[t * KS + r] : 0.0f;
                    qt[m] = (fresh && r < K) ? qa[(t - (int)pend) * KS + r] : 0.0f;
                    rr[m] = 1.0f;
                }
                for (int j = t; j >= 0; --j) {
                    float a = 0.0f, b = 0.0f;
#pragma unroll
                    for (int m = 0; m < KL; ++m) {
                        const int r = lane + 32 * m;
                        if (r < K) {
                            const float kj = ka[j * KS + r] * rr[m];
                            a = fmaf(kt[m], kj, a);
                            b = fmaf(qt[m], kj, b);
                            rr[m] *= da[j * KS + r];
                        }
                    }
#pragma unroll
                    for (int ofs = 16; ofs >= 2; ofs >>= 1) {
                        a += KDA_SHFL_XOR(a, ofs);
                        if (fresh) b += KDA_SHFL_XOR(b, ofs);
                    }
                    if (lane < 2) {
                        if (j < t) PA[(t * MTC + j) * 2 + lane] = a;
                        if (fresh) PB[((t - (int)pend) * MTC + j) * 2 + lane] = b;
                    }
                }
            }
            __syncthreads();

            // 3) the pair sums from their partials, and one pass over the tile per 4 projections
            for (int e = (int)threadIdx.x; e < ntok * MTC; e += RT) {
                const int t = e / MTC, j = e % MTC;
                if (j < t) {
                    const float2 x = *reinterpret_cast<const float2*>(PA + 2 * e);
                    A[e] = x.x + x.y;
                }
                if (t >= (int)pend && j <= t) {
                    const int eb = (t - (int)pend) * MTC + j;
                    const float2 x = *reinterpret_cast<const float2*>(PB + 2 * eb);
                    B[eb] = x.x + x.y;
                }
            }
            const int pair = (int)threadIdx.x % RPAIRS, seg = (int)threadIdx.x / RPAIRS;
            const ST* tile = reinterpret_cast<const ST*>(st);
            for (int q = 0; q < P4; q += 4) ring_project4(tile, proj + q * KS, pair, seg, red, P4, q);
            __syncthreads();

            // 4) per column, in token order: u_t, and the output of each new token
            if ((int)threadIdx.x < cwv) {
                const int c = (int)threadIdx.x;
                for (int t = 0; t < ntok; ++t) {
                    float y = 0.0f;
#pragma unroll
                    for (int sg = 0; sg < RSEGS; ++sg) y += red[(sg * P4 + t) * RCW + c];
                    const IT* vrow = reinterpret_cast<const IT*>(tokrow + t * L.tokb + 2 * RK);
                    float x = kda_load(vrow[c]) - y;
                    for (int j = 0; j < t; ++j) x = fmaf(-A[t * MTC + j], us[j * RCW + c], x);
                    const float u = sbeta[t] * x;
                    us[t * RCW + c] = u;
                    if (t >= (int)pend) {
                        float o = 0.0f;
#pragma unroll
                        for (int sg = 0; sg < RSEGS; ++sg) o += red[(sg * P4 + ntok + t - (int)pend) * RCW + c];
                        const float* bt = B + (t - (int)pend) * MTC;
                        for (int j = 0; j <= t; ++j) o = fmaf(bt[j], us[j * RCW + c], o);
                        const size_t tok = me.bos + ((kda_u32)t - pend);
                        reinterpret_cast<IT*>(p.out)[(tok * p.hv + me.hv) * V + me.cb + c] = KdaElem<IT>::from_f32(o);
                    }
                }
            }

            if (store) {
                // 5) commit: S_end = diag(G_{pend-1}) S0 + sum_j (k_j o R_{j,pend-1}) u_j^T, stored
                // once (two adjacent columns per thread, a warp covers whole 128-byte rows)
                __syncthreads();
                const int c0 = 2 * pair;
                if (c0 < cwv) {
                    ST* head = reinterpret_cast<ST*>(p.ssm) + ((size_t)me.slot * p.hv + me.hv) * ((size_t)K * V);
                    const kda_u32 elem0 = (kda_u32)me.hv * (kda_u32)(K * V);
                    const kda_u32 base = p.sr ? kda_sr_base(seed, p.layer, me.slot, p.epoch) : 0u;
                    for (int r = seg * RPS; r < seg * RPS + RPS; ++r) {
                        float s2[2];
                        kda_load_vec<ST, 2>(tile + r * RCW + c0, s2);
                        const float gr = gend[r];
                        float x0 = gr * s2[0], x1 = gr * s2[1];
                        for (int j = 0; j < (int)pend; ++j) {
                            const float kv = kr[j * KS + r];
                            const float2 uv = *reinterpret_cast<const float2*>(us + j * RCW + c0);
                            x0 = fmaf(kv, uv.x, x0);
                            x1 = fmaf(kv, uv.y, x1);
                        }
                        const kda_u32 el = elem0 + (kda_u32)(r * V + me.cb + c0);
                        ST v2[2];
                        if (p.sr) {
                            v2[0] = round_elem<true>(x0, base, el);
                            v2[1] = round_elem<true>(x1, base, el + 1);
                        } else {
                            v2[0] = round_elem<false>(x0, base, el);
                            v2[1] = round_elem<false>(x1, base, el + 1);
                        }
                        kda_store_vec<ST, 2>(head + (size_t)r * V + me.cb + c0, v2);
                    }
                }
            } else if (me.pl.append_at != KDA_NONE && nnew > 0) {
                // 6) no commit: this item's part of the new entries (rows past the pending
                // entries: no item of this call reads them)
                IT* ring = reinterpret_cast<IT*>(p.ring) + (size_t)me.slot * p.ring_len * entry;
                const int h = me.hv / group;
                const size_t ok = (size_t)h * K, ov = (size_t)p.h * K + (size_t)me.hv * V + me.cb,
                             og = (size_t)p.h * K + (size_t)p.hv * V + (size_t)me.hv * K,
                             ob = (size_t)p.h * K + (size_t)p.hv * V + (size_t)p.hv * K + me.hv;
                for (kda_u32 j = 0; j < nnew; ++j) {
                    const int t = (int)(pend + j);
                    const unsigned char* row = tokrow + t * L.tokb;
                    IT* e = ring + (size_t)(me.pl.append_at + j) * entry;
                    if (me.cb == 0) {
                        const IT* rk = reinterpret_cast<const IT*>(row);
                        const IT* rg = reinterpret_cast<const IT*>(row + RK);
                        for (int x = (int)threadIdx.x; x < K; x += RT) {
                            if (me.hv % group == 0) e[ok + x] = rk[x];
                            e[og + x] = rg[x];
                        }
                        if (threadIdx.x == 0) e[ob] = KdaElem<IT>::from_f32(braw_s[stage * MTC + t]);
                    }
                    const IT* rv = reinterpret_cast<const IT*>(row + 2 * RK);
                    for (int x = (int)threadIdx.x; x < cwv; x += RT) e[ov + x] = rv[x];
                }
            }
        }

        // every thread has read s_next and s_copy (an item with work has passed barriers since)
        if (!(nnew > 0 || store)) __syncthreads();
        // 7) arrival (thread 0): look at the previous item's, then arrive for this one
        if (threadIdx.x == 0) {
            s_copy[0] = KDA_NONE;
            if (have_prev && prev_old == per_seq - 1) {
                kda_u32* m = metas + (size_t)prev.slot * 4;
                m[0] = prev.new_len;
                m[1] = prev.new_pending;
                m[2] = 0u;
                if (prev.copy) {
                    s_copy[0] = prev.slot;
                    s_copy[1] = prev.bos;
                    s_copy[2] = prev.nnew;
                }
            }
            // No fence: this item's reads of the record and of the ring entries are complete (their
            // values were used above), which is all the last item's writes must come after.
            prev_old = atomicAdd(metas + (size_t)me.slot * 4 + 2, 1u);
            have_prev = true;
            prev.slot = me.slot;
            prev.new_len = me.pl.new_len;
            prev.new_pending = me.pl.new_pending;
            prev.bos = me.bos;
            prev.nnew = nnew;
            prev.copy = store && me.pl.append_at != KDA_NONE && nnew > 0;
            // the next item to issue, now that its record has arrived
            if (issued < total) {
                RingItem nx;
                ring_coords(p, issued, nx);
                nx.slot = la_slot;
                nx.bos = m_b0;
                nx.nnew = m_b1 - m_b0;
                nx.pl = plan_from(p, la_slot, nx.nnew, m_len, m_pend, m_acc, err, nx.hv == 0 && nx.cb == 0);
                s_next = nx;
                la_slot = z_slot;
            }
        }
    }
    cp_async_wait<0>();
    // the last publication, then the last arrival
    __syncthreads();
    if (s_copy[0] != KDA_NONE) ring_commit_copy(p, s_copy[0], s_copy[1], s_copy[2]);
    __syncthreads();
    if (threadIdx.x == 0) {
        s_copy[0] = KDA_NONE;
        if (have_prev && prev_old == per_seq - 1) {
            kda_u32* m = metas + (size_t)prev.slot * 4;
            m[0] = prev.new_len;
            m[1] = prev.new_pending;
            m[2] = 0u;
            if (prev.copy) {
                s_copy[0] = prev.slot;
                s_copy[1] = prev.bos;
                s_copy[2] = prev.nnew;
            }
        }
    }
    __syncthreads();
    if (s_copy[0] != KDA_NONE) ring_commit_copy(p, s_copy[0], s_copy[1], s_copy[2]);
}
