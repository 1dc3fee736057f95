// Ring decode and spec_verify over stored delta vectors by persistent CTAs whose warps each have
// one role (kda_ring_delta_pipe): kda_ring_delta's arithmetic (the tile read, never written
// but at a commit; each computed token two products with it and its pair sums with the tokens
// before it) on kda_eager_bulk_pipe's pipeline. Items are whole value heads (sequence, hv: the
// host plans it only where an item is one head, K = 128, nearest rounding, sm_90); item t of a
// CTA (blockIdx.x + t gridDim.x) goes to buffer t % p.stages and step group t % G:
// - two loader warps (alternate items) each read the slots, sequence bounds, ring records,
//   accepted counts and a_logs of their next 32 items at once (one round trip for 32 items,
//   where kda_ring_delta's CTA waits for its own record) and plan them, then fill each item's
//   buffer: the tile, the new tokens' rows, dt_bias and the pending entries' stored vectors by
//   bulk copies, the pending entries' key and gate rows (values too where a vector is missing)
//   by cp.async (ring rows are only p.ring_gran aligned), the raw betas and the plan by plain
//   stores; all of it completes on the buffer's `full` barrier;
// - the step groups (8 warps each, their own named barrier): arrive on the slot's counter (the
//   item's ring reads are done once its buffer is full), activate, compute the tokens whose
//   vectors are missing (without outputs) and the new ones, append or, at a commit, fold the
//   pending entries into the tile in shared memory (rounded once, to nearest) and settle the
//   slot's record as kda_ring_delta does; then mark the buffer `computed`;
// - the storer warp bulk-stores a folded tile and marks the buffer `empty`.
// Arithmetic: kda_ring_delta's formulas, with the decay products formed where they are used
// (the pair sums form R_tj from the decays; P_t per computed token) and, after a commit, the
// new tokens' products with the folded tile as stored (rounded) rather than its f32 values.
// Pending entries without stored vectors (another kernel appended them) get theirs computed
// the same way, in the frame of the committed tile, and stored, so the next call finds them.
// Measured slower than kda_ring_delta in every benchmarked row on the H200 (ring decode
// 1.2-1.7x, spec_verify 1.6-3.1x its time; docs/performance.md, thirty-third session): an
// experiment, run only when forced.
#include "kda_ring_delta.cu"

namespace kda {

// Scalar words of a buffer (u32, from DPipeBuffer::scal): the item's slot, first token, new
// tokens, plan (pend, store_after, append_at, new_len, new_pending), the pending entries with
// stored vectors, a_log's bits, whether the storer writes the tile, then the raw betas of the
// combined tokens (input bits).
enum : int {
    DP_SLOT,
    DP_BOS,
    DP_NNEW,
    DP_PEND,
    DP_STORE,
    DP_APPEND,
    DP_LEN,
    DP_PENDING,
    DP_HAVE,
    DP_ALOG,
    DP_WRITE,
    DP_BRAW = 16,
    DP_WORDS = DP_BRAW + MTC
};

// One buffer (bytes from its 128-byte aligned start; mirrored by `delta_pipe_plan` in
// backend.rs): the bulk tile of a whole head (PipeBuffer's), the raw rows as RingTileLayout
// lays them out up to its f32 arrays (L.ka bytes: mt token rows, mq query rows, dt_bias), the
// delta vectors [mt][RCW] (f32, by combined token), the scalar words.
struct DPipeBuffer {
    int raw, ua, scal, bytes;
    __device__ __forceinline__ DPipeBuffer(const RingTileLayout& L, int mt) {
        raw = roundup((K * V + (VFIRST ? 0 : LK * WC)) * (int)sizeof(ST), 16);
        ua = raw + L.ka;
        scal = ua + 4 * mt * RCW;
        bytes = roundup(scal + 4 * DP_WORDS, 128);
    }
};

// A step group's f32 arrays (bytes from its start; mirrored by `delta_pipe_plan`): activated
// keys and decays [mt][KS], queries [mq][KS], values [mt][RCW], P_t k_t [mt][KS], P_t q_t
// [mq][KS], a commit's R k rows [mt][KS] and P [KS], the pair sums c [mt][mt] and e [mq][mt],
// q . k [mq], the betas [mt], one word of flags.
struct DPipeScratch {
    int ka, da, qa, va, kp, qp, ek, pm, c, e, qk, beta, misc, bytes;
    __device__ __forceinline__ DPipeScratch(int mt, int mq) {
        ka = 0;
        da = ka + 4 * mt * KS;
        qa = da + 4 * mt * KS;
        va = qa + 4 * mq * KS;
        kp = va + 4 * mt * RCW;
        qp = kp + 4 * mt * KS;
        ek = qp + 4 * mq * KS;
        pm = ek + 4 * mt * KS;
        c = pm + 4 * KS;
        e = c + round16(4 * mt * mt);
        qk = e + round16(4 * mq * mt);
        beta = qk + round16(4 * mq);
        misc = beta + round16(4 * mt);
        bytes = misc + 16;
    }
};

// Loader warps per CTA: loader l fills the buffers of the CTA's items t = l, l + 2, ... (the
// host's buffer counts are even, so each buffer has one loader).
constexpr int DPIPE_LOADERS = 2;
constexpr int DPIPE_THREADS = (PIPE_MAX_GROUPS * PIPE_WARPS + DPIPE_LOADERS + 1) * 32;

#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// This thread's cp.async copies so far arrive on `bar` once they complete (the barrier's
// pending count goes up now and down then, so it expects no more arrivals than before).
__device__ __forceinline__ void cp_async_bar_arrive(kda_u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// The products of the lane's pieces of a bulk tile with two rows of per-row values a and b
// (padded K rows in shared memory), summed over its rows: TV columns each, not reduced over
// the column group.
__device__ __forceinline__ void stream_products(const ST* tile, int lk, int col0, const float* a, const float* b,
                                                float (&sa)[TV], float (&sb)[TV]) {
#pragma unroll
    for (int c = 0; c < TV; ++c) sa[c] = sb[c] = 0.0f;
    for_each_piece(tile, lk, col0, V, [&](int i, const TilePiece& t, float (&x)[PE]) {
#pragma unroll
        for (int e = 0; e < PE; ++e) {
            const int r = piece_row(t, e), c = piece_c(i, e);
            sa[c] = fmaf(a[r], x[e], sa[c]);
            sb[c] = fmaf(b[r], x[e], sb[c]);
        }
    });
}

// A commit's fold of the lane's pieces of a bulk tile: x = P[r] x + sum_{j<n} E_j[r] u_j[c]
// (E_j rows of KS, u_j rows of RCW from the lane's first column), rounded to nearest in place.
__device__ __forceinline__ void stream_fold(ST* tile, int lk, int col0, const float* pm, const float* ek,
                                            const float* uc, int n) {
    for_each_piece(tile, lk, col0, V, [&](int i, const TilePiece& t, float (&x)[PE]) {
#pragma unroll
        for (int e = 0; e < PE; ++e) x[e] *= pm[piece_row(t, e)];
        for (int j = 0; j < n; ++j) {
#pragma unroll
            for (int e = 0; e < PE; ++e)
                x[e] = fmaf(ek[j * KS + piece_row(t, e)], uc[j * RCW + piece_c(i, e)], x[e]);
        }
        piece_store<false>(tile, t, x, col0, 0u, 0u);
    });
}

// A loader warp: plans its items, 32 at a time, and fills their buffers in order.
__device__ __forceinline__ void dpipe_load(const KdaParams& p, unsigned char* dsm, const RingTileLayout& L,
                                           const DPipeBuffer& B, kda_u64* full, kda_u64* empty, kda_u32 total,
                                           int nb, int loader, int lane) {
    const kda_u32 step = gridDim.x, stride = DPIPE_LOADERS;
    const size_t entry = ring_entry_elems(p);
    const int gran = (int)p.ring_gran, mq = (int)p.ring_mq;
    const bool gated = p.gate_mode != 0u;
    const kda_u32* bounds = reinterpret_cast<const kda_u32*>(p.bounds);
    // the CTA's items: blockIdx.x + t step for t < items
    const kda_u32 items = blockIdx.x < total ? (total - blockIdx.x + step - 1) / step : 0u;
    for (kda_u32 tb = (kda_u32)loader; tb < items; tb += 32u * stride) {
        // the records of items t = tb + l stride, lane l
        const kda_u32 mine = blockIdx.x + (tb + (kda_u32)lane * stride) * step;
        kda_u32 slot = 0u, bos = 0u, nnew = 0u, cached = 0u, alog = 0u;
        Plan pl{0u, KDA_NONE, KDA_NONE, 0u, 0u};
        if (mine < total) {
            const kda_u32 n = kda_div(mine, p.div_seq), hv = mine - n * p.hv;
            slot = reinterpret_cast<const kda_u32*>(p.slots)[n];
            bos = bounds[n];
            nnew = bounds[n + 1] - bos;
            const volatile kda_u32* vm = reinterpret_cast<const kda_u32*>(p.meta) + (size_t)slot * 4;
            const kda_u32 len = vm[0], pending = vm[1];
            cached = vm[3];
            const kda_u32 acc = p.accepted ? reinterpret_cast<const kda_u32*>(p.accepted)[n] : 0u;
            if (gated) alog = reinterpret_cast<const kda_u32*>(p.a_log)[hv];
            pl = plan_from(p, slot, nnew, len, pending, acc, reinterpret_cast<kda_u32*>(p.err), hv == 0u);
        }
        const kda_u32 cnt = cmin(32, (int)((items - tb + stride - 1) / stride));
        for (kda_u32 i = 0; i < cnt; ++i) {
            const int src = (int)i;
            const kda_u32 s = KDA_SHFL(slot, src), b0 = KDA_SHFL(bos, src), nn = KDA_SHFL(nnew, src);
            const kda_u32 pd = KDA_SHFL(pl.pend, src), sa = KDA_SHFL(pl.store_after, src);
            const kda_u32 ap = KDA_SHFL(pl.append_at, src), nl = KDA_SHFL(pl.new_len, src);
            const kda_u32 np = KDA_SHFL(pl.new_pending, src), hc = KDA_SHFL(cached, src);
            const kda_u32 al = KDA_SHFL(alog, src);
            const kda_u32 t = tb + i * stride, item = blockIdx.x + t * step;
            const int bi = (int)(t % (kda_u32)nb);
            const kda_u32 round = t / (kda_u32)nb;
            unsigned char* buf = dsm + bi * B.bytes;
            if (round > 0u) mbar_wait(&empty[bi], (round - 1u) & 1u);
            const kda_u32 n = kda_div(item, p.div_seq), hv = item - n * p.hv;
            const size_t h = kda_div(hv, p.div_grp);
            const bool work = nn > 0u || sa != KDA_NONE;
            const kda_u32 have = min(hc, pd);
            const int ntok = (int)(pd + nn);
            kda_u32* sc = reinterpret_cast<kda_u32*>(buf + B.scal);
            if (lane == 0) {
                sc[DP_SLOT] = s;
                sc[DP_BOS] = b0;
                sc[DP_NNEW] = nn;
                sc[DP_PEND] = pd;
                sc[DP_STORE] = sa;
                sc[DP_APPEND] = ap;
                sc[DP_LEN] = nl;
                sc[DP_PENDING] = np;
                sc[DP_HAVE] = have;
                sc[DP_ALOG] = al;
            }
            const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)s * p.ring_len * entry;
            unsigned char* raw = buf + B.raw;
            if (work) {
                // the raw betas of the tokens the item computes (have ..), a lane per token
                if (lane >= (int)have && lane < ntok) {
                    const IT* bp = lane < (int)pd
                                       ? ring + (size_t)lane * entry + ring_off_beta(p, hv)
                                       : reinterpret_cast<const IT*>(p.beta) + (b0 + (size_t)(lane - (int)pd)) * p.hv + hv;
                    sc[DP_BRAW + lane] = input_bits(bp);
                }
                // the pending entries' key and gate rows, and the values of those without vectors
#pragma unroll 1
                for (int e = 0; e < (int)pd; ++e) {
                    const IT* row = ring + (size_t)e * entry;
                    unsigned char* d = raw + (mq + e) * L.tokb;
                    copy_row(d, row + h * K, K * (int)sizeof(IT), gran, lane);
                    copy_row(d + RK, row + ring_off_g(p, hv), K * (int)sizeof(IT), gran, lane);
                    if (e >= (int)have) copy_row(d + 2 * RK, row + ring_off_v(p, hv), V * (int)sizeof(IT), gran, lane);
                }
            }
            cp_async_bar_arrive(&full[bi]);
            KDA_SYNCWARP();
            if (lane == 0) {
                const kda_u32 rows = nn * (kda_u32)(3 * K + V) * sizeof(IT) + (gated ? (kda_u32)K * 4u : 0u);
                bulk_bar_expect(&full[bi], work ? (kda_u32)(K * V) * sizeof(ST) + rows + have * (kda_u32)V * 4u : 0u);
            }
            KDA_SYNCWARP();
            if (!work) continue;
            ST* const head = state_head(p, s, hv);
            ST* const tile = reinterpret_cast<ST*>(buf);
            if constexpr (VFIRST) {
                if (lane == 0) bulk_in(tile, head, (kda_u32)(K * V) * sizeof(ST), &full[bi]);
            } else {
                for (int r = lane * TK; r < K; r += 32 * TK)
                    bulk_in(tile + bulk_row(r, V), head + (size_t)r * V, (kda_u32)(cmin(TK, K - r) * V) * sizeof(ST),
                            &full[bi]);
            }
            // the new tokens' q, k, g, v rows (new token j at row j), a lane per row
            for (int r = lane; r < 4 * (int)nn; r += 32) {
                const int j = r >> 2, part = r & 3;
                const size_t tok = b0 + (size_t)j;
                const kda_u32 kb = (kda_u32)K * sizeof(IT);
                if (part == 0) {
                    bulk_in(raw + L.qrow + j * RK, reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K, kb, &full[bi]);
                } else if (part == 1) {
                    bulk_in(raw + j * L.tokb, reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K, kb, &full[bi]);
                } else if (part == 2) {
                    bulk_in(raw + j * L.tokb + RK, reinterpret_cast<const IT*>(p.g) + (tok * p.hv + hv) * K, kb,
                            &full[bi]);
                } else {
                    bulk_in(raw + j * L.tokb + 2 * RK, reinterpret_cast<const IT*>(p.v) + (tok * p.hv + hv) * V,
                            (kda_u32)V * sizeof(IT), &full[bi]);
                }
            }
            if (lane == 31 && gated)
                bulk_in(raw + L.bias, reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K, (kda_u32)K * 4u,
                        &full[bi]);
            for (int j = lane; j < (int)have; j += 32)
                bulk_in(buf + B.ua + 4 * j * RCW, delta_row(p, s, (kda_u32)j, (int)hv, 0), (kda_u32)V * 4u, &full[bi]);
        }
    }
}

// The storer warp: stores each folded tile to its head, then frees the buffer.
__device__ __forceinline__ void dpipe_store(const KdaParams& p, unsigned char* dsm, const DPipeBuffer& B,
                                            kda_u64* computed, kda_u64* empty, kda_u32 total, int nb, int lane) {
    kda_u32 t = 0;
    for (kda_u32 item = blockIdx.x; item < total; item += gridDim.x, ++t) {
        const int bi = (int)(t % (kda_u32)nb);
        unsigned char* buf = dsm + bi * B.bytes;
        mbar_wait(&computed[bi], (t / (kda_u32)nb) & 1u);
        const kda_u32* sc = reinterpret_cast<const kda_u32*>(buf + B.scal);
        if (sc[DP_WRITE] != 0u) {
            const kda_u32 n = kda_div(item, p.div_seq), hv = item - n * p.hv;
            ST* const head = state_head(p, sc[DP_SLOT], hv);
            const ST* const tile = reinterpret_cast<const ST*>(buf);
            if constexpr (VFIRST) {
                if (lane == 0) bulk_out(head, tile, (kda_u32)(K * V) * sizeof(ST));
            } else {
                for (int r = lane * TK; r < K; r += 32 * TK)
                    bulk_out(head + (size_t)r * V, tile + bulk_row(r, V),
                             (kda_u32)(cmin(TK, K - r) * V) * sizeof(ST));
            }
            bulk_out_done();
        }
        KDA_SYNCWARP();
        if (lane == 0) mbar_arrive(&empty[bi]);
    }
}

// What a step group's thread knows of its item while it computes tokens.
struct DPipeWork {
    float *ka, *da, *qa, *va, *kp, *qp, *c, *e, *qk, *beta, *ua;
    const ST* bl;
    int pend, mt, lk, col0l, bcol, tid, warp, lane, hv;
    kda_u32 slot, bos;
};

// Tokens from .. to - 1 of an item in the frame of the tile whose state is that before token
// `base` (kda_ring_delta's formulas): P_t k_t (and P_t q_t) a thread per (token, k), the pair
// sums c_tj (e_tj, q_t . k_t) a warp per pair, then each token in order: its two products with
// the tile, its vector (kept in ua, and stored from entry `dst0` for token `from` on when dst0
// is not KDA_NONE) and, with OUT, its output. New tokens are at pend .. (OUT); the others have
// no query.
template <bool OUT>
__device__ __forceinline__ void dpipe_tokens(const KdaParams& p, const DPipeWork& w, int from, int to, int base,
                                             kda_u32 dst0, int group) {
    const int n = to - from, mt = w.mt;
    for (int x = w.tid; x < n * KS; x += RT) {
        const int i = x / KS, k = x - i * KS, t = from + i;
        float r = 0.0f;
        if (k < K) {
            r = w.da[t * KS + k];
            for (int m = t - 1; m >= base; --m) r *= w.da[m * KS + k];
        }
        w.kp[t * KS + k] = r * w.ka[t * KS + k];
        if (OUT) w.qp[(t - w.pend) * KS + k] = r * w.qa[(t - w.pend) * KS + k];
    }
    const int span = to - base;
    for (int x = w.warp; x < n * span; x += RT / 32) {
        const int i = x / span, j = base + (x - i * span), t = from + i;
        if (j > t || (!OUT && j == t)) continue;
        const float* kt = w.ka + t * KS;
        const float* qt = OUT ? w.qa + (t - w.pend) * KS : kt;
        const float* kj = w.ka + j * KS;
        float pc = 0.0f, pe = 0.0f;
        for (int k = w.lane; k < K; k += 32) {
            float r = kj[k];
            for (int m = t; m > j; --m) r *= w.da[m * KS + k];
            pc = fmaf(kt[k], r, pc);
            pe = fmaf(qt[k], r, pe);
        }
        pc = warp_sum(pc);
        if (OUT) pe = warp_sum(pe);
        if (w.lane == 0) {
            if (j < t) {
                w.c[t * mt + j] = pc;
                if (OUT) w.e[(t - w.pend) * mt + j] = pe;
            } else {
                w.qk[t - w.pend] = pe;
            }
        }
    }
    pipe_step_sync(group);
    // lane lk of a column group ends with one sum (scatter_sums): k S of column lk (lk < 4) or
    // q S of column lk - 4, and steps that column alone
    const int mc = w.lk & 3, col = w.col0l + mc;
    const bool isq = w.lk >= 4, valid = col < V;
    for (int t = from; t < to; ++t) {
        float ak[TV], aq[TV];
        stream_products(w.bl, w.lk, w.bcol, w.kp + t * KS, OUT ? w.qp + (t - w.pend) * KS : w.kp + t * KS, ak, aq);
        float a = scatter_sums(ak, aq, w.lk);
        const float* cj = (OUT && isq) ? w.e + (t - w.pend) * mt : w.c + t * mt;
        for (int j = base; j < t; ++j) a = fmaf(cj[j], w.ua[j * RCW + col], a);
        const float u = w.beta[t] * ((valid ? w.va[t * RCW + col] : 0.0f) - a);
        // the q lanes take the vector of their column from the k lanes
        const float uq = KDA_SHFL_XOR(u, 4 * LV);
        if (!isq) {
            w.ua[t * RCW + col] = u;
            if (valid && dst0 != KDA_NONE) delta_row(p, w.slot, dst0 + (kda_u32)(t - from), w.hv, col)[0] = u;
        } else if (OUT && valid) {
            reinterpret_cast<IT*>(p.out)[((w.bos + (size_t)(t - w.pend)) * p.hv + w.hv) * V + col] =
                KdaElem<IT>::from_f32(fmaf(w.qk[t - w.pend], uq, a));
        }
        // every lane of a column group reads the vectors its k lanes wrote
        __syncwarp();
    }
}

// The step groups: each item's activations, tokens, append or fold, and its slot's record.
__device__ __forceinline__ void dpipe_step(const KdaParams& p, unsigned char* dsm, const RingTileLayout& L,
                                           const DPipeBuffer& B, unsigned char* scratch, kda_u64* full,
                                           kda_u64* computed, kda_u32 total, int nb, int groups, int gw, int lane) {
    const int group = gw / PIPE_WARPS, warp = gw % PIPE_WARPS;
    const int mt = (int)p.ring_mt, mq = (int)p.ring_mq;
    const DPipeScratch X(mt, mq);
    DPipeWork w;
    w.ka = reinterpret_cast<float*>(scratch + X.ka);
    w.da = reinterpret_cast<float*>(scratch + X.da);
    w.qa = reinterpret_cast<float*>(scratch + X.qa);
    w.va = reinterpret_cast<float*>(scratch + X.va);
    w.kp = reinterpret_cast<float*>(scratch + X.kp);
    w.qp = reinterpret_cast<float*>(scratch + X.qp);
    w.c = reinterpret_cast<float*>(scratch + X.c);
    w.e = reinterpret_cast<float*>(scratch + X.e);
    w.qk = reinterpret_cast<float*>(scratch + X.qk);
    w.beta = reinterpret_cast<float*>(scratch + X.beta);
    float* const ek = reinterpret_cast<float*>(scratch + X.ek);
    float* const pm = reinterpret_cast<float*>(scratch + X.pm);
    kda_u32* const misc = reinterpret_cast<kda_u32*>(scratch + X.misc);
    const TileRows rows(w.ka, w.da, w.qa, w.va);
    w.mt = mt;
    w.lane = lane;
    w.warp = warp;
    w.tid = warp * 32 + lane;
    w.lk = lane / LV;
    w.col0l = warp * WC + (lane % LV) * TV;
    w.bcol = w.col0l < V ? w.col0l : V;
    const kda_u32 tid = (kda_u32)w.tid;
    const size_t entry = ring_entry_elems(p);
    const int gran = (int)p.ring_gran, vgroup = (int)(p.hv / p.h);
    kda_u32 t = (kda_u32)group;
    for (kda_u32 item = blockIdx.x + t * gridDim.x; item < total;
         item += (kda_u32)groups * gridDim.x, t += (kda_u32)groups) {
        const int bi = (int)(t % (kda_u32)nb);
        unsigned char* buf = dsm + bi * B.bytes;
        mbar_wait(&full[bi], (t / (kda_u32)nb) & 1u);
        kda_u32* sc = reinterpret_cast<kda_u32*>(buf + B.scal);
        const kda_u32 n = kda_div(item, p.div_seq), hv = item - n * p.hv;
        const kda_u32 slot = sc[DP_SLOT], bos = sc[DP_BOS], nnew = sc[DP_NNEW], append_at = sc[DP_APPEND];
        const int pend = (int)sc[DP_PEND], have = (int)sc[DP_HAVE], ntok = pend + (int)nnew;
        const bool store = sc[DP_STORE] != KDA_NONE, work = nnew > 0u || store;
        kda_u32* meta = reinterpret_cast<kda_u32*>(p.meta) + (size_t)slot * 4;
        // the item's ring reads are done: its buffer is full
        kda_u32 old = 0u;
        if (tid == 0u) old = atomicAdd(meta + 2, 1u);
        bool write = false;
        if (work) {
            unsigned char* raw = buf + B.raw;
            w.ua = reinterpret_cast<float*>(buf + B.ua);
            w.bl = reinterpret_cast<const ST*>(buf) + (VFIRST ? 0 : w.lk * WC);
            w.pend = pend;
            w.hv = (int)hv;
            w.slot = slot;
            w.bos = bos;
            const float a_exp = p.gate_mode ? expf(__uint_as_float(sc[DP_ALOG])) : 0.0f;
            tile_activate<true, sizeof(ST) == 2>(raw, L, rows, p, pend, ntok, (int)nnew, mq, V, a_exp, warp, lane, have,
                                                 tid);
            if (w.tid >= have && w.tid < ntok) w.beta[w.tid] = act_beta(input_from_bits(sc[DP_BRAW + w.tid]), p);
            pipe_step_sync(group);
            // the pending entries without stored vectors, in the committed tile's frame (their
            // vectors stored unless a commit restarts the ring)
            if (have < pend) dpipe_tokens<false>(p, w, have, pend, 0, store ? KDA_NONE : (kda_u32)have, group);
            if (store && pend > 0) {
                // the commit: diag(P) S + sum_j (R k_j) u_j^T, rounded once, into the tile
                for (int k = w.tid; k < KS; k += RT) {
                    float r = 1.0f;
                    if (k < K) {
                        for (int j = pend - 1; j >= 0; --j) {
                            ek[j * KS + k] = r * w.ka[j * KS + k];
                            r *= w.da[j * KS + k];
                        }
                    }
                    pm[k] = r;
                }
                pipe_step_sync(group);
                stream_fold(const_cast<ST*>(w.bl), w.lk, w.bcol, pm, ek, w.ua + w.col0l, pend);
                write = true;
            }
            dpipe_tokens<true>(p, w, pend, ntok, store ? pend : 0, append_at, group);
            if (!store && append_at != KDA_NONE && nnew > 0u)
                tile_append(raw, L, p, slot, append_at, bos, nnew, (int)kda_div(hv, p.div_grp), (int)hv, vgroup, 0, V,
                            gran, entry, tid);
        }
        if (write) bulk_fence();
        // every warp of the group is done with the buffer and the arrays
        pipe_step_sync(group);
        if (tid == 0u) {
            const bool last = old == p.hv - 1u;
            if (last) {
                meta[0] = sc[DP_LEN];
                meta[1] = sc[DP_PENDING];
                meta[2] = 0u;
                // every entry the ring keeps has its vector when the item worked; else those it had
                meta[3] = work ? sc[DP_LEN] : (kda_u32)have;
            }
            misc[0] = last && store && append_at != KDA_NONE && nnew > 0u;
            sc[DP_WRITE] = write;
            mbar_arrive(&computed[bi]);
        }
        pipe_step_sync(group);
        if (misc[0] != 0u) ring_commit_copy(p, slot, bos, nnew, tid);
    }
}
#endif

} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::DPIPE_THREADS, 1) kda_ring_delta_pipe(const KdaParams p) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using namespace kda;
    if constexpr (SCATTER) {
        extern __shared__ __align__(16) unsigned char ring_pipe_dsm[];
        __shared__ kda_u64 full[PIPE_MAX_BUFFERS], computed[PIPE_MAX_BUFFERS], empty[PIPE_MAX_BUFFERS];
        unsigned char* const dsm =
            ring_pipe_dsm + ((PIPE_ALIGN - (smem_addr(ring_pipe_dsm) & (PIPE_ALIGN - 1))) & (PIPE_ALIGN - 1));
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int groups = ((int)(blockDim.x >> 5) - DPIPE_LOADERS - 1) / PIPE_WARPS;
        const int nb = cmin((int)p.stages, PIPE_MAX_BUFFERS);
        const kda_u32 total = p.n_seqs * p.hv;
        const RingTileLayout L((int)p.ring_mt, (int)p.ring_mq);
        const DPipeBuffer B(L, (int)p.ring_mt);
        if (threadIdx.x < (unsigned)nb) {
            bulk_bar_init(&full[threadIdx.x]);
            bulk_bar_init(&computed[threadIdx.x]);
            bulk_bar_init(&empty[threadIdx.x]);
        }
        __syncthreads();
        KDA_DEPENDENT_LAUNCH();
        if (warp >= groups * PIPE_WARPS && warp < groups * PIPE_WARPS + DPIPE_LOADERS) {
            dpipe_load(p, dsm, L, B, full, empty, total, nb, warp - groups * PIPE_WARPS, lane);
        } else if (warp == groups * PIPE_WARPS + DPIPE_LOADERS) {
            dpipe_store(p, dsm, B, computed, empty, total, nb, lane);
        } else {
            const int group = warp / PIPE_WARPS;
            unsigned char* scratch =
                dsm + nb * B.bytes + group * DPipeScratch((int)p.ring_mt, (int)p.ring_mq).bytes;
            dpipe_step(p, dsm, L, B, scratch, full, computed, total, nb, groups, warp, lane);
        }
    }
#endif
}
