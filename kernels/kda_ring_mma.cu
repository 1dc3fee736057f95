// Decode, spec_verify and replay over the replay ring on the tensor cores (kda_ring_mma): an item
// is kda_ring_tile's (sequence, value head, 128 columns: a whole head at K = V = 128), one per
// CTA, and its token rows are copied and activated as there; what differs is how the item's
// tokens (its pending entries, then its new tokens) meet the state. kda_ring_tile steps the
// state tile token by token on the CUDA cores (four multiply-adds per element and token); here
// the tokens are one chunk in the chunked (WY) form of the delta rule, and the products with the
// tile run as tf32 mma.sync with the f32 operands split in two (3xTF32: a = a_hi + a_lo,
// a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, about 2^-21 relative), so the state is read from
// shared memory once for all the tokens and written once at a commit. Only K = 128 and whole
// 128-column items (the host checks; other shapes compile to an empty kernel).
//
// The chunk, tokens t = 0 .. L-1 (L = pending + new), decays d_t (per row k), S_{-1} the tile:
//   S_t = diag(d_t) S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - (diag(d_t) S_{t-1})^T k_t),
//   o_f = S_t^T q_f for new token f at t = pend + f.
// With P_t = d_0 ... d_t and R_tj = d_{j+1} ... d_t (R_tt = 1; every factor a product of
// decays, never a quotient, so nothing overflows where the recurrence does not):
//   (diag(d_t) S_{t-1})^T k_t = S^T (P_t k_t) + sum_{j<t} A_tj u_j,  A_tj = sum_k k_t R_tj k_j,
//   o_f = S^T (P_t q_f) + sum_{j<=t} B_fj u_j,                       B_fj = sum_k q_f R_tj k_j,
//   S_{m-1} = diag(P_{m-1}) S + sum_{j<m} (R_{m-1,j} k_j) u_j^T      (m = pend: a commit's store).
// Steps: (1) the rows P_t k_t and P_t q_f times the tile (mma, one 16-row tile of rows or two);
// (2) A and B on the CUDA cores (a warp per source token j, its lanes over k, the decay products
// R_tj as running products); (3) the u_t by forward substitution and the outputs, a thread per
// column; (4) at a commit, the stored state as diag(P) S plus (R k)^T U (mma), rounded to
// nearest once. The f32 arithmetic differs from kda_step's order, so the bits do too: the state
// agrees to about 1e-6 relative (an fp32 pool) or to one rounding step (2-byte pools).
//
// Where it runs (`ring_choice` in ring_plan.rs; docs/performance.md, twenty-third session): by
// default for spec_verify calls of four or more drafts on 2-byte pools from 384 items, where with
// three CTAs per SM (80 registers: MMA_CTAS) it measured 6-15% faster than the kernels chosen
// before. Elsewhere only when forced (`RingKernel::Mma`): 12-33% slower than kda_ring_tile for
// fp32 pools (two CTAs per SM) and mixed for three drafts; ring decode and replay slower than
// their kernels. An item's 2 to 16 tokens are few for the chunk: its phases (tile in, pair
// products, decay products, mma, substitution, commit) each wait at a CTA barrier, where
// kda_ring_tile's token loop runs without one.
#include "kda_ring.cu"

namespace kda {

// Whether the shape is the one kda_ring_mma computes (K = 128 rows, 128 columns per item).
constexpr bool MMA_FITS = K == 128 && RCW == 128;
constexpr int MW = 128;                         // rows and columns of an item's tile
constexpr int AP = K + 4;                       // f32 pitch of the token rows (conflict-free fragments)
constexpr int TP = MW + 16 / (int)sizeof(ST);   // pitch of the tile in elements (16 bytes of padding)
constexpr int PP = MTC + 1;                     // pitch of the A and B matrices
constexpr int MMA_CTAS = sizeof(ST) == 2 ? 3 : 2; // CTAs per SM the registers allow (launch bounds)

// Byte offsets in dynamic shared memory (mirrored by `ring_plan` in ring_plan.rs): the raw token
// rows as RingTileLayout's (mt rows of tokb bytes, the raw queries, dt_bias), then f32 arrays:
// x [mr][AP] (keys, then the new tokens' queries; then their products with the tile; then the
// u_t), dk [mt][AP] (decays; then at a commit R k), am, bm [MTC][PP], beta [MTC], pm [K] (P at
// the commit), then the tile [MW][TP] of state elements (rows k for K-first, columns for
// V-first). mr = mt + mq (the mma tiles' rows past them read as zeros).
struct MmaLayout {
    int tokb, qrow, bias, x, dk, am, bm, sbeta, pm, tile;
    __device__ __forceinline__ MmaLayout(int mt, int mq) {
        const int mr = mt + mq;
        tokb = 2 * RK + round16(RCW * (int)sizeof(IT));
        qrow = mt * tokb;
        bias = qrow + mq * RK;
        x = bias + round16(K * 4);
        dk = x + 4 * mr * AP;
        am = dk + 4 * mt * AP;
        bm = am + 4 * MTC * PP;
        sbeta = bm + 4 * MTC * PP;
        pm = sbeta + 4 * MTC;
        tile = pm + round16(4 * K); // then MW * TP * sizeof(ST) bytes: the end
    }
};

// An A fragment of the f32 rows at `rows` (pitch AP; rows from `nrows` on are zeros): rows
// r0 + g (+ 8), columns c0 + t (+ 4), split.
__device__ __forceinline__ void frag_a(const float* rows, int nrows, int r0, int c0, int g, int t, kda_u32 (&ah)[4],
                                       kda_u32 (&al)[4]) {
    const float* x = rows + (r0 + g) * AP + c0 + t;
    const bool lo = r0 + g < nrows, hi = r0 + g + 8 < nrows;
    tf32_split(lo ? x[0] : 0.0f, ah[0], al[0]);
    tf32_split(hi ? x[8 * AP] : 0.0f, ah[1], al[1]);
    tf32_split(lo ? x[4] : 0.0f, ah[2], al[2]);
    tf32_split(hi ? x[8 * AP + 4] : 0.0f, ah[3], al[3]);
}

// Element (k, c) of the item's tile in shared memory, as f32.
__device__ __forceinline__ float tile_at(const ST* tile, int k, int c) {
    return kda_load(VFIRST ? tile[c * TP + k] : tile[k * TP + c]);
}

__device__ __forceinline__ float4 ld4(const float* row, int lane) { return reinterpret_cast<const float4*>(row)[lane]; }
__device__ __forceinline__ float4 mul4(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }
__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}

// The pair products of source token j (one warp; lane l holds k = 4 l .. 4 l + 3 of each row):
// A_tj for the later tokens t < ntok into am[t][j], B_fj for the new tokens f at or after j into
// bm[f][j]. Each lane sums its part of up to 32 products (A slots 0-15: t = j + 1 + slot; B
// slots 16-31: f = slot - 16), then the warp reduces them so that lane l ends with slot l.
__device__ __forceinline__ void mma_pairs(const float* x, const float* dk, float* am, float* bm, int j, int ntok,
                                          int pend, int nnew, int lane) {
    const float4 kj = ld4(x + j * AP, lane);
    float part[32];
    float4 r = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
#pragma unroll
    for (int l = 0; l < MTC; ++l) {
        const int t = j + 1 + l;
        part[l] = 0.0f;
        if (t < ntok) {
            r = mul4(r, ld4(dk + t * AP, lane));
            part[l] = dot4(mul4(ld4(x + t * AP, lane), r), kj);
        }
    }
    // the new tokens: R from j to the first of them at or after j, then running on
    const int t0 = j > pend ? j : pend;
    r = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    for (int i = j + 1; i <= t0; ++i) r = mul4(r, ld4(dk + i * AP, lane));
#pragma unroll
    for (int f = 0; f < MTC; ++f) {
        const int t = pend + f;
        part[MTC + f] = 0.0f;
        if (f < nnew && t >= j) {
            if (t > t0) r = mul4(r, ld4(dk + t * AP, lane));
            part[MTC + f] = dot4(mul4(ld4(x + (ntok + f) * AP, lane), r), kj);
        }
    }
    // reduce-scatter: at each level a lane keeps the half of its slots its partner sends away
#pragma unroll
    for (int level = 0; level < 5; ++level) {
        const int m = 16 >> level;
        const bool up = (lane & m) != 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (i < m) {
                const float send = up ? part[i] : part[i + m];
                const float keep = up ? part[i + m] : part[i];
                part[i] = keep + KDA_SHFL_XOR(send, m);
            }
        }
    }
    if (lane < MTC) {
        const int t = j + 1 + lane;
        if (t < ntok) am[t * PP + j] = part[0];
    } else {
        const int f = lane - MTC;
        if (f < nnew && pend + f >= j) bm[f * PP + j] = part[0];
    }
}

// Step (1): rows [0, 16 MT) of x times the tile, columns 16 warp .. 16 warp + 15 (two n8 tiles
// per warp) into c. (MT a template argument: a run-time test per tile was compiled to predicated
// instructions, issued for both tiles; ncu, twenty-third session.)
template <int MT>
__device__ __forceinline__ void mma_rows_tile(const float* x, int nrows, const ST* tile, int warp, int g, int t,
                                              float (&c)[2][2][4]) {
    constexpr bool EXACT = sizeof(ST) == 2;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mi][ni][e] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        kda_u32 bh[2][2], bl[2][2];
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
            const int n = 16 * warp + 8 * ni + g;
            const float b0 = tile_at(tile, k0 + t, n), b1 = tile_at(tile, k0 + t + 4, n);
            if constexpr (EXACT) {
                bh[ni][0] = __float_as_uint(b0);
                bh[ni][1] = __float_as_uint(b1);
                bl[ni][0] = bl[ni][1] = 0u;
            } else {
                tf32_split(b0, bh[ni][0], bl[ni][0]);
                tf32_split(b1, bh[ni][1], bl[ni][1]);
            }
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            kda_u32 ah[4], al[4];
            frag_a(x, nrows, 16 * mi, k0, g, t, ah, al);
#pragma unroll
            for (int ni = 0; ni < 2; ++ni)
                mma_3xtf32<EXACT>(c[mi][ni], ah, al, bh[ni][0], bh[ni][1], bl[ni][0], bl[ni][1]);
        }
    }
}

// Step (4): the state after the pending entries, rows 16 warp .. 16 warp + 15 of the item:
// diag(pm) tile + (R k)^T U over the pend entries (rows of dk and of x), rounded to nearest
// into the tile in place (a warp reads and writes only its own rows k).
__device__ __forceinline__ void mma_commit(const float* x, const float* dk, const float* pm, ST* tile, int pend,
                                           int warp, int g, int t) {
    constexpr int NC = 4; // n8 tiles per pass (registers: three CTAs of a 2-byte pool per SM)
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    const float p0 = pm[r0], p1 = pm[r1];
#pragma unroll 1
    for (int n0 = 0; n0 < MW / 8; n0 += NC) {
        float c[NC][4];
#pragma unroll
        for (int ni = 0; ni < NC; ++ni) {
            const int col = 8 * (n0 + ni) + 2 * t;
            c[ni][0] = p0 * tile_at(tile, r0, col);
            c[ni][1] = p0 * tile_at(tile, r0, col + 1);
            c[ni][2] = p1 * tile_at(tile, r1, col);
            c[ni][3] = p1 * tile_at(tile, r1, col + 1);
        }
        for (int j0 = 0; j0 < pend; j0 += 8) {
            // A = (R k)^T: A[k][j] = dk[j][k]; entries j >= pend are zero
            const int ja = j0 + t, jb = ja + 4;
            kda_u32 ah[4], al[4];
            tf32_split(ja < pend ? dk[ja * AP + r0] : 0.0f, ah[0], al[0]);
            tf32_split(ja < pend ? dk[ja * AP + r1] : 0.0f, ah[1], al[1]);
            tf32_split(jb < pend ? dk[jb * AP + r0] : 0.0f, ah[2], al[2]);
            tf32_split(jb < pend ? dk[jb * AP + r1] : 0.0f, ah[3], al[3]);
#pragma unroll
            for (int ni = 0; ni < NC; ++ni) {
                const int col = 8 * (n0 + ni) + g;
                kda_u32 bh0, bl0, bh1, bl1;
                tf32_split(ja < pend ? x[ja * AP + col] : 0.0f, bh0, bl0);
                tf32_split(jb < pend ? x[jb * AP + col] : 0.0f, bh1, bl1);
                mma_3xtf32<false>(c[ni], ah, al, bh0, bh1, bl0, bl1);
            }
        }
#pragma unroll
        for (int ni = 0; ni < NC; ++ni) {
            const int col = 8 * (n0 + ni) + 2 * t;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int k = e < 2 ? r0 : r1, cc = col + (e & 1);
                tile[VFIRST ? cc * TP + k : k * TP + cc] = KdaElem<ST>::from_f32(c[ni][e]);
            }
        }
    }
}

// The CTA copies the item's tile between shared memory and the pool in 16-byte pieces, a row
// of MW elements per CPR pieces (`in`: pool to tile, asynchronously; else tile to pool).
template <bool IN> __device__ __forceinline__ void tile_copy(ST* tile, ST* head, int cb) {
    constexpr int VEC = 16 / (int)sizeof(ST), CPR = MW / VEC, ROWS = RT / CPR;
#pragma unroll
    for (int it = 0; it < MW / ROWS; ++it) {
        const int r = it * ROWS + (int)threadIdx.x / CPR, part = (int)threadIdx.x % CPR;
        ST* g = (VFIRST ? head + (size_t)(cb + r) * K : head + (size_t)r * V + cb) + part * VEC;
        ST* sm = tile + r * TP + part * VEC;
        if constexpr (IN) {
            cp_async16(sm, g);
        } else {
            *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(sm);
        }
    }
}

} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::RT, kda::MMA_CTAS) kda_ring_mma(const KdaParams p) {
    using namespace kda;
    if (padding_cta(p)) return;
    if constexpr (MMA_FITS) {
        extern __shared__ __align__(16) unsigned char dsm[];
        __shared__ Plan s_plan;
        __shared__ float s_aexp;
        __shared__ kda_u32 s_last;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int g = lane >> 2, tq = lane & 3;
        TileItem it = tile_item_begin<true, MMA_CTAS>(p);
        // the tile is copied in once the plan is known (below), from L2
        if (p.early == 0u) prefetch_tile(state_head(p, it.slot, it.hv), it.cb, it.cwv);
        const MmaLayout L((int)p.ring_mt, (int)p.ring_mq);
        const int mq = (int)p.ring_mq;
        // the plan's loads, the new tokens' rows, then the plan (as kda_ring_tile)
        const TilePlanLoads pl0 = tile_plan_loads(p, it);
        const kda_u32 per_seq = it.per_seq, slot = it.slot, bos = it.bos, nnew = it.nnew;
        const int hv = it.hv, cb = it.cb, cwv = it.cwv, h = it.h, group = it.group;
        kda_u32* meta = it.meta;
        ST* head = state_head(p, slot, (size_t)hv);
        ST* tile = reinterpret_cast<ST*>(dsm + L.tile);
        const int gran = (int)p.ring_gran;
        tile_new_rows(dsm, L, p, bos, nnew, h, hv, cb, cwv, gran);
        cp_async_commit();
        tile_plan_finish(p, it, pl0, s_plan, s_aexp);
        __syncthreads();
        const Plan pl = s_plan;
        const int pend = (int)pl.pend, ntok = pend + (int)nnew;
        const bool store = pl.store_after == (kda_u32)pend && pend > 0;
        const bool commit = pl.store_after != KDA_NONE;
        const bool work = nnew > 0 || commit;
        const size_t entry = ring_entry_elems(p);
        const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
        // the pending entries' rows; then the tile, the last copy group, waited for only where
        // the mma needs it
        if (work) {
            tile_pending_rows(dsm, L, p, ring, entry, pend, ntok, mq, bos, h, hv, cb, cwv, gran);
            tile_copy<true>(tile, head, cb);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const kda_u32 old = tile_arrive(meta);
        if (work) {
            float* x = reinterpret_cast<float*>(dsm + L.x);
            float* dk = reinterpret_cast<float*>(dsm + L.dk);
            float* am = reinterpret_cast<float*>(dsm + L.am);
            float* bm = reinterpret_cast<float*>(dsm + L.bm);
            float* pm = reinterpret_cast<float*>(dsm + L.pm);
            const float* sbeta = reinterpret_cast<const float*>(dsm + L.sbeta);
            const float* bias = reinterpret_cast<const float*>(dsm + L.bias);
            const float a_exp = s_aexp;
            const int rows = ntok + (int)nnew, mtiles = (rows + 15) >> 4;
            auto raw = [&](int t) { return dsm + (t < pend ? mq + t : t - pend) * L.tokb; };
            // activations: keys at rows t of x, the new tokens' queries after them, a warp per
            // row; decays over all threads
            for (int u = warp; u < rows; u += RT / 32) {
                const bool key = u < ntok;
                const unsigned char* src = key ? raw(u) : dsm + L.qrow + (u - ntok) * RK;
                act_row(reinterpret_cast<const IT*>(src), x + u * AP, p.l2norm != 0u, !key, p.scale, lane);
            }
            for (int i = (int)threadIdx.x; i < ntok * K; i += RT) {
                const int t = i / K, kk = i - t * K;
                dk[t * AP + kk] = decay_of(reinterpret_cast<const IT*>(raw(t) + RK), bias, kk, p, a_exp);
            }
            __syncthreads();
            // (2) the pair products
            for (int j = warp; j < ntok; j += RT / 32) mma_pairs(x, dk, am, bm, j, ntok, pend, (int)nnew, lane);
            __syncthreads();
            // the decays into the rows, a thread per k: keys and queries times P_t; at a commit R k
            // over the pending entries into dk and P_{pend-1} into pm
            if ((int)threadIdx.x < K) {
                const int k = (int)threadIdx.x;
                float dv[MTC], kv[MTC];
#pragma unroll
                for (int t = 0; t < MTC; ++t) {
                    dv[t] = t < ntok ? dk[t * AP + k] : 1.0f;
                    kv[t] = t < ntok ? x[t * AP + k] : 0.0f;
                }
                if (store) {
                    float r = 1.0f;
#pragma unroll
                    for (int j = MTC - 1; j >= 0; --j) {
                        if (j < pend) {
                            dk[j * AP + k] = kv[j] * r;
                            r *= dv[j];
                        }
                    }
                    pm[k] = r;
                }
                float pt = 1.0f;
#pragma unroll
                for (int t = 0; t < MTC; ++t) {
                    if (t < ntok) {
                        pt *= dv[t];
                        x[t * AP + k] = kv[t] * pt;
                        if (t >= pend) x[(ntok + t - pend) * AP + k] *= pt;
                    }
                }
            }
            cp_async_wait<0>();
            __syncthreads();
            // (1) the rows times the tile; the products replace the rows
            {
                float c[2][2][4];
                if (mtiles == 1)
                    mma_rows_tile<1>(x, rows, tile, warp, g, tq, c);
                else
                    mma_rows_tile<2>(x, rows, tile, warp, g, tq, c);
                __syncthreads();
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                    for (int ni = 0; ni < 2; ++ni) {
                        float* w = x + (16 * mi + g) * AP + 16 * warp + 8 * ni + 2 * tq;
                        if (16 * mi + g < rows) *reinterpret_cast<float2*>(w) = make_float2(c[mi][ni][0], c[mi][ni][1]);
                        if (16 * mi + g + 8 < rows)
                            *reinterpret_cast<float2*>(w + 8 * AP) = make_float2(c[mi][ni][2], c[mi][ni][3]);
                    }
                }
            }
            __syncthreads();
            // (3) a thread per column: the u_t (into x's rows t), the new tokens' outputs
            if ((int)threadIdx.x < MW) {
                const int cc = (int)threadIdx.x;
                float u[MTC];
#pragma unroll
                for (int t = 0; t < MTC; ++t) {
                    u[t] = 0.0f;
                    if (t < ntok) {
                        float acc = x[t * AP + cc];
#pragma unroll
                        for (int j = 0; j < t; ++j) acc = fmaf(am[t * PP + j], u[j], acc);
                        const float vv = kda_load(reinterpret_cast<const IT*>(raw(t) + 2 * RK)[cc]);
                        u[t] = sbeta[t] * (vv - acc);
                        x[t * AP + cc] = u[t];
                    }
                }
#pragma unroll
                for (int f = 0; f < MTC; ++f) {
                    if (f < (int)nnew) {
                        float o = x[(ntok + f) * AP + cc];
#pragma unroll
                        for (int j = 0; j < MTC; ++j)
                            if (j <= pend + f) o = fmaf(bm[f * PP + j], u[j], o);
                        IT* op = reinterpret_cast<IT*>(p.out) + ((bos + (size_t)f) * p.hv + hv) * V + cb + cc;
                        *op = KdaElem<IT>::from_f32(o);
                    }
                }
            }
            // (4) a commit's store (with a ring the plan stores after the pending entries or not
            // at all; with none pending the state is unchanged)
            if (store) {
                __syncthreads();
                mma_commit(x, dk, pm, tile, pend, warp, g, tq);
                __syncthreads();
                tile_copy<false>(tile, head, cb);
            }
            if (!commit && pl.append_at != KDA_NONE && nnew > 0)
                tile_append(dsm, L, p, slot, pl.append_at, bos, nnew, h, hv, group, cb, cwv, gran, entry);
        }
        tile_settle(p, pl, old, per_seq, commit, meta, slot, bos, nnew, s_last);
    }
}
