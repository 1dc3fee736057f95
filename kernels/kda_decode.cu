// KDA decode, spec_verify and replay over the replay ring (docs/architecture.md, "The replay
// ring"; spec section 2 for the token step), and prefill token by token (KDA_OP_PREFILL: the
// pending entries folded, every token of the sequence stepped in order, the state stored once
// at the end and the ring left empty, as the CPU backend's chunked prefill does up to the f32
// arithmetic's order). One kernel for every operation, kda_step,
// templated through macros on the state element (KDA_ST), the input/ring/output element
// (KDA_IT), the layout (KDA_VFIRST) and the head dims (KDA_K, KDA_V); f32 arithmetic with f32
// accumulation. Eager decode can also run kda_eager / kda_eager_stage (the pipelined kernel
// further down) or kda_eager_tile and its variants _staged, _bulk and _bulk_in (one item per
// CTA, at the end of this file), which step tokens through the same functions.
//
// Work split. A CTA handles one sequence and one "unit" of heads, and a block of value columns:
// - eager decode (ring_len == 0): a unit is one value head and the CTAs of a head split V;
// - with a ring: a unit is one q/k head with its whole GVA group of value heads and all V
//   columns, so a CTA owns every ring datum it reads and writes (k of its q/k head, v, g and
//   beta of its value heads) and the commit path, which overwrites entries 0..T, cannot race
//   with another CTA still reading them as pending entries.
// Inside a CTA each warp owns LV x TV value columns over all K rows: lane (lk, lv) holds TK rows
// x TV columns of the f32 state in registers, so the K reductions of a token stay inside the
// warp (butterfly shuffles, every lane ends with the same bits). The same lane mapping serves
// eager decode and the ring, so an fp32 pool gives the same bits on either path.
//
// Ring bookkeeping (hazard: every CTA of a slot reads the slot's RingMeta first). Thread 0 of
// each CTA reads it at the start; the new len/pending are written only by the CTA that arrives
// last on the `arrive` counter (atomicAdd after its own reads), which then resets it to 0.
//
// Device-side checks. Accepted counts and the ring records live in device memory. The
// synchronous backend methods validate them on the host first; the enqueue path does not, so
// the kernel clamps `accepted` to the slot's drafts, drops the drafts of a slot that decode
// finds with drafts, and records such violations in the error word (err[0] flags, err[1] the
// first slot), which the backend checks on request.
#include "kda_common.cuh"

#ifndef KDA_ST
#define KDA_ST float
#endif
#ifndef KDA_IT
#define KDA_IT float
#endif
#ifndef KDA_K
#define KDA_K 128
#endif
#ifndef KDA_V
#define KDA_V 128
#endif
#ifndef KDA_VFIRST
#define KDA_VFIRST 0
#endif
// 1: the module of padded batches (Backend::prepare_padded), whose kernels read p.live; 0: of
// plain batches, which then pay nothing for it (live_seqs, call_epoch, padding_cta below).
#ifndef KDA_PADDED
#define KDA_PADDED 0
#endif

// A divisor's constants for kda_div.
struct KdaDiv {
    kda_u32 m, s;
};

// Must match crates/kda-kernels/src/cuda/params.rs field for field.
struct KdaParams {
    kda_u64 q, k, v, g, beta;        // [T,H,K] [T,H,K] [T,HV,V] [T,HV,K] [T,HV] of KDA_IT
    kda_u64 a_log, dt_bias;          // f32 [HV], [HV*K]; 0 when the gate is activated
    kda_u64 out;                     // [T,HV,V] of KDA_IT
    kda_u64 ssm, ring, meta;         // the layer's planes
    kda_u64 delta;                   // f32 [slot][ring_len][HV][V]: the ring entries' delta vectors
    kda_u64 bounds, slots, accepted; // u32 [N+1], u32 [N], u32 [N] (0: none)
    kda_u64 err;                     // u32 [4]: flags, first bad slot, any store, spare
    kda_u32 n_seqs, h, hv, ring_len;
    kda_u32 op;                      // KDA_OP_*
    kda_u32 gate_mode;               // 0 activated, 1 softplus, 2 lower bound
    kda_u32 beta_sigmoid, l2norm;
    float scale, lower_bound, beta_factor;
    kda_u32 sr;                      // 1: stochastic rounding of state stores
    kda_u32 seed_lo, seed_hi, layer, epoch;
    kda_u32 heads_per_cta;           // value heads per CTA (GVA group with a ring, else 1)
    kda_u32 units;                   // CTA units per sequence (H with a ring, else HV)
    kda_u32 vblocks;                 // CTAs per unit along V (1 with a ring)
    kda_u32 stages;                  // kda_eager: pipeline stages (2 or 3)
    kda_u32 ring_mt;                 // kda_ring: token rows per stage (ring_len + most new tokens)
    kda_u32 early;                   // 1: a dependent launch; prefetch the first tiles before the wait
    kda_u32 ring_gran;               // kda_ring: bytes per cp.async of token rows (4, 8 or 16)
    kda_u32 ring_mq;                 // kda_ring: most new tokens of a sequence
    KdaDiv div_seq;                  // by units * vblocks (CTA units or items per sequence)
    KdaDiv div_vb;                   // by vblocks
    KdaDiv div_grp;                  // by the GVA group hv / h
    // Last, so that the other fields keep their offsets (and a plain module its SASS).
    kda_u64 live;                    // u32 [2]: sequences computed (the first ones), epoch offset (KDA_PADDED)
};

// n / d for a divisor d fixed per launch: m, s from the host (`FastDiv` in params.rs), so an
// item's coordinates cost a multiply-high, an add and a shift instead of a division routine.
__device__ __forceinline__ kda_u32 kda_div(kda_u32 n, KdaDiv d) {
    return (kda_u32)(((kda_u64)__umulhi(n, d.m) + n) >> d.s);
}

#define KDA_OP_DECODE 0u
#define KDA_OP_SPEC 1u
#define KDA_OP_REPLAY 2u
#define KDA_OP_PREFILL 3u // kda_step only: the pending entries folded, then every token, one store
#define KDA_ERR_ACCEPTED 1u      // accepted > drafts: clamped
#define KDA_ERR_DECODE_DRAFTS 2u // decode on a slot with drafts: drafts dropped
#define KDA_ERR_META 4u          // corrupt ring record: clamped
#define KDA_NONE 0xffffffffu

namespace kda {

typedef KDA_ST ST;
typedef KDA_IT IT;
constexpr int K = KDA_K;
constexpr int V = KDA_V;
constexpr bool VFIRST = KDA_VFIRST != 0;

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int pow2ceil(int x) { return x <= 1 ? 1 : 2 * pow2ceil((x + 1) / 2); }
__host__ __device__ constexpr int roundup(int x, int m) { return (x + m - 1) / m * m; }

// Lanes along K (a power of two) and along V; TK rows x TV columns per lane.
constexpr int LK = cmin(32, pow2ceil((K + 15) / 16));
constexpr int LV = 32 / LK;
constexpr int TV = 4;
constexpr int SV = 16 / (int)sizeof(ST); // elements of one 16-byte vector
// Rows of a lane come in groups of RG consecutive rows: group j of lane lk starts at row
// (j * LK + lk) * RG. V-first loads one 16-byte vector per group (RG = SV); K-first keeps a
// lane's rows contiguous (one group) and loads TV consecutive columns per row.
constexpr int RG_VF = (K % SV == 0) ? SV : 1;
constexpr int TK = VFIRST ? roundup((K + LK - 1) / LK, RG_VF) : (K + LK - 1) / LK;
constexpr int RG = VFIRST ? RG_VF : TK;
constexpr int NG = TK / RG;
constexpr bool KF_VEC = (V % TV == 0); // K-first: TV columns as one vector
constexpr int KS = roundup(LK * TK, 4); // smem row stride of per-row values (padded K)
// Rows of per-row values that token_step_stream reads per piece (PAD below): K-first, lane
// group lk's piece i is row lk TK + i, read four rows at a time (16-byte loads), so with TK = 16
// (K = 128) the eight groups' vectors lie in the same two bank quarters, a 4-way conflict per
// load; four words of padding per TK rows (row r at r + 4 (r / TK)) put them in eight quarters
// and keep them 16-byte aligned (one word per group broke the vectors: 3-22% slower, fortieth
// session). KP: such a row's length (lane group lk's rows end at lk TK + TK - 1 + 4 lk). The
// bulk pipe's step pads (2-4% faster); the tile kernels' do not (padded, 3% slower: forty-first
// session).
constexpr int KP = VFIRST ? KS : roundup(LK * TK + 4 * LK, 4);
template <bool PAD> __device__ __forceinline__ int krow_at(int r) { return PAD && !VFIRST ? r + 4 * (r / TK) : r; }
constexpr int VS = roundup(V, 4);
constexpr int WC = LV * TV;             // columns of one warp
constexpr int TC = cmax(1, cmin(8, 12288 / (3 * KS + VS))); // tokens per smem chunk
constexpr int KL = (K + 31) / 32;       // per-lane values of a K row in the prepass

__device__ __forceinline__ int row_of(int lk, int r) {
    return ((r / RG) * LK + lk) * RG + (r % RG);
}

// Loads this lane's TK per-row values of a padded K row in shared memory.
__device__ __forceinline__ void rows_from_smem(const float* base, int lk, float (&dst)[TK]) {
#pragma unroll
    for (int j = 0; j < NG; ++j) {
        const float* p = base + (j * LK + lk) * RG;
        if constexpr (RG % 4 == 0) {
#pragma unroll
            for (int m = 0; m < RG / 4; ++m) {
                float4 x = reinterpret_cast<const float4*>(p)[m];
                dst[j * RG + 4 * m + 0] = x.x;
                dst[j * RG + 4 * m + 1] = x.y;
                dst[j * RG + 4 * m + 2] = x.z;
                dst[j * RG + 4 * m + 3] = x.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < RG; ++e) dst[j * RG + e] = p[e];
        }
    }
}

// Sums TV values over the LK lanes of a column group; every lane gets the same bits.
__device__ __forceinline__ void reduce_k(float (&x)[TV]) {
#pragma unroll
    for (int m = LV; m < 32; m <<= 1) {
#pragma unroll
        for (int c = 0; c < TV; ++c) x[c] += KDA_SHFL_XOR(x[c], m);
    }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) x += KDA_SHFL_XOR(x, m);
    return x;
}

// The lane's state tile of one value head: TK rows x TV columns starting at column col0.
// rs: elements from one K-first row to the next (V in the pool; a tile's width in shared memory).
__device__ __forceinline__ void load_tile(const ST* head, int lk, int col0, float (&s)[TK][TV], int rs = V) {
    if constexpr (!VFIRST) {
#pragma unroll
        for (int r = 0; r < TK; ++r) {
            const int kr = row_of(lk, r);
            if constexpr (KF_VEC) {
                float tmp[TV];
                if (kr < K && col0 < V) {
                    kda_load_vec<ST, TV>(head + (size_t)kr * rs + col0, tmp);
                } else {
#pragma unroll
                    for (int c = 0; c < TV; ++c) tmp[c] = 0.0f;
                }
#pragma unroll
                for (int c = 0; c < TV; ++c) s[r][c] = tmp[c];
            } else {
#pragma unroll
                for (int c = 0; c < TV; ++c) {
                    const int col = col0 + c;
                    s[r][c] = (kr < K && col < V) ? kda_load(head[(size_t)kr * rs + col]) : 0.0f;
                }
            }
        }
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c) {
            const int col = col0 + c;
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const int k0 = (j * LK + lk) * RG;
                float tmp[RG];
                if constexpr (RG > 1) {
                    if (col < V && k0 < K) {
                        kda_load_vec<ST, RG>(head + (size_t)col * K + k0, tmp);
                    } else {
#pragma unroll
                        for (int e = 0; e < RG; ++e) tmp[e] = 0.0f;
                    }
                } else {
                    tmp[0] = (col < V && k0 < K) ? kda_load(head[(size_t)col * K + k0]) : 0.0f;
                }
#pragma unroll
                for (int e = 0; e < RG; ++e) s[j * RG + e][c] = tmp[e];
            }
        }
    }
}

// Rounds one element for a store: nearest even, or stochastic with the element's offset
// `elem` in the slot's ssm plane.
// SR is a compile-time choice so the nearest path never evaluates the hash.
template <bool SR>
__device__ __forceinline__ ST round_elem(float x, kda_u32 base, kda_u32 elem) {
    if constexpr (SR) {
        return KdaSr<ST>::round(x, kda_sr_bits(base, elem));
    } else {
        return KdaElem<ST>::from_f32(x);
    }
}

// Stores the lane's tile; `elem0` is the head's offset in the slot's ssm plane (hv * K * V).
// STREAM (K-first 2-byte nearest only): streaming stores (KDA_STORE_STREAM), for kda_ring.
// rs: as in load_tile (the stochastic stream's element offsets keep the pool's rows of V).
template <bool SR, bool STREAM = false>
__device__ __forceinline__ void store_tile(ST* head, int lk, int col0, const float (&s)[TK][TV],
                                           kda_u32 base, kda_u32 elem0, int rs = V) {
    if constexpr (!VFIRST) {
#pragma unroll
        for (int r = 0; r < TK; ++r) {
            const int kr = row_of(lk, r);
            if (kr >= K) continue;
            if constexpr (KF_VEC && !SR && sizeof(ST) == 2 && TV == 4) {
                // two elements per conversion instruction (same bits as one at a time)
                if (col0 >= V) continue;
                const uint2 w = make_uint2(kda_pack2_rn<ST>(s[r][0], s[r][1]), kda_pack2_rn<ST>(s[r][2], s[r][3]));
                if constexpr (STREAM) {
                    KDA_STORE_STREAM(reinterpret_cast<uint2*>(head + (size_t)kr * rs + col0), w);
                } else {
                    *reinterpret_cast<uint2*>(head + (size_t)kr * rs + col0) = w;
                }
            } else if constexpr (KF_VEC) {
                if (col0 >= V) continue;
                ST tmp[TV];
#pragma unroll
                for (int c = 0; c < TV; ++c)
                    tmp[c] = round_elem<SR>(s[r][c], base, elem0 + (kda_u32)(kr * V + col0 + c));
                kda_store_vec<ST, TV>(head + (size_t)kr * rs + col0, tmp);
            } else {
#pragma unroll
                for (int c = 0; c < TV; ++c) {
                    const int col = col0 + c;
                    if (col < V)
                        head[(size_t)kr * rs + col] =
                            round_elem<SR>(s[r][c], base, elem0 + (kda_u32)(kr * V + col));
                }
            }
        }
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c) {
            const int col = col0 + c;
            if (col >= V) continue;
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const int k0 = (j * LK + lk) * RG;
                if (k0 >= K) continue;
                if constexpr (!SR && sizeof(ST) == 2 && RG == 8) {
                    // two elements per conversion instruction (same bits as one at a time)
                    *reinterpret_cast<uint4*>(head + (size_t)col * K + k0) =
                        make_uint4(kda_pack2_rn<ST>(s[j * RG + 0][c], s[j * RG + 1][c]),
                                   kda_pack2_rn<ST>(s[j * RG + 2][c], s[j * RG + 3][c]),
                                   kda_pack2_rn<ST>(s[j * RG + 4][c], s[j * RG + 5][c]),
                                   kda_pack2_rn<ST>(s[j * RG + 6][c], s[j * RG + 7][c]));
                    continue;
                }
                ST tmp[RG];
#pragma unroll
                for (int e = 0; e < RG; ++e)
                    tmp[e] = round_elem<SR>(s[j * RG + e][c], base, elem0 + (kda_u32)(col * K + k0 + e));
                if constexpr (RG > 1) {
                    kda_store_vec<ST, RG>(head + (size_t)col * K + k0, tmp);
                } else {
                    head[(size_t)col * K + k0] = tmp[0];
                }
            }
        }
    }
}

// One token step on the lane's tile (spec section 2): decay the rows, k S (reduced over K),
// u = beta (v - k S), the rank-1 update, and for a new token (`out`) the read-out o = q S
// (reduced over K; every lane of a column group ends with the same bits). k, d, q: activated
// per-row values (padded K rows); vp[c]: the value of the lane's column c (valid for c < vlim).
// Both kernels step through this one function, so eager decode and the ring agree bit for bit.
// VEC_V: the values as one vector where all TV are valid (kda_ring; in the eager kernels the
// second path cost registers).
// U_OUT: the token's delta vector u into uo[0 .. TV) as well (kda_ring_delta's replay).
template <bool VEC_V = false, bool U_OUT = false>
__device__ __forceinline__ void token_step(float (&s)[TK][TV], const float* k, const float* d, const float* q,
                                           const float* vp, int vlim, float bt, int lk, bool out,
                                           float (&o)[TV], float* uo = nullptr) {
    // 1) decay the rows, 2) k S
    float acc[TV];
#pragma unroll
    for (int c = 0; c < TV; ++c) acc[c] = 0.0f;
    {
        float kv[TK], dv[TK];
        rows_from_smem(k, lk, kv);
        rows_from_smem(d, lk, dv);
#pragma unroll
        for (int r = 0; r < TK; ++r) {
#pragma unroll
            for (int c = 0; c < TV; ++c) {
                s[r][c] = s[r][c] * dv[r];
                acc[c] = fmaf(kv[r], s[r][c], acc[c]);
            }
        }
    }
    reduce_k(acc);
    // 3) u = beta (v - k S), rank-1 update; 4) read-out for new tokens
    float u[TV];
    if (VEC_V && TV == 4 && vlim >= TV) {
        // one 16-byte load (the ring's value rows are 16-byte aligned, col0 a multiple of TV)
        const float4 x = *reinterpret_cast<const float4*>(vp);
        const float vv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int c = 0; c < TV; ++c) u[c] = bt * (vv[c % 4] - acc[c]);
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c) {
            const float vv = c < vlim ? vp[c] : 0.0f;
            u[c] = bt * (vv - acc[c]);
        }
    }
    if constexpr (U_OUT) {
#pragma unroll
        for (int c = 0; c < TV; ++c) uo[c] = u[c];
    }
    float kv[TK];
    rows_from_smem(k, lk, kv);
    if (out) {
        float qv[TK];
        rows_from_smem(q, lk, qv);
#pragma unroll
        for (int c = 0; c < TV; ++c) o[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < TK; ++r) {
#pragma unroll
            for (int c = 0; c < TV; ++c) {
                s[r][c] = fmaf(kv[r], u[c], s[r][c]);
                o[c] = fmaf(qv[r], s[r][c], o[c]);
            }
        }
        reduce_k(o);
    } else {
#pragma unroll
        for (int r = 0; r < TK; ++r) {
#pragma unroll
            for (int c = 0; c < TV; ++c) s[r][c] = fmaf(kv[r], u[c], s[r][c]);
        }
    }
}

// Stores the TV outputs of columns col0.. (lane lk == 0 of a column group).
__device__ __forceinline__ void store_out(IT* op, const float (&o)[TV], int col0) {
    IT ov[TV];
#pragma unroll
    for (int c = 0; c < TV; ++c) ov[c] = KdaElem<IT>::from_f32(o[c]);
    if constexpr (KF_VEC) {
        kda_store_vec<IT, TV>(op, ov);
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c)
            if (col0 + c < V) op[c] = ov[c];
    }
}

struct Smem {
    float k[TC][KS];     // activated key
    float d[TC][KS];     // decay exp(g)
    float q[TC][KS];     // activated, scaled query (new tokens)
    float v[TC][VS];     // value (the columns of the current chunk)
    float beta[TC];      // activated beta
};

// Per-CTA plan of the sequence, decided by thread 0.
struct Plan {
    kda_u32 pend;        // ring entries folded first
    kda_u32 store_after; // store the state after this many combined tokens (KDA_NONE: never)
    kda_u32 append_at;   // new tokens go to ring entries append_at.. (KDA_NONE: not at all)
    kda_u32 new_len, new_pending;
};

// FAST: from the approximate exp and log (ex2.approx, lg2.approx): softplus within about 2e-7
// absolute (what the decay exp(-a softplus) needs), about 35 instructions fewer on sm_90.
template <bool FAST = false> __device__ __forceinline__ float softplus(float z) {
    return z > 20.0f ? z : FAST ? __logf(1.0f + __expf(z)) : log1pf(expf(z));
}
template <bool FAST = false> __device__ __forceinline__ float sigmoid(float x) {
    return FAST ? __fdividef(1.0f, 1.0f + __expf(-x)) : 1.0f / (1.0f + expf(-x));
}

// act_row's arithmetic on a loaded row x (the lane's KL elements): l2-normalised when asked,
// times `scale` when `scaled`, into dst. FAST: times an approximate reciprocal square root
// instead of divided by the IEEE square root (within a few ulp; not the CPU backend's bits).
// PAD: dst in token_step_stream's padded layout (krow_at).
template <bool FAST = false, bool PAD = false>
__device__ __forceinline__ void act_finish(float (&x)[KL], float* dst, bool l2, bool scaled, float scale, int lane) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < KL; ++i) ss += x[i] * x[i];
    if (l2) {
        if constexpr (FAST) {
            const float rn = rsqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
            for (int i = 0; i < KL; ++i) x[i] *= rn;
        } else {
            const float nrm = sqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
            for (int i = 0; i < KL; ++i) x[i] = x[i] / nrm;
        }
    }
#pragma unroll
    for (int i = 0; i < KL; ++i) {
        const int kk = lane + 32 * i;
        if (kk < K) dst[krow_at<PAD>(kk)] = scaled ? x[i] * scale : x[i];
    }
}

// One warp activates a key (`scaled` false) or a query (`scaled` true: times `scale`) row of K
// elements at src into dst: l2-normalised when asked. Shared by every kernel, so the eager
// kernels and the ring kernel produce the same bits (FAST: act_finish's).
template <bool FAST = false, bool PAD = false>
__device__ __forceinline__ void act_row(const IT* src, float* dst, bool l2, bool scaled, float scale,
                                        int lane) {
    float x[KL];
#pragma unroll
    for (int i = 0; i < KL; ++i) {
        const int kk = lane + 32 * i;
        x[i] = kk < K ? kda_load(src[kk]) : 0.0f;
    }
    act_finish<FAST, PAD>(x, dst, l2, scaled, scale, lane);
}

// The log-decay g of a raw gate; *bias (its dt_bias) is read only when the gate is not
// already activated. FAST: from the approximate exp and log (softplus's).
template <bool FAST = false>
__device__ __forceinline__ float log_decay_at(float raw, const float* bias, const KdaParams& p, float a_exp) {
    if (p.gate_mode == 1u) return -a_exp * softplus<FAST>(raw + *bias);
    if (p.gate_mode == 2u) return p.lower_bound * sigmoid<FAST>(a_exp * (raw + *bias));
    return raw;
}

// The decay exp(g) of a raw gate. FAST: from the approximate exp and log (about a_exp x 2e-7
// relative; not the CPU backend's bits).
template <bool FAST = false>
__device__ __forceinline__ float decay_at(float raw, const float* bias, const KdaParams& p, float a_exp) {
    const float lg = log_decay_at<FAST>(raw, bias, p, a_exp);
    return FAST ? __expf(lg) : expf(lg);
}

// The decay exp(g) of element kk of a row of raw gates (bias: f32 [K], unused when the gate
// is already activated).
template <bool FAST = false>
__device__ __forceinline__ float decay_of(const IT* src, const float* bias, int kk, const KdaParams& p,
                                          float a_exp) {
    return decay_at<FAST>(kda_load(src[kk]), bias + kk, p, a_exp);
}

// One warp computes the decay exp(g) of a row of K raw gates (bias: f32 [K], unused when the
// gate is already activated; PAD: dst in krow_at's padded layout).
template <bool PAD = false>
__device__ __forceinline__ void act_decay(const IT* src, const float* bias, float* dst, const KdaParams& p,
                                          float a_exp, int lane) {
#pragma unroll
    for (int i = 0; i < KL; ++i) {
        const int kk = lane + 32 * i;
        if (kk < K) dst[krow_at<PAD>(kk)] = decay_of(src, bias, kk, p, a_exp);
    }
}

// The activated beta of a raw beta.
__device__ __forceinline__ float act_beta(float b, const KdaParams& p) {
    return (p.beta_sigmoid ? sigmoid(b) : b) * p.beta_factor;
}

// Elements of one ring entry: one token's k rows of every q/k head, then v, g rows and betas of
// every value head (geometry.rs, `ring_entry_offsets`).
// Element offsets inside an entry: the v row, the g row and the beta of value head hv (the k
// row of q/k head h is at h K).
__device__ __forceinline__ size_t ring_off_v(const KdaParams& p, size_t hv) { return (size_t)p.h * K + hv * V; }
__device__ __forceinline__ size_t ring_off_g(const KdaParams& p, size_t hv) {
    return (size_t)p.h * K + (size_t)p.hv * V + hv * K;
}
__device__ __forceinline__ size_t ring_off_beta(const KdaParams& p, size_t hv) {
    return (size_t)p.h * K + (size_t)p.hv * V + (size_t)p.hv * K + hv;
}
__device__ __forceinline__ size_t ring_entry_elems(const KdaParams& p) { return ring_off_beta(p, p.hv); }

// The state of value head hv of a slot: K x V elements of ST in the pool's layout.
__device__ __forceinline__ ST* state_head(const KdaParams& p, kda_u32 slot, size_t hv) {
    return reinterpret_cast<ST*>(p.ssm) + ((size_t)slot * p.hv + hv) * ((size_t)K * V);
}

// Activates the tokens [t0, t0 + tc) of the combined sequence (pending ring entries, then the
// new tokens) into shared memory: one warp per token.
__device__ __forceinline__ void prepass(Smem& sm, const KdaParams& p, const Plan& pl, kda_u32 slot,
                                        kda_u32 bos, int hv, int h, int t0, int tc, int cbeg, int cend,
                                        float a_exp) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const size_t entry = ring_entry_elems(p);
    for (int t = warp; t < tc; t += nwarps) {
        const kda_u32 tt = (kda_u32)(t0 + t);
        const bool fresh = tt >= pl.pend;
        const IT *kp, *vp, *gp, *bp, *qp = nullptr;
        if (!fresh) {
            const IT* base = reinterpret_cast<const IT*>(p.ring) + ((size_t)slot * p.ring_len + tt) * entry;
            kp = base + (size_t)h * K;
            vp = base + ring_off_v(p, hv);
            gp = base + ring_off_g(p, hv);
            bp = base + ring_off_beta(p, hv);
        } else {
            const size_t tok = bos + (tt - pl.pend);
            kp = reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K;
            qp = reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K;
            vp = reinterpret_cast<const IT*>(p.v) + (tok * p.hv + hv) * V;
            gp = reinterpret_cast<const IT*>(p.g) + (tok * p.hv + hv) * K;
            bp = reinterpret_cast<const IT*>(p.beta) + tok * p.hv + hv;
        }
        const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K;
        act_row(kp, sm.k[t], p.l2norm != 0u, false, p.scale, lane);
        if (fresh) act_row(qp, sm.q[t], p.l2norm != 0u, true, p.scale, lane);
        act_decay(gp, bias, sm.d[t], p, a_exp, lane);
        // padding rows: zero key and query, unit decay (the padded state rows stay 0)
        for (int kk = K + lane; kk < KS; kk += 32) {
            sm.k[t][kk] = 0.0f;
            sm.q[t][kk] = 0.0f;
            sm.d[t][kk] = 1.0f;
        }
        // values of the chunk's columns
        for (int c = cbeg + lane; c < cend; c += 32) sm.v[t][c] = c < V ? kda_load(vp[c]) : 0.0f;
        if (lane == 0) {
            sm.beta[t] = act_beta(kda_load(bp[0]), p);
        }
    }
}


// The plan of sequence n from its ring record (len, pending) and raw accepted count (already
// loaded): the pending entries folded first, where the state is stored and where the new tokens
// go; records bad ring records and accepted counts in the error word (first CTA or item of the
// slot only). PREFILL: whether the caller takes KDA_OP_PREFILL (kda_step only), so that the
// ring kernels, which never run it, compile no test of it.
template <bool PREFILL = false>
__device__ __forceinline__ Plan plan_from(const KdaParams& p, kda_u32 slot, kda_u32 nnew, kda_u32 len,
                                          kda_u32 pending, kda_u32 acc, kda_u32* err, bool first_cta) {
    Plan pl;
    pl.append_at = KDA_NONE;
    pl.new_len = pl.new_pending = 0;
    if (p.ring_len == 0) {
        pl.pend = 0;
        pl.store_after = ((p.op == KDA_OP_DECODE || (PREFILL && p.op == KDA_OP_PREFILL)) && nnew > 0) ? nnew : KDA_NONE;
    } else {
        kda_u32 flags = 0;
        if (len > p.ring_len || pending > len) {
            flags |= KDA_ERR_META;
            len = min(len, p.ring_len);
            pending = min(pending, len);
        }
        const kda_u32 drafts = len - pending;
        if (p.op == KDA_OP_DECODE) {
            acc = 0;
            if (drafts > 0) flags |= KDA_ERR_DECODE_DRAFTS;
        } else if (PREFILL && p.op == KDA_OP_PREFILL) {
            acc = 0; // a prefill drops the drafts by contract
        }
        if (acc > drafts) {
            flags |= KDA_ERR_ACCEPTED;
            acc = drafts;
        }
        pl.pend = pending + acc;
        if (p.op == KDA_OP_REPLAY) {
            pl.store_after = pl.pend > 0 ? pl.pend : KDA_NONE;
        } else if (PREFILL && p.op == KDA_OP_PREFILL) {
            // the pending entries and every token, stored once at the end; the ring left empty
            pl.store_after = pl.pend + nnew > 0 ? pl.pend + nnew : KDA_NONE;
        } else if (pl.pend + nnew <= p.ring_len) {
            pl.store_after = KDA_NONE;
            pl.append_at = pl.pend;
            pl.new_len = pl.pend + nnew;
            pl.new_pending = p.op == KDA_OP_DECODE ? pl.pend + nnew : pl.pend;
        } else {
            pl.store_after = pl.pend;
            pl.append_at = 0;
            pl.new_len = nnew;
            pl.new_pending = p.op == KDA_OP_DECODE ? nnew : 0u;
        }
        if (flags && first_cta) {
            atomicOr(err, flags);
            atomicCAS(err + 1, KDA_NONE, slot);
        }
    }
    if (pl.store_after != KDA_NONE && first_cta) atomicOr(err + 2, 1u);
    return pl;
}

// The plan of sequence n, decided by thread 0 of each CTA of kda_step (reads the ring record
// and the accepted count, then plan_from, prefill included).
__device__ __forceinline__ Plan make_plan(const KdaParams& p, kda_u32 n, kda_u32 slot, kda_u32 nnew,
                                         const kda_u32* meta, kda_u32* err, bool first_cta) {
    kda_u32 len = 0, pending = 0, acc = 0;
    if (p.ring_len > 0) {
        const volatile kda_u32* vm = meta;
        len = vm[0];
        pending = vm[1];
        acc = p.accepted ? reinterpret_cast<const kda_u32*>(p.accepted)[n] : 0u;
    }
    return plan_from<true>(p, slot, nnew, len, pending, acc, err, first_cta);
}

// The end of a CTA of a ring call: appends the new tokens' raw inputs of the CTA's unit (its
// q/k head and value heads) to the ring, then the last CTA of the slot to arrive writes the new
// record. Every thread of the CTA calls it, after its last ring read.
__device__ __forceinline__ void ring_finish(const KdaParams& p, const Plan& pl, kda_u32 slot, kda_u32 bos,
                                           kda_u32 nnew, kda_u32 unit, kda_u32* meta, kda_u32 per_seq) {
    if (p.ring_len > 0) {
        // Append the new tokens' raw inputs. This CTA's ring reads are all done (each prepass is
        // followed by a barrier), and no other CTA reads the data written here.
        if (pl.append_at != KDA_NONE && nnew > 0) {
            __syncthreads();
            const size_t entry = ring_entry_elems(p);
            const int h = (int)unit;
            const int hv0 = h * (int)p.heads_per_cta, hpc = (int)p.heads_per_cta;
            IT* ring = reinterpret_cast<IT*>(p.ring);
            const IT* ik = reinterpret_cast<const IT*>(p.k);
            const IT* iv = reinterpret_cast<const IT*>(p.v);
            const IT* ig = reinterpret_cast<const IT*>(p.g);
            const IT* ib = reinterpret_cast<const IT*>(p.beta);
            for (kda_u32 j = 0; j < nnew; ++j) {
                const size_t tok = bos + j;
                IT* e = ring + ((size_t)slot * p.ring_len + pl.append_at + j) * entry;
                for (int i = threadIdx.x; i < K; i += blockDim.x)
                    e[(size_t)h * K + i] = ik[(tok * p.h + h) * K + i];
                for (int i = threadIdx.x; i < hpc * V; i += blockDim.x)
                    e[ring_off_v(p, hv0) + i] = iv[(tok * p.hv + hv0) * V + i];
                for (int i = threadIdx.x; i < hpc * K; i += blockDim.x)
                    e[ring_off_g(p, hv0) + i] = ig[(tok * p.hv + hv0) * K + i];
                for (int i = threadIdx.x; i < hpc; i += blockDim.x)
                    e[ring_off_beta(p, hv0) + i] = ib[tok * p.hv + hv0 + i];
            }
        }
        // The new bookkeeping, written by the last CTA of the slot to arrive.
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            const kda_u32 old = atomicAdd(meta + 2, 1u);
            if (old == per_seq - 1) {
                meta[0] = pl.new_len;
                meta[1] = pl.new_pending;
                meta[2] = 0u;
                meta[3] = 0u; // no delta vectors stored (kda_ring_delta's)
            }
        }
    }
}

// Prefetches into L2 the lines of [ptr, ptr + bytes), thread idx of n striding lines (the
// lanes of a warp: idx = lane, n = 32).
__device__ __forceinline__ void prefetch_range(const void* ptr, size_t bytes, int idx, int n = 32) {
    if (bytes == 0) return;
    const kda_u64 first = reinterpret_cast<kda_u64>(ptr) & ~(kda_u64)127;
    const kda_u64 last = (reinterpret_cast<kda_u64>(ptr) + bytes - 1) & ~(kda_u64)127;
#pragma unroll 1
    for (kda_u64 a = first + (kda_u64)idx * 128; a <= last; a += (kda_u64)n * 128)
        KDA_PREFETCH_L2(reinterpret_cast<const void*>(a));
}

// Prefetches into L2 the state tile of columns [cb, cb + cwv) of a head, every thread of the CTA
// taking part: one range for V-first tiles and whole K-first rows, else a row per thread.
__device__ __forceinline__ void prefetch_tile(const ST* head, int cb, int cwv) {
    if (VFIRST || (cb == 0 && cwv == V)) {
        prefetch_range(head + (VFIRST ? (size_t)cb * K : 0), (size_t)cwv * K * sizeof(ST), (int)threadIdx.x,
                       (int)blockDim.x);
        return;
    }
#pragma unroll 1
    for (int r = (int)threadIdx.x; r < K; r += (int)blockDim.x)
        prefetch_range(head + (size_t)r * V + cb, (size_t)cwv * sizeof(ST), 0, 1);
}

#if KDA_GRID_DEPENDENCY
// The device's SM ids' bound (%nsmid): at least its SM count (the ids need not be contiguous).
__device__ __forceinline__ kda_u32 sm_count() {
    kda_u32 n;
    asm("mov.u32 %0, %%nsmid;" : "=r"(n));
    return n;
}
#endif

// Element i of a buffer the host writes before the call (the slots, the sequence bounds), read
// before griddepcontrol.wait, from L2 (ld.global.cg): never written by the grid this one may
// overlap.
__device__ __forceinline__ kda_u32 early_u32(kda_u64 buf, kda_u32 i) {
#if KDA_GRID_DEPENDENCY
    return __ldcg(reinterpret_cast<const kda_u32*>(buf) + i);
#else
    return reinterpret_cast<const kda_u32*>(buf)[i];
#endif
}
// A slot index read before griddepcontrol.wait (early_u32).
__device__ __forceinline__ kda_u32 early_slot(const KdaParams& p, kda_u32 seq) { return early_u32(p.slots, seq); }

// Whether this module reads a padded batch's live count (KDA_PADDED) and this call has one.
// A test of a kernel parameter alone cost plain batches up to 1.3% on the 2-byte eager kernels
// (docs/performance.md, fifty-third session): plain modules compile it away.
__device__ __forceinline__ bool padded_call(const KdaParams& p) { return KDA_PADDED != 0 && p.live != 0u; }
// The sequences the call computes: all n_seqs, or with p.live (a batch padded to a fixed size,
// as a CUDA graph replays it) the first ones, as many as the host wrote there before the call
// (early_u32: safe before the wait). The kernels neither read nor write the others' slots,
// states, rings and outputs, nor use their inputs.
__device__ __forceinline__ kda_u32 live_seqs(const KdaParams& p) {
    return padded_call(p) ? min(early_u32(p.live, 0), p.n_seqs) : p.n_seqs;
}
// The store epoch the stochastic rounding of this call draws from: the layer's, plus for a
// padded batch the offset the host wrote after the live count (its updates times an odd
// constant: PaddedShape::epoch_offset), so the replays of one captured graph, one per update,
// round with fresh bits.
__device__ __forceinline__ kda_u32 call_epoch(const KdaParams& p) {
    return padded_call(p) ? p.epoch + early_u32(p.live, 1) : p.epoch;
}
// Whether this CTA of a kernel with one CTA per item (blockIdx.x, p.div_seq items per
// sequence) belongs to a sequence the call does not compute (live_seqs).
__device__ __forceinline__ bool padding_cta(const KdaParams& p) {
    return padded_call(p) && kda_div(blockIdx.x, p.div_seq) >= live_seqs(p);
}

// A hint to L2 for what the first prepass of a CTA reads: the unit's rows (key of its q/k head,
// values, gates and betas of its value heads) of ring entries 0..min(ring_len, TC), and the first
// TC new tokens' inputs. One warp per row; no wait, no register.
__device__ __forceinline__ void prefetch_prepass(const KdaParams& p, kda_u32 slot, kda_u32 unit, kda_u32 bos,
                                                 kda_u32 nnew) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const size_t hpc = p.heads_per_cta, hv0 = (size_t)unit * hpc;
    const size_t h = hv0 / (p.hv / p.h);
    const size_t entry = ring_entry_elems(p);
    const int ents = (int)min(p.ring_len, (kda_u32)TC), toks = (int)min(nnew, (kda_u32)TC);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    for (int sg = warp; sg < 4 * ents + 5 * toks; sg += nwarps) {
        const IT* ptr;
        size_t len;
        if (sg < 4 * ents) {
            const IT* e = ring + (size_t)(sg / 4) * entry;
            const int part = sg % 4;
            if (part == 0) {
                ptr = e + h * K;
                len = K;
            } else if (part == 1) {
                ptr = e + ring_off_v(p, hv0);
                len = hpc * V;
            } else if (part == 2) {
                ptr = e + ring_off_g(p, hv0);
                len = hpc * K;
            } else {
                ptr = e + ring_off_beta(p, hv0);
                len = hpc;
            }
        } else {
            const int x = sg - 4 * ents, part = x % 5;
            const size_t tok = bos + (size_t)(x / 5);
            if (part == 0) {
                ptr = reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K;
                len = K;
            } else if (part == 1) {
                ptr = reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K;
                len = K;
            } else if (part == 2) {
                ptr = reinterpret_cast<const IT*>(p.v) + (tok * p.hv + hv0) * V;
                len = hpc * V;
            } else if (part == 3) {
                ptr = reinterpret_cast<const IT*>(p.g) + (tok * p.hv + hv0) * K;
                len = hpc * K;
            } else {
                ptr = reinterpret_cast<const IT*>(p.beta) + tok * p.hv + hv0;
                len = hpc;
            }
        }
        prefetch_range(ptr, len * sizeof(IT), lane);
    }
}

} // namespace kda

using namespace kda;

extern "C" __global__ void __launch_bounds__(256, 2) kda_step(const KdaParams p) {
    if (padding_cta(p)) return;
    KDA_DEPENDENT_LAUNCH();
    __shared__ __align__(16) Smem sm;
    __shared__ Plan s_plan;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int lk = lane / LV, lv = lane % LV;
    const kda_u32 per_seq = p.units * p.vblocks;
    const kda_u32 n = kda_div(blockIdx.x, p.div_seq);
    const kda_u32 rem = blockIdx.x - n * per_seq;
    const kda_u32 unit = kda_div(rem, p.div_vb), vb = rem - unit * p.vblocks;
    const kda_u32* bounds = reinterpret_cast<const kda_u32*>(p.bounds);
    const kda_u32 slot = reinterpret_cast<const kda_u32*>(p.slots)[n];
    const kda_u32 bos = bounds[n];
    const kda_u32 nnew = bounds[n + 1] - bos;
    kda_u32* meta = reinterpret_cast<kda_u32*>(p.meta) + (size_t)slot * 4;
    kda_u32* err = reinterpret_cast<kda_u32*>(p.err);
    const bool first_cta = unit == 0 && vb == 0;
    const int hpc = (int)p.heads_per_cta;
    const int cc = nwarps * WC; // columns per chunk

    // Before the plan is known (it waits on the ring record): the first tile's loads, and an L2
    // prefetch of everything the prepass reads (the unit's rows of the first TC ring entries,
    // the new tokens' inputs), so the chain record -> inputs -> steps pays one memory latency
    // less. Both are needed unless the sequence has no work at all.
    float s[TK][TV];
    {
        const ST* head0 = state_head(p, slot, (size_t)unit * hpc);
        load_tile(head0, lk, (int)vb * cc + warp * WC + lv * TV, s);
        prefetch_prepass(p, slot, unit, bos, nnew);
    }
    bool first = true;

    if (threadIdx.x == 0) s_plan = make_plan(p, n, slot, nnew, meta, err, first_cta);
    __syncthreads();
    const Plan pl = s_plan;
    const int ntok = (int)(pl.pend + nnew);
    const bool work = nnew > 0 || pl.store_after != KDA_NONE;

    if (work) {
        const int group = (int)(p.hv / p.h);
        const int nchunks = (V + cc - 1) / cc;
        const kda_u32 sr_base =
            p.sr ? kda_sr_base(((kda_u64)p.seed_hi << 32) | p.seed_lo, p.layer, slot, call_epoch(p)) : 0u;
        for (int j = 0; j < hpc; ++j) {
            const int hv = (int)unit * hpc + j;
            const int h = hv / group;
            const float a_exp = p.gate_mode ? expf(reinterpret_cast<const float*>(p.a_log)[hv]) : 0.0f;
            ST* head = state_head(p, slot, hv);
            const kda_u32 elem0 = (kda_u32)hv * (kda_u32)(K * V);
            for (int chunk = (int)vb; chunk < nchunks; chunk += (int)p.vblocks) {
                const int cbeg = chunk * cc;
                const int cend = min(cbeg + cc, VS);
                const int col0 = cbeg + warp * WC + lv * TV;
                if (!first) load_tile(head, lk, col0, s);
                first = false;
                for (int t0 = 0; t0 < ntok; t0 += TC) {
                    const int tc = min(TC, ntok - t0);
                    __syncthreads();
                    prepass(sm, p, pl, slot, bos, hv, h, t0, tc, cbeg, cend, a_exp);
                    __syncthreads();
                    for (int t = 0; t < tc; ++t) {
                        const kda_u32 tt = (kda_u32)(t0 + t);
                        const bool fresh = tt >= pl.pend;
                        float o[TV];
                        token_step(s, sm.k[t], sm.d[t], sm.q[t], sm.v[t] + col0, V - col0, sm.beta[t], lk,
                                   fresh, o);
                        if (fresh && lk == 0 && col0 < V) {
                            const size_t tok = bos + (tt - pl.pend);
                            store_out(reinterpret_cast<IT*>(p.out) + (tok * p.hv + hv) * V + col0, o, col0);
                        }
                        if (tt + 1 == pl.store_after) {
                            if (p.sr) {
                                store_tile<true>(head, lk, col0, s, sr_base, elem0);
                            } else {
                                store_tile<false>(head, lk, col0, s, sr_base, elem0);
                            }
                        }
                    }
                }
            }
        }
    }

    ring_finish(p, pl, slot, bos, nnew, unit, meta, per_seq);
}

// ---------------------------------------------------------------------------------------------
// Eager decode, pipelined (ring_len == 0, one token per sequence). Persistent CTAs loop over the
// work items (sequence, value head, block of V columns), item = blockIdx.x + i * gridDim.x. The
// state tile and the raw token inputs of the NEXT item are copied into shared memory with
// cp.async S - 1 items ahead of the one being computed (S = 2 or 3 stages), so the loads stay
// in flight between items; the slot is looked up one item further ahead, so no copy waits on it
// (the token of sequence n is token n: no lookup).
// The per-token activations are split over the warps (key, query, decays over the threads
// of the other warps) and read from shared memory. The math is the token_step of kda_step with the same lane mapping, so an fp32 pool
// gives the same bits on either kernel. The host picks this kernel only where every copy is
// whole 16-byte chunks (see `eager_plan` in eager_plan.rs) and the stages fit shared memory.
// Dynamic shared memory: `stages` stages of `EagerStage::bytes`.

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
// HIP: plain 16-byte copies (the pipeline then overlaps less, but computes the same).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}
// A shared-memory location as a base pointer plus a byte offset.
struct SmemAt {
    unsigned char* base;
    __device__ __forceinline__ explicit SmemAt(unsigned char* b) : base(b) {}
};
__device__ __forceinline__ void cp_async16_at(const SmemAt& d, kda_u32 off, const void* src) {
    cp_async16(d.base + off, src);
}
#else
__device__ __forceinline__ kda_u32 smem_addr(const void* ptr) {
    kda_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(ptr));
    return a;
}
// 16 bytes global -> shared, asynchronous (L2 only: the state is read once).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// A shared-memory location as its 32-bit shared-window address (offsets are added in 32 bits,
// no generic-to-shared conversion per copy).
struct SmemAt {
    kda_u32 addr;
    __device__ __forceinline__ explicit SmemAt(unsigned char* b) : addr(smem_addr(b)) {}
};
// The state tiles' copies (tile_issue) ask L2 to fetch whole 128-byte lines (`.L2::128B`): on
// the H200 eager decode was 0.6-2.2% faster at N >= 64 (docs/performance.md, eighth session;
// 256-byte lines gained less, and lost on the ring kernel).
__device__ __forceinline__ void cp_async16_at(const SmemAt& d, kda_u32 off, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(d.addr + off), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Bulk copies (sm_90 `cp.async.bulk`, the copy engine behind TMA): one instruction moves a
// contiguous block of whole 16-byte chunks between global and shared memory, with no per-lane
// addresses. In: completes on an mbarrier, which counts the bytes still to come. Out: a bulk
// group of the issuing thread, whose shared-memory reads are waited for before the CTA exits.
// Elsewhere (HIP, older GPUs) plain 16-byte copies by the issuing thread stand in for them
// (correct, not fast: the host launches the bulk kernel on sm_90 and later only).
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void bulk_bar_init(kda_u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n" ::"r"(smem_addr(bar))
                 : "memory");
}
// The one arrival of the barrier's phase, with the bytes its copies will bring.
__device__ __forceinline__ void bulk_bar_expect(kda_u64* bar, kda_u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// Waits for the barrier's first phase to complete (PHASED: its phase of the given parity, 0 or
// 1; the first phase's parity is 0).
template <bool PHASED = false>
__device__ __forceinline__ void bulk_bar_wait(kda_u64* bar, kda_u32 parity = 0) {
    kda_u32 done = 0;
    while (!done) {
        if constexpr (PHASED)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         " selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(smem_addr(bar)), "r"(parity)
                         : "memory");
        else // (an immediate 0: the decode kernels' code unchanged)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                         " selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(smem_addr(bar))
                         : "memory");
    }
}
__device__ __forceinline__ void bulk_in(void* dst, const void* src, kda_u32 bytes, kda_u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// This thread's shared-memory writes made visible to the bulk copies (before the barrier).
__device__ __forceinline__ void bulk_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_out(void* dst, const void* src, kda_u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
                 "r"(bytes)
                 : "memory");
}
// Commits this thread's bulk stores and waits until they have read shared memory.
__device__ __forceinline__ void bulk_out_done() {
    asm volatile("cp.async.bulk.commit_group;\n"
                 "cp.async.bulk.wait_group.read 0;\n" ::
                     : "memory");
}
#else
__device__ __forceinline__ void bulk_copy16(void* dst, const void* src, kda_u32 bytes) {
    for (kda_u32 o = 0; o < bytes; o += 16)
        *reinterpret_cast<uint4*>(static_cast<unsigned char*>(dst) + o) =
            *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(src) + o);
}
__device__ __forceinline__ void bulk_bar_init(kda_u64*) {}
__device__ __forceinline__ void bulk_bar_expect(kda_u64*, kda_u32) {}
template <bool PHASED = false> __device__ __forceinline__ void bulk_bar_wait(kda_u64*, kda_u32 = 0) {}
__device__ __forceinline__ void bulk_in(void* dst, const void* src, kda_u32 bytes, kda_u64*) {
    bulk_copy16(dst, src, bytes);
}
__device__ __forceinline__ void bulk_fence() {}
__device__ __forceinline__ void bulk_out(void* dst, const void* src, kda_u32 bytes) { bulk_copy16(dst, src, bytes); }
__device__ __forceinline__ void bulk_out_done() {}
#endif

// Copies `bytes` (a multiple of 16) from src to dst in 16-byte chunks, spread over the CTA.
__device__ __forceinline__ void copy_chunks(unsigned char* dst, const unsigned char* src, int bytes) {
    for (int j = threadIdx.x; j < bytes / 16; j += blockDim.x) cp_async16(dst + 16 * j, src + 16 * j);
}

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

// The K-first tile in shared memory is swizzled by 16-byte chunks: chunk o of tile row `row`
// is stored at chunk o ^ kf_swizzle(row). The lanes of a column group read the same columns of
// rows TK apart (lk); rows whose length is a multiple of 128 bytes would put all of them on the
// same banks, the swizzle spreads them over the row. Only where cpr (chunks per row) is a power
// of two (else no swizzle), so that o ^ kf_swizzle stays inside the row.
__device__ __forceinline__ kda_u32 kf_swizzle_mask(int cpr) { return (cpr & (cpr - 1)) ? 0u : (kda_u32)(cpr - 1); }
__device__ __forceinline__ kda_u32 kf_swizzle(kda_u32 row, kda_u32 mask) { return (row / TK) & mask; }

// Byte offsets inside one stage: the tile (K-first [K][cw], V-first [cw][K]), then the raw
// q, k, g rows ([K] each) and v ([cw]) of the input type, dt_bias ([K] f32), then 16 bytes of
// scalars: the aligned word holding the raw beta, and a_log (f32).
struct EagerStage {
    int tile, q, k, g, v, bias, scal, bytes;
    __device__ __forceinline__ EagerStage(int cw) {
        tile = 0;
        q = round16(K * cw * (int)sizeof(ST));
        k = q + round16(K * (int)sizeof(IT));
        g = k + round16(K * (int)sizeof(IT));
        v = g + round16(K * (int)sizeof(IT));
        bias = v + round16(cw * (int)sizeof(IT));
        scal = bias + round16(K * 4);
        bytes = scal + 16;
    }
};

// One work item. Its scalars (raw beta, a_log) travel through the stage with cp.async, so no
// thread waits on them when it issues the copies.
struct EagerItem {
    int hv, cb;        // value head, first column
    kda_u32 slot, tok; // pool slot, token index
    int beta_off;      // byte offset of the raw beta inside its aligned 4-byte word
};

// The sequence of an item, and its token: eager decode takes exactly one token per sequence
// (the host checks), so token n is sequence n's and its inputs need no lookup.
__device__ __forceinline__ kda_u32 eager_seq(const KdaParams& p, kda_u32 item) { return kda_div(item, p.div_seq); }

// An item from its index and its sequence's slot (looked up beforehand).
__device__ __forceinline__ EagerItem eager_item(const KdaParams& p, kda_u32 item, kda_u32 slot) {
    const kda_u32 n = eager_seq(p, item);
    const kda_u32 rem = item - n * (p.hv * p.vblocks);
    const kda_u32 hv = kda_div(rem, p.div_vb);
    EagerItem it;
    it.hv = (int)hv;
    it.cb = (int)(rem - hv * p.vblocks) * ((int)(blockDim.x >> 5) * WC);
    it.slot = slot;
    it.tok = n;
    it.beta_off = 0;
    return it;
}

// An item, its slot loaded now (the load is waited for where the slot is used: the tile copy,
// issued after the inputs' copies).
__device__ __forceinline__ EagerItem eager_lookup(const KdaParams& p, kda_u32 item) {
    return eager_item(p, item, reinterpret_cast<const kda_u32*>(p.slots)[eager_seq(p, item)]);
}

// The raw beta held at byte offset `off` of an aligned 4-byte word, as f32.
template <typename T> __device__ __forceinline__ float beta_from_word(kda_u32 w, int off) {
    return kda_from_bits<T>((unsigned short)(w >> (8 * off)));
}
template <> __device__ __forceinline__ float beta_from_word<float>(kda_u32 w, int) { return __uint_as_float(w); }

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    *reinterpret_cast<kda_u32*>(dst) = *reinterpret_cast<const kda_u32*>(src);
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
}
#else
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
#endif

// The 16-byte chunks of a K-first tile (columns cb.., cw of them, cwv valid) that this thread
// moves between the head and the swizzled tile in shared memory: f(smem, glob) per chunk, with
// the chunk's byte offset in the tile (chunk o of row `row` at chunk o ^ kf_swizzle(row)) and its
// address in the head. cpr (chunks per tile row) divides blockDim.x (cw = warps x WC, WC x sizeof(ST) a
// power-of-two multiple of 16 <= 512), so a thread moves chunk o of the rows row0 + m STEP,
// STEP = blockDim.x / cpr = 512 / (WC sizeof(ST)) whatever the warps. tile_issue copies in,
// tile_copy_out out, the same chunks.
template <typename F>
__device__ __forceinline__ void kf_tile_chunks(const ST* head, int cb, int cw, int cwv, F&& f) {
    constexpr int STEP = 512 / (WC * (int)sizeof(ST));
    constexpr int NR = (K + STEP - 1) / STEP;
    const int cpr = cw * (int)sizeof(ST) / 16, cprv = cwv * (int)sizeof(ST) / 16;
    const int o = (int)threadIdx.x % cpr, row0 = (int)threadIdx.x / cpr;
    const kda_u32 mask = kf_swizzle_mask(cpr);
    if (o >= cprv) return;
    const unsigned char* g0 = reinterpret_cast<const unsigned char*>(head + (size_t)row0 * V + cb) + 16 * o;
    const kda_u32 rb = (kda_u32)cw * sizeof(ST), r0 = (kda_u32)row0;
#pragma unroll
    for (int m = 0; m < NR; ++m) {
        const kda_u32 row = r0 + (kda_u32)(m * STEP);
        if (K % STEP == 0 || row < (kda_u32)K) // no branch where every row is whole
            f(row * rb + 16u * ((kda_u32)o ^ kf_swizzle(row, mask)), g0 + (size_t)m * STEP * V * sizeof(ST));
    }
}

// Issues the cp.async copies of a state tile: columns cb.. (cw of them, cwv valid, whole 16-byte
// chunks) of the value head at `head`, into `dst` (K-first [K][cw] swizzled, V-first [cw][K]).
// The caller commits.
__device__ __forceinline__ void tile_issue(unsigned char* dst, const ST* head, int cb, int cw, int cwv) {
    if constexpr (!VFIRST) {
        const SmemAt d(dst);
        kf_tile_chunks(head, cb, cw, cwv, [&](kda_u32 smem, const unsigned char* g) { cp_async16_at(d, smem, g); });
    } else {
        copy_chunks(dst, reinterpret_cast<const unsigned char*>(head + (size_t)cb * K), cwv * K * (int)sizeof(ST));
    }
}

// Issues the copies of one item into a stage as two cp.async groups: first its token inputs
// and scalars (committed here), then its state tile (the caller commits), so the activations
// can start before the tile has arrived.
__device__ __forceinline__ void eager_issue(unsigned char* st, const EagerStage& L, const KdaParams& p,
                                            EagerItem& it, int cw) {
    const int cwv = cmin(cw, V - it.cb); // valid columns (a multiple of 16 bytes' worth)
    const int h = (int)kda_div((kda_u32)it.hv, p.div_grp);
    const IT* q = reinterpret_cast<const IT*>(p.q) + ((size_t)it.tok * p.h + h) * K;
    const IT* k = reinterpret_cast<const IT*>(p.k) + ((size_t)it.tok * p.h + h) * K;
    const IT* g = reinterpret_cast<const IT*>(p.g) + ((size_t)it.tok * p.hv + it.hv) * K;
    const IT* v = reinterpret_cast<const IT*>(p.v) + ((size_t)it.tok * p.hv + it.hv) * V + it.cb;
    copy_chunks(st + L.q, reinterpret_cast<const unsigned char*>(q), K * (int)sizeof(IT));
    copy_chunks(st + L.k, reinterpret_cast<const unsigned char*>(k), K * (int)sizeof(IT));
    copy_chunks(st + L.g, reinterpret_cast<const unsigned char*>(g), K * (int)sizeof(IT));
    copy_chunks(st + L.v, reinterpret_cast<const unsigned char*>(v), cwv * (int)sizeof(IT));
    if (p.gate_mode != 0u) {
        const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)it.hv * K;
        copy_chunks(st + L.bias, reinterpret_cast<const unsigned char*>(bias), K * 4);
    }
    const kda_u64 bidx = (kda_u64)it.tok * p.hv + it.hv;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(reinterpret_cast<const IT*>(p.beta) + bidx);
    it.beta_off = (int)(reinterpret_cast<kda_u64>(b) & 3u);
    if (threadIdx.x == 0) {
        // The aligned word holding a 2-byte beta in its low half reaches past the tensor when
        // that beta is its last element (decode: at least n_seqs tokens); take that one with a
        // plain load (once per launch).
        if (sizeof(IT) == 2 && it.beta_off == 0 && bidx + 1 >= (kda_u64)p.n_seqs * p.hv)
            *reinterpret_cast<unsigned short*>(st + L.scal) = *reinterpret_cast<const unsigned short*>(b);
        else
            cp_async4(st + L.scal, b - it.beta_off);
    }
    if (p.gate_mode != 0u && threadIdx.x == 32 % blockDim.x)
        cp_async4(st + L.scal + 4, reinterpret_cast<const float*>(p.a_log) + it.hv);
    cp_async_commit();
    const ST* head = state_head(p, it.slot, it.hv);
    tile_issue(st + L.tile, head, it.cb, cw, cwv);
}

// K-first: the column, in a stage's tile of cw columns, where the lane's first column col0l
// sits. Every row of the lane has the swizzle of its group lk (kf_swizzle), and its TV columns
// stay inside one 16-byte chunk.
__device__ __forceinline__ int kf_stage_col(int lk, int col0l, int cw) {
    const int cpr = cw * (int)sizeof(ST) / 16;
    const int byte0 = col0l * (int)sizeof(ST);
    return ((((byte0 >> 4) ^ (int)kf_swizzle(row_of(lk, 0), kf_swizzle_mask(cpr))) << 4) | (byte0 & 15)) /
           (int)sizeof(ST);
}

// The lane's tile from a stage (cw columns starting at the item's first column; col0l: the
// lane's first column relative to it). Columns at or past V read as 0.
__device__ __forceinline__ void tile_from_stage(const ST* t, int lk, int col0l, int cwv, int cw,
                                                float (&s)[TK][TV]) {
    const bool ok = col0l < cwv;
    if constexpr (!VFIRST) {
        const int colsw = kf_stage_col(lk, col0l, cw);
#pragma unroll
        for (int r = 0; r < TK; ++r) {
            const int kr = row_of(lk, r);
            float tmp[TV];
            if (ok) {
                kda_load_vec<ST, TV>(t + (size_t)kr * cw + colsw, tmp);
            } else {
#pragma unroll
                for (int c = 0; c < TV; ++c) tmp[c] = 0.0f;
            }
#pragma unroll
            for (int c = 0; c < TV; ++c) s[r][c] = tmp[c];
        }
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c) {
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const int k0 = (j * LK + lk) * RG;
                float tmp[RG];
                if (ok && col0l + c < cwv) {
                    kda_load_vec<ST, RG>(t + (size_t)(col0l + c) * K + k0, tmp);
                } else {
#pragma unroll
                    for (int e = 0; e < RG; ++e) tmp[e] = 0.0f;
                }
#pragma unroll
                for (int e = 0; e < RG; ++e) s[j * RG + e][c] = tmp[e];
            }
        }
    }
}

// K-first: the lane's rounded tile back into the stage, at the (swizzled) places
// tile_from_stage read it from, so each element is written by the thread that read it; rows
// past K are not written. col0: the lane's first column in the head (the stochastic stream's
// element offsets).
template <bool SR>
__device__ __forceinline__ void tile_to_stage(ST* t, int lk, int col0l, int cwv, int cw, int col0,
                                              const float (&s)[TK][TV], kda_u32 base, kda_u32 elem0) {
    if (col0l >= cwv) return;
    const int colsw = kf_stage_col(lk, col0l, cw);
#pragma unroll
    for (int r = 0; r < TK; ++r) {
        const int kr = row_of(lk, r);
        if (kr >= K) continue;
        ST* d = t + (size_t)kr * cw + colsw;
        if constexpr (!SR && sizeof(ST) == 2 && TV == 4) {
            *reinterpret_cast<uint2*>(d) =
                make_uint2(kda_pack2_rn<ST>(s[r][0], s[r][1]), kda_pack2_rn<ST>(s[r][2], s[r][3]));
        } else {
            ST tmp[TV];
#pragma unroll
            for (int c = 0; c < TV; ++c)
                tmp[c] = round_elem<SR>(s[r][c], base, elem0 + (kda_u32)(kr * V + col0 + c));
            kda_store_vec<ST, TV>(d, tmp);
        }
    }
}

// K-first: the stage's tile (written by tile_to_stage) out to columns cb.. of the head, in the
// 16-byte chunks tile_issue copied in.
__device__ __forceinline__ void tile_copy_out(const unsigned char* src, ST* head, int cb, int cw, int cwv) {
    // (the chunks' addresses come back const: they are the head's own, writable)
    kf_tile_chunks(head, cb, cw, cwv, [&](kda_u32 smem, const unsigned char* g) {
        *reinterpret_cast<uint4*>(const_cast<unsigned char*>(g)) = *reinterpret_cast<const uint4*>(src + smem);
    });
}

// The activations of an eager item's token, split over the CTA: warp 0 the key, warp 1 (warp
// 0 when alone) the query, both l2norms in parallel; the threads from warp 2 on (all of them
// with fewer than 3 warps) the decays, the values of the CTA's cwv columns and beta. k, q, g,
// v: the raw rows (in a stage or in global memory), bias: the head's dt_bias row, beta_raw and
// a_log: the raw scalars (a_log used only with a gate).
__device__ __forceinline__ void eager_activate(const KdaParams& p, const IT* k, const IT* q, const IT* g,
                                               const float* bias, const IT* v, int cwv, float beta_raw,
                                               float a_log, float* ak, float* aq, float* ad, float* av,
                                               float* abeta) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    if (warp == 0) act_row(k, ak, p.l2norm != 0u, false, p.scale, lane);
    if (warp == (nwarps > 1 ? 1 : 0)) act_row(q, aq, p.l2norm != 0u, true, p.scale, lane);
    const int d0 = nwarps > 2 ? 64 : 0, dn = (int)blockDim.x - d0, tid = (int)threadIdx.x - d0;
    if (tid >= 0) {
        const float a_exp = p.gate_mode ? expf(a_log) : 0.0f;
        for (int kk = tid; kk < K; kk += dn) ad[kk] = decay_of(g, bias, kk, p, a_exp);
        for (int c = tid; c < cwv; c += dn) av[c] = kda_load(v[c]);
        if (tid == 0) *abeta = act_beta(beta_raw, p);
    }
}

// The body of kda_eager and kda_eager_stage. VIA_STAGE (2-byte K-first only): the updated tile
// goes back out through its stage, written there and copied out in whole 16-byte chunks, so a
// warp writes whole tile rows; the host launches it for rows of 256 bytes, where it measured
// faster. A compile-time choice: the runtime branch cost the register path 0.1-0.2 us at N = 1.
template <bool VIA_STAGE> __device__ __forceinline__ void eager_run(const KdaParams& p) {
    // (named apart from kda_ring's dsm: one has C++ linkage, the other C)
    extern __shared__ __align__(16) unsigned char eager_dsm[];
    __shared__ __align__(16) float ak[KS], ad[KS], aq[KS], av[VS];
    __shared__ float abeta;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int lk = lane / LV, lv = lane % LV;
    const int cw = nwarps * WC;
    const EagerStage L(cw);
    const kda_u32 total = live_seqs(p) * p.hv * p.vblocks;
    const kda_u32 grid = gridDim.x;
    kda_u32* err = reinterpret_cast<kda_u32*>(p.err);
    if (blockIdx.x == 0 && threadIdx.x == 0 && total > 0) atomicOr(err + 2, 1u);
    const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;

    // Stage j holds item i with i % S == j; the copies of item i + S - 1 are issued while item i
    // is computed. s_items[j]: the item in stage j (written by thread 0 when it is issued).
    __shared__ EagerItem s_items[3];
    const int S = p.stages == 3u ? 3 : 2;
    kda_u32 item = blockIdx.x;
    if (item >= total) return;
    kda_u32 issued = item; // the next item to issue
    // Two cp.async groups per item (inputs, tile), committed even when empty so the counts of
    // the waits below hold.
    for (int j = 0; j < S - 1; ++j) {
        if (issued < total) {
            EagerItem it = eager_lookup(p, issued);
            eager_issue(eager_dsm + (size_t)j * L.bytes, L, p, it, cw);
            if (threadIdx.x == 0) s_items[j] = it;
        } else {
            cp_async_commit();
        }
        cp_async_commit();
        issued += grid;
    }
    // The slot of the next item to issue: loaded by thread 0 one item ahead, published through
    // shared memory at the end of an item (no thread waits on the load).
    __shared__ kda_u32 s_next;
    if (threadIdx.x == 0 && issued < total) s_next = reinterpret_cast<const kda_u32*>(p.slots)[eager_seq(p, issued)];

    for (int i = 0; item < total; item += grid, ++i) {
        const int stage = i % S;
        unsigned char* st = eager_dsm + (size_t)stage * L.bytes;
        // this item's inputs (2 (S - 1) groups in flight, the oldest pair is this item's)
        if (S == 3) {
            cp_async_wait<3>();
        } else {
            cp_async_wait<1>();
        }
        __syncthreads();
        const EagerItem me = s_items[stage];
        // Every warp is done with the previous item (this barrier), whose stage is refilled now.
        kda_u32 next_slot = 0; // thread 0: the lookup of the item after it
        if (issued < total) {
            const int js = (i + S - 1) % S;
            EagerItem nxt = eager_item(p, issued, s_next);
            eager_issue(eager_dsm + (size_t)js * L.bytes, L, p, nxt, cw);
            if (threadIdx.x == 0) s_items[js] = nxt;
            issued += grid;
            if (threadIdx.x == 0 && issued < total)
                next_slot = reinterpret_cast<const kda_u32*>(p.slots)[eager_seq(p, issued)];
        } else {
            cp_async_commit();
        }
        cp_async_commit();
        const float beta_raw = beta_from_word<IT>(*reinterpret_cast<const kda_u32*>(st + L.scal), me.beta_off);
        const float a_log = *reinterpret_cast<const float*>(st + L.scal + 4);

        // activations of the item's token, from the stage
        const int cwv = cmin(cw, V - me.cb);
        eager_activate(p, reinterpret_cast<const IT*>(st + L.k), reinterpret_cast<const IT*>(st + L.q),
                       reinterpret_cast<const IT*>(st + L.g), reinterpret_cast<const float*>(st + L.bias),
                       reinterpret_cast<const IT*>(st + L.v), cwv, beta_raw, a_log, ak, aq, ad, av, &abeta);
        // this item's tile (2 S groups committed after it... its own and the S - 1 items after)
        if (S == 3) {
            cp_async_wait<4>();
        } else {
            cp_async_wait<2>();
        }
        __syncthreads();
        float s[TK][TV];
        const int col0l = warp * WC + lv * TV;
        tile_from_stage(reinterpret_cast<const ST*>(st + L.tile), lk, col0l, cwv, cw, s);

        const int col0 = me.cb + col0l;
        float o[TV];
        token_step(s, ak, ad, aq, av + col0l, cwv - col0l, abeta, lk, true, o);
        if (lk == 0 && col0 < V)
            store_out(reinterpret_cast<IT*>(p.out) + ((size_t)me.tok * p.hv + me.hv) * V + col0, o, col0);
        ST* head = state_head(p, me.slot, me.hv);
        const kda_u32 elem0 = (kda_u32)me.hv * (kda_u32)(K * V);
        if constexpr (VIA_STAGE) {
            ST* t = reinterpret_cast<ST*>(st + L.tile);
            if (p.sr) {
                tile_to_stage<true>(t, lk, col0l, cwv, cw, col0, s, kda_sr_base(seed, p.layer, me.slot, call_epoch(p)), elem0);
            } else {
                tile_to_stage<false>(t, lk, col0l, cwv, cw, col0, s, 0u, elem0);
            }
            __syncthreads();
            tile_copy_out(st + L.tile, head, me.cb, cw, cwv);
        } else if (p.sr) {
            store_tile<true>(head, lk, col0, s, kda_sr_base(seed, p.layer, me.slot, call_epoch(p)), elem0);
        } else {
            store_tile<false>(head, lk, col0, s, 0u, elem0);
        }
        // the copies into this stage are issued again only after the next iteration's first
        // barrier, which every warp reaches after its reads of this stage; s_next was read by
        // every thread before the barrier above.
        if (threadIdx.x == 0) s_next = next_slot;
    }
    cp_async_wait<0>();
}

// Registers of kda_eager: 2-byte pools at most 128 (two CTAs of 8 warps); fp32 pools at most
// 168, as their 2-stage tiles (64 KB at 4 warps) let only 3 CTAs of 4 warps share an SM, which
// 168 registers per thread still allow (KDA_ST_BYTES comes from the host with KDA_ST).
#if defined(KDA_ST_BYTES) && KDA_ST_BYTES == 4 && !defined(__HIPCC__)
#define KDA_EAGER_BOUNDS __maxnreg__(168)
#else
#define KDA_EAGER_BOUNDS __launch_bounds__(256, 2)
#endif

// Prefetches into L2 the state tile of eager item `item`, whose sequence has slot `slot` (CTAs
// of cw columns).
__device__ __forceinline__ void prefetch_item(const KdaParams& p, kda_u32 item, kda_u32 slot, int cw) {
    const EagerItem it = eager_item(p, item, slot);
    prefetch_tile(state_head(p, it.slot, it.hv), it.cb, cmin(cw, V - it.cb));
}

// A dependent launch (p.early), before its wait: the state tiles of the items the prologue
// issues go into L2 while the grid before this one finishes, so their copies after the wait
// find them there. Safe before the wait: the slots are the host's (early_slot), and an L2
// prefetch is only a hint (L2 is where the other grid's writes land: no stale copy is read).
// (Handing these slots on to eager_run made 2-byte decode at N >= 64 up to 3% slower on the
// H200: code generation; it loads them again.)
__device__ __forceinline__ void eager_prefetch_first(const KdaParams& p) {
#if KDA_GRID_DEPENDENCY
    if (p.early == 0u) return;
    const int cw = (int)(blockDim.x >> 5) * WC;
    const kda_u32 total = live_seqs(p) * p.hv * p.vblocks;
    const int items = p.stages == 3u ? 2 : 1;
    kda_u32 slot[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const kda_u32 item = blockIdx.x + (kda_u32)j * gridDim.x;
        slot[j] = j < items && item < total ? early_slot(p, eager_seq(p, item)) : 0u;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const kda_u32 item = blockIdx.x + (kda_u32)j * gridDim.x;
        if (j >= items || item >= total) break;
        prefetch_item(p, item, slot[j], cw);
    }
#endif
}

// Eager decode, the tile stored from registers.
extern "C" __global__ void KDA_EAGER_BOUNDS kda_eager(const KdaParams p) {
    eager_prefetch_first(p);
    KDA_DEPENDENT_LAUNCH();
    eager_run<false>(p);
}

// Eager decode, a 2-byte K-first tile stored through its stage (elsewhere the same as kda_eager).
extern "C" __global__ void KDA_EAGER_BOUNDS kda_eager_stage(const KdaParams p) {
    eager_prefetch_first(p);
    KDA_DEPENDENT_LAUNCH();
    eager_run<!VFIRST && sizeof(ST) == 2>(p);
}

// Registers of kda_eager_tile: at most 128, so four CTAs of 4 warps (or two of 8) share an SM.
#define KDA_EAGER_TILE_BOUNDS __launch_bounds__(256, 2)

// Decays per thread of the gate threads in kda_eager_tile's early path (at least 64 of them).
constexpr int DKE = (K + 63) / 64;
// Whether a key or query row's loads (KL per lane) and a gate thread's raw gates and biases
// (2 DKE) fit the same registers, which kda_eager_tile's early path needs.
constexpr bool EARLY_FITS = 2 * DKE == KL;
// Values per gate thread in the early path: at most 2, as a CTA's columns (warps x WC) are at
// most twice its gate threads (32 warps - 64) from 4 warps where WC <= 32.
constexpr int VPT = 2;
static_assert(!EARLY_FITS || WC <= 32, "kda_eager_tile's early path: more than VPT values per gate thread");

// The bits of the input element at p (2-byte inputs in the low half), and the element as f32
// from them (exact, as kda_load): for loads whose conversion should not follow them at once.
// (Templates, so only modules of 2-byte inputs compile the 2-byte conversion.)
template <typename T = IT> __device__ __forceinline__ kda_u32 input_bits(const T* p) {
    if constexpr (sizeof(T) == 4) {
        return *reinterpret_cast<const kda_u32*>(p);
    } else {
        return *reinterpret_cast<const unsigned short*>(p);
    }
}
template <typename T = IT> __device__ __forceinline__ float input_from_bits(kda_u32 b) {
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(b);
    } else {
        return kda_from_bits<T>((unsigned short)b);
    }
}

// A 2-byte tile as loaded: kda_eager_tile keeps the words of its vector loads and converts them
// to f32 only after its barrier, so no conversion waits for the tile before the activations
// (the compiler puts a load's conversions right after it). Each word holds two elements that
// are adjacent in memory: K-first, two columns of a row; V-first, two rows of a column.
constexpr bool TILE_WORDS = sizeof(ST) == 2 && (VFIRST ? RG == 8 : KF_VEC);
constexpr int TW = TILE_WORDS ? TK * TV / 2 : 1; // words of a lane's tile
static_assert(!TILE_WORDS || TV == 4, "load_tile_words: a K-first row's TV elements are one 8-byte load");
__device__ __forceinline__ int tw_of(int r, int c) { return VFIRST ? c * (TK / 2) + r / 2 : r * (TV / 2) + c / 2; }

// load_tile's loads (TILE_WORDS), their words kept. (Its loops mirror load_tile's: one loop
// visitor for both measured up to 1.7% slower on 2-byte V-first decode, docs/performance.md,
// fourteenth session.)
__device__ __forceinline__ void load_tile_words(const ST* head, int lk, int col0, kda_u32 (&w)[TW], int rs = V) {
    if constexpr (!VFIRST) {
#pragma unroll
        for (int r = 0; r < TK; ++r) {
            const int kr = row_of(lk, r);
            uint2 x = make_uint2(0u, 0u);
            if (kr < K && col0 < V) x = *reinterpret_cast<const uint2*>(head + (size_t)kr * rs + col0);
            w[tw_of(r, 0)] = x.x;
            w[tw_of(r, 2)] = x.y;
        }
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c) {
            const int col = col0 + c;
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const int k0 = (j * LK + lk) * RG;
                uint4 x = make_uint4(0u, 0u, 0u, 0u);
                if (col < V && k0 < K) x = *reinterpret_cast<const uint4*>(head + (size_t)col * K + k0);
                w[tw_of(j * RG + 0, c)] = x.x;
                w[tw_of(j * RG + 2, c)] = x.y;
                w[tw_of(j * RG + 4, c)] = x.z;
                w[tw_of(j * RG + 6, c)] = x.w;
            }
        }
    }
}

// The f32 tile from load_tile_words's words (exact; a template, so only 2-byte modules compile
// the conversions).
template <typename T = ST>
__device__ __forceinline__ void tile_from_words(const kda_u32 (&w)[TW], float (&s)[TK][TV]) {
#pragma unroll
    for (int r = 0; r < TK; ++r) {
#pragma unroll
        for (int c = 0; c < TV; ++c) s[r][c] = kda_word_half<T>(w[tw_of(r, c)], (VFIRST ? r : c) & 1);
    }
}

// p.early of a dependent launch whose tile kernel loads its tile from the slot it read before
// the wait (EARLY_PREFETCH, 1: it reads the slot again after the wait); the host's
// `EARLY_SLOT_ONCE` in params.rs, chosen by `EagerPlan::slot_once`.
constexpr kda_u32 EARLY_SLOT_ONCE = 2u;

// How a one-item-per-CTA eager kernel moves its state tile (the host's `TileMove`).
constexpr int MOVE_DIRECT = 0; // global memory <-> registers
constexpr int MOVE_STAGED = 1; // in through shared memory by cp.async, out from registers
constexpr int MOVE_BULK = 2;   // in and out through shared memory by bulk copies
constexpr int MOVE_BULK_IN = 3; // in through shared memory by bulk copies, out from registers
constexpr int MOVE_STREAM = 4;  // as MOVE_BULK, the token step streamed from shared memory
constexpr int MOVE_REGS = 5;    // global memory <-> registers, a whole row per warp access

// kda_eager_regs: a whole head per CTA of 8 warps, held in registers: K-first pools with K = V
// = 128 (REGS_OK) only. Warp j holds rows 16 j .. 16 j + 15, the rows of lane group j of the
// other kernels, lane l columns 4 l .. 4 l + 3 of each (one word: 8 bytes of a 2-byte pool, 16
// of an fp32 one), so each load or store of a warp moves a whole row. token_step_regs keeps the
// other kernels' order of operations: a thread's sums run down its 16 rows in order and the
// eight warps' sums are added as reduce_k adds the lane groups', so the bits are theirs.
constexpr bool REGS_OK = !VFIRST && K == 128 && V == 128 && TK == 16 && LK == 8;
constexpr int RW = REGS_OK ? 16 : 1; // words of a thread: one per row
// A thread's word of a row: four elements of the pool's type.
typedef typename KdaRaw<4 * sizeof(ST)>::t RegsWord;
// Whether token_step_regs unpacks the words again for its update rather than keep what it
// unpacked for k S: bf16 pools (regs_opaque).
template <typename T> struct KdaIsBf16 {
    static constexpr bool value = false;
};
template <> struct KdaIsBf16<kda_bf16> {
    static constexpr bool value = true;
};
constexpr bool REGS_AFRESH = REGS_OK && KdaIsBf16<ST>::value;
// Of a thread's RW rows the first RR in registers, the other RS in shared memory (copied in by
// cp.async, each thread reading back only its own words, so no barrier): 8 for bf16 pools,
// which then fit 4 CTAs per SM in 64 registers without a spill (REGS_CTAS; H200, fifty-third
// session: 1.3-2.0% faster at 3072-8192 heads, 0.5% at 2048, 0.4% slower at 1536); 16 for
// fp16 pools (at 8 rows and 4 CTAs 12 bytes spilled, 3.6-5.7% slower; 4 rows at 5 CTAs 0.5-3.9%
// slower but for -0.6% at 8192 heads) and fp32 ones (8 rows at 4 CTAs 2.8-8.8% slower, 12 at 3
// 0.1-1.6% slower).
constexpr int RR = REGS_OK ? (REGS_AFRESH ? 8 : 16) : 1;
constexpr int RS = REGS_OK ? RW - RR : 0;
// CTAs of kda_eager_regs per SM its registers are built for: 2 for fp32 pools (their 64 KB heads
// take 64 registers of words alone; 104 registers, no spill), 4 for bf16 ones (RR), 3 for fp16
// ones (80 registers; the nearest path spills none, the stochastic one 44-52 bytes; at 4, 64
// registers, the nearest path spilled 88-92 bytes).
constexpr int REGS_CTAS = sizeof(ST) == 4 ? 2 : RS > 0 ? 4 : 3;

// Makes a 2-byte pool's word opaque to the compiler (no instruction), so nothing computed from
// it before is reused after (a template, so only modules that use it compile it).
template <typename W> __device__ __forceinline__ void regs_opaque(W& w) {
    static_assert(sizeof(W) == 8, "regs_opaque: the word of a 2-byte pool");
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__)
    asm volatile("" : "+r"(w.x), "+r"(w.y));
#endif
}

// The shared-memory words of kda_eager_regs' threads: thread t's row RR + i at [i * 256 + t].
__device__ __forceinline__ RegsWord* regs_smem() {
    __shared__ RegsWord sm[RS > 0 ? RS * 256 : 1];
    return sm;
}

// The thread's words of the head (REGS_OK; otherwise nothing).
__device__ __forceinline__ void regs_load(const ST* head, RegsWord (&w)[RW]) {
    if constexpr (REGS_OK) {
        const int row0 = 16 * (int)(threadIdx.x >> 5), col0 = 4 * (int)(threadIdx.x & 31);
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            const RegsWord* src = reinterpret_cast<const RegsWord*>(head + (size_t)(row0 + i) * V + col0);
            if (i < RR) {
                w[i] = *src;
            } else if constexpr (sizeof(RegsWord) == 8) {
                cp_async8(regs_smem() + (i - RR) * 256 + threadIdx.x, src);
            } else {
                cp_async16(regs_smem() + (i - RR) * 256 + threadIdx.x, src);
            }
        }
        if constexpr (RS > 0) cp_async_commit();
    }
}
// The thread's word of row i (RR.. from shared memory).
__device__ __forceinline__ RegsWord regs_word(const RegsWord (&w)[RW], int i) {
    return i < RR ? w[i] : regs_smem()[(i - RR) * 256 + threadIdx.x];
}

// Element c (0..3) of a word as f32 (templates, so each module compiles only its own).
template <typename T = ST> __device__ __forceinline__ float regs_elem(const uint2& w, int c) {
    return kda_word_half<T>(c < 2 ? w.x : w.y, (c & 1) != 0);
}
template <typename T = ST> __device__ __forceinline__ float regs_elem(const uint4& w, int c) {
    return __uint_as_float(c == 0 ? w.x : c == 1 ? w.y : c == 2 ? w.z : w.w);
}

// Two consecutive elements (offsets e, e + 1) rounded stochastically by round_elem<true>,
// packed low first (a template, so only 2-byte modules compile it).
template <typename T = ST>
__device__ __forceinline__ kda_u32 regs_pack_sr(float lo, float hi, kda_u32 base, kda_u32 e) {
    const T a = round_elem<true>(lo, base, e), b = round_elem<true>(hi, base, e + 1u);
    return (kda_u32)kda_bits(a) | ((kda_u32)kda_bits(b) << 16);
}

// The sum of the eight lane groups' partial sums of column c (part[g * V + c]) in reduce_k's
// order.
__device__ __forceinline__ float regs_tree(const float* part, int c) {
    float a[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) a[g] = part[g * V + c];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// One eager token step on the words of kda_eager_regs, its updated head stored through the
// element type (nearest even, or stochastic with base and the head's offset elem0) and its
// outputs into op (V values). k, d, q: the activated key, decay and query rows; v: the values;
// the same operations in the same order as token_step_stream, so the same bits.
template <bool SR>
__device__ __forceinline__ void token_step_regs(const RegsWord (&w)[RW], ST* head, const float* k, const float* d,
                                                const float* q, const float* v, float beta, IT* op, kda_u32 base,
                                                kda_u32 elem0) {
    if constexpr (REGS_OK) {
        __shared__ __align__(16) float part[8 * V], us[V];
        const int j = (int)(threadIdx.x >> 5), row0 = 16 * j, col0 = 4 * (int)(threadIdx.x & 31);
        // (the rows' k, d and q read from shared memory where used, one broadcast per warp)
        k += row0;
        d += row0;
        q += row0;
        // 1) k S down the warp's 16 rows, the warps' sums in reduce_k's order
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if constexpr (RS > 0) cp_async_wait<0>();
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            const RegsWord wi = regs_word(w, i);
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[c] = fmaf(k[i], regs_elem(wi, c) * d[i], acc[c]);
        }
        *reinterpret_cast<float4*>(part + j * V + col0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (threadIdx.x < (unsigned)V) {
            const int c = (int)threadIdx.x;
            us[c] = beta * (v[c] - regs_tree(part, c));
        }
        __syncthreads();
        // 2) the rank-1 update, stored, and q S as in 1) (part is free again: its sums were
        // read before the barrier above)
        const float4 u4 = *reinterpret_cast<const float4*>(us + col0);
        const float u[4] = {u4.x, u4.y, u4.z, u4.w};
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            RegsWord wi = regs_word(w, i);
            // bf16: the word's elements unpacked afresh here, not kept from 1) (kept, 48 bytes
            // spilled at 80 registers, 4-5% slower; fp16 was 1.2-1.3% slower unpacked afresh,
            // forty-eighth session)
            if constexpr (REGS_AFRESH) regs_opaque(wi);
            float x[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                x[c] = fmaf(k[i], u[c], regs_elem(wi, c) * d[i]);
                o[c] = fmaf(q[i], x[c], o[c]);
            }
            const int r = row0 + i;
            if constexpr (sizeof(ST) == 4) {
                // (an f32 element stores as it is, nearest or stochastic)
                *reinterpret_cast<float4*>(head + (size_t)r * V + col0) = make_float4(x[0], x[1], x[2], x[3]);
            } else {
                kda_u32 y[2];
                if constexpr (SR) {
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const kda_u32 e = elem0 + (kda_u32)(r * V + col0 + 2 * m);
                        y[m] = regs_pack_sr(x[2 * m], x[2 * m + 1], base, e);
                    }
                } else {
#pragma unroll
                    for (int m = 0; m < 2; ++m) y[m] = kda_pack2_rn<ST>(x[2 * m], x[2 * m + 1]);
                }
                *reinterpret_cast<uint2*>(head + (size_t)r * V + col0) = make_uint2(y[0], y[1]);
            }
        }
        *reinterpret_cast<float4*>(part + j * V + col0) = make_float4(o[0], o[1], o[2], o[3]);
        __syncthreads();
        if (threadIdx.x < (unsigned)V) op[threadIdx.x] = KdaElem<IT>::from_f32(regs_tree(part, (int)threadIdx.x));
    }
}

// A K-first tile in shared memory for bulk copies: K rows of cw columns, the TK rows of lane
// group lk shifted by lk WC elements. The lanes of a column group read the same columns of rows
// TK apart; with rows of a multiple of 128 bytes they would all meet the same banks, shifted
// they meet LK different ones. (A bulk copy moves one contiguous block, so the swizzle of the
// staged tiles, by 16-byte chunks within a row, is not open to it; a shift per row is.)
__device__ __forceinline__ int bulk_row(int row, int cw) { return row * cw + (row / TK) * WC; }

// Issues, on the lanes of one warp, the bulk copies of an item's tile (columns cb.., cwv
// valid) between the value head at `head` and the tile at `t` in shared memory (V-first: one
// block [cwv][K]; K-first: K rows laid out by bulk_row, a lane group's TK rows as one block
// where the item is the whole head, else row by row). IN: into the tile, lane 0 first telling
// `bar` the bytes to come; else out to the head (the caller then waits, bulk_out_done).
template <bool IN>
__device__ __forceinline__ void tile_bulk(ST* t, ST* head, int cb, int cw, int cwv, kda_u64* bar, int lane) {
    const kda_u32 rowb = (kda_u32)cwv * sizeof(ST);
    if constexpr (IN) {
        if (lane == 0) bulk_bar_expect(bar, (kda_u32)K * rowb);
        KDA_SYNCWARP();
    }
    if constexpr (VFIRST) {
        if (lane == 0) {
            if constexpr (IN) {
                bulk_in(t, head + (size_t)cb * K, (kda_u32)K * rowb, bar);
            } else {
                bulk_out(head + (size_t)cb * K, t, (kda_u32)K * rowb);
            }
        }
    } else if (cw == V) {
        for (int r = lane * TK; r < K; r += 32 * TK) {
            const kda_u32 b = (kda_u32)cmin(TK, K - r) * rowb;
            if constexpr (IN) {
                bulk_in(t + bulk_row(r, cw), head + (size_t)r * V, b, bar);
            } else {
                bulk_out(head + (size_t)r * V, t + bulk_row(r, cw), b);
            }
        }
    } else {
        for (int r = lane; r < K; r += 32) {
            if constexpr (IN) {
                bulk_in(t + bulk_row(r, cw), head + (size_t)r * V + cb, rowb, bar);
            } else {
                bulk_out(head + (size_t)r * V + cb, t + bulk_row(r, cw), rowb);
            }
        }
    }
}

// Elements of one piece of a lane's tile (load_tile's vectors: K-first a row's TV columns,
// V-first RG rows of one column), pieces per lane, and whether a piece is one vector.
constexpr int PE = VFIRST ? RG : TV;
constexpr int NPC = VFIRST ? TV * NG : TK;
constexpr bool PIECE_VEC = VFIRST ? RG > 1 : KF_VEC;
static_assert(!PIECE_VEC || sizeof(ST) != 2 || PE == 4 || PE == 8, "a 2-byte piece vector of 4 or 8 elements");

// Piece i of the lane's tile in a bulk tile (columns from col0, relative to the item's first;
// col0 = V for a lane past the item's columns, whose pieces are all outside): its first
// element's offset, first K row and first column (relative). Every column's rows come in
// ascending order over i, the order of token_step's sums.
struct TilePiece {
    int off, row, col;
    bool whole; // its vector load fits (K-first: the row, and col0 valid; V-first: the column)
};
__device__ __forceinline__ TilePiece tile_piece(int i, int lk, int col0, int rs) {
    if constexpr (!VFIRST) {
        const int kr = row_of(lk, i);
        return {kr * rs + col0, kr, col0, kr < K && col0 < V};
    } else {
        const int c = i / NG, k0 = ((i % NG) * LK + lk) * RG, col = col0 + c;
        return {col * K + k0, k0, col, col < V && k0 < K};
    }
}
// Row and lane column (0..TV) of element e of piece i, and its offset in the head as the
// stochastic stream counts it (store_tile's: K-first rows of V).
__device__ __forceinline__ int piece_row(const TilePiece& t, int e) { return VFIRST ? t.row + e : t.row; }
__device__ __forceinline__ int piece_c(int i, int e) { return VFIRST ? i / NG : e; }
__device__ __forceinline__ kda_u32 piece_elem(const TilePiece& t, int e) {
    return (kda_u32)(VFIRST ? t.col * K + t.row + e : t.row * V + t.col + e);
}

// The elements of a piece as f32 (0 outside the tile, as load_tile).
__device__ __forceinline__ void piece_load(const ST* bt, const TilePiece& t, float (&x)[PE]) {
    if constexpr (PIECE_VEC) {
        if (t.whole) {
            kda_load_vec<ST, PE>(bt + t.off, x);
        } else {
#pragma unroll
            for (int e = 0; e < PE; ++e) x[e] = 0.0f;
        }
    } else {
#pragma unroll
        for (int e = 0; e < PE; ++e) {
            const bool in = VFIRST ? t.whole : (t.row < K && t.col + e < V);
            x[e] = in ? kda_load(bt[t.off + e]) : 0.0f;
        }
    }
}

// Calls f(i, piece, its elements as f32) for the lane's pieces i = 0.. of `tile` in order.
template <typename F>
__device__ __forceinline__ void for_each_piece(const ST* tile, int lk, int col0, int rs, F&& f) {
#pragma unroll
    for (int i = 0; i < NPC; ++i) {
        const TilePiece t = tile_piece(i, lk, col0, rs);
        float x[PE];
        piece_load(tile, t, x);
        f(i, t, x);
    }
}

// token_step for kda_eager_tile_stream: the lane's tile stays in the bulk tile `tile` (K-first
// rows of rs elements, the lane's shift applied) and is read twice, once for k S and once for
// the update and the read-out, which writes it back in place through the element type (as
// store_tile: the stochastic offsets from elem0, K-first rows of V). The same operations in the
// same order as token_step with `out`, so the same bits; few registers, so more CTAs per SM.
// PAD: k, d and q are rows in the padded layout (krow_at<true>, rows of KP), read per piece.
template <bool SR, bool PAD = false>
__device__ __forceinline__ void token_step_stream(ST* tile, int lk, int col0, int rs, const float* k, const float* d,
                                                  const float* q, const float* vp, int vlim, float beta,
                                                  float (&o)[TV], kda_u32 base, kda_u32 elem0) {
    if constexpr (PAD && !VFIRST) {
        // krow_at<true>(t.row): the lane group's rows start 4 lk words later (the reads index
        // t.row, no division, which kept the loads scalar)
        k += 4 * lk;
        d += 4 * lk;
        q += 4 * lk;
    }
    float acc[TV];
#pragma unroll
    for (int c = 0; c < TV; ++c) acc[c] = 0.0f;
    for_each_piece(tile, lk, col0, rs, [&](int i, const TilePiece& t, float (&x)[PE]) {
#pragma unroll
        for (int e = 0; e < PE; ++e) {
            const int r = piece_row(t, e), c = piece_c(i, e);
            acc[c] = fmaf(k[r], x[e] * d[r], acc[c]);
        }
    });
    reduce_k(acc);
    float u[TV];
#pragma unroll
    for (int c = 0; c < TV; ++c) {
        const float vv = c < vlim ? vp[c] : 0.0f;
        u[c] = beta * (vv - acc[c]);
        o[c] = 0.0f;
    }
    for_each_piece(tile, lk, col0, rs, [&](int i, const TilePiece& t, float (&x)[PE]) {
#pragma unroll
        for (int e = 0; e < PE; ++e) {
            const int r = piece_row(t, e), c = piece_c(i, e);
            x[e] = fmaf(k[r], u[c], x[e] * d[r]);
            o[c] = fmaf(q[r], x[e], o[c]);
        }
        if (col0 >= V) return; // a lane past the item's columns: sums only
        if constexpr (PIECE_VEC && !SR) {
            // (stochastic stores element by element: four hashes at once spilled registers)
            if (!t.whole) return;
            if constexpr (sizeof(ST) == 2) {
                // two elements per conversion instruction (same bits as one at a time)
                kda_u32 w[cmax(1, PE / 2)];
#pragma unroll
                for (int m = 0; m < PE / 2; ++m) w[m] = kda_pack2_rn<ST>(x[2 * m], x[2 * m + 1]);
                if constexpr (PE == 8) {
                    *reinterpret_cast<uint4*>(tile + t.off) = make_uint4(w[0], w[1], w[2], w[3]);
                } else {
                    *reinterpret_cast<uint2*>(tile + t.off) = make_uint2(w[0], w[1]);
                }
            } else {
                ST y[PE];
#pragma unroll
                for (int e = 0; e < PE; ++e) y[e] = round_elem<false>(x[e], 0u, 0u);
                kda_store_vec<ST, PE>(tile + t.off, y);
            }
        } else {
#pragma unroll
            for (int e = 0; e < PE; ++e) {
                const int r = piece_row(t, e), col = VFIRST ? t.col : t.col + e;
                if (r < K && col < V) tile[t.off + e] = round_elem<SR>(x[e], base, elem0 + piece_elem(t, e));
            }
        }
    });
    reduce_k(o);
}

// The head's offset in the slot's ssm plane, as the stochastic stream counts it, of a tile
// stored from the item's first column (IN_TILE: into its bulk tile, columns relative to cb) or
// from the head's.
template <bool IN_TILE>
__device__ __forceinline__ kda_u32 tile_elem0(size_t hv, int cb) {
    return (kda_u32)hv * (kda_u32)(K * V) + (IN_TILE ? (kda_u32)(VFIRST ? cb * K : cb) : 0u);
}

// Eager decode, one item per CTA (item = blockIdx.x, the grid covers the items): the state
// tile goes from global memory into registers with no pipeline; many CTAs per SM keep the loads
// in flight instead. MOVE (MOVE_*) says how the tile moves: straight into registers (DIRECT);
// in through shared memory (STAGED: cp.async of whole 16-byte chunks into the pipelined
// kernel's stage layout, so a warp's copies fetch whole tile rows); in by bulk copies into
// shared memory, waited for on an mbarrier, and out the same way (BULK) or from registers
// (BULK_IN). The token's inputs are loaded first: they do not depend on the
// slot, so their loads overlap the slot's, and the activations run while the tile's loads are
// in flight (with 4 warps or more: warp 0 the key, warp 1 the query, the other warps' threads
// the gates, values and beta, each role's loads in the same registers; with fewer warps they
// are loaded after the tile and split as in eager_run, by eager_activate). The same functions
// as eager_run and kda_step, so the same bits.
// A dependent launch reads the item's slot before its wait (early_slot: the slots are the
// host's) for the L2 prefetch. With p.early == EARLY_SLOT_ONCE the tile is loaded from that slot
// too; otherwise the slot is read again after the wait, which puts one more L2 round trip into
// the CTA's chain but measured faster for some K-first shapes (`slot_once_for` in eager_plan.rs).
// fp32 K-first bulk tiles always read it again (SLOT_AGAIN), compiled so: as a runtime choice
// the branch alone cost them 0.2-0.9% on the H200.
template <int MOVE>
__device__ __forceinline__ void eager_tile_run(const KdaParams& p) {
    constexpr bool STAGED = MOVE == MOVE_STAGED, STREAM = MOVE == MOVE_STREAM, REGS = MOVE == MOVE_REGS;
    constexpr bool BULK = MOVE == MOVE_BULK || MOVE == MOVE_BULK_IN || STREAM;
    constexpr bool BULK_OUT = MOVE == MOVE_BULK || STREAM;
    constexpr bool SLOT_AGAIN = BULK && !VFIRST && sizeof(ST) == 4;
    extern __shared__ __align__(16) unsigned char eager_dsm[];
    __shared__ kda_u64 bulk_bar;
    __shared__ __align__(16) float ak[KS], ad[KS], aq[KS], av[VS];
    __shared__ float abeta;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int lk = lane / LV, lv = lane % LV;
    const int cw = nwarps * WC;
    const kda_u32 item = blockIdx.x;
    if (padding_cta(p)) return;
    kda_u32 slot = 0u;
#if KDA_GRID_DEPENDENCY
    if (p.early != 0u) {
        slot = early_slot(p, eager_seq(p, item));
        prefetch_item(p, item, slot, cw);
    }
#endif
    KDA_DEPENDENT_LAUNCH();
    if (item == 0 && threadIdx.x == 0) atomicOr(reinterpret_cast<kda_u32*>(p.err) + 2, 1u);
    const EagerItem it = eager_item(p, item, 0u); // its coordinates; the slot is loaded below
    const int cwv = cmin(cw, V - it.cb);
    const size_t tok = it.tok, hv = (size_t)it.hv;
    const size_t h = kda_div((kda_u32)it.hv, p.div_grp);
    const IT* kp = reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K;
    const IT* qp = reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K;
    const IT* gp = reinterpret_cast<const IT*>(p.g) + (tok * p.hv + hv) * K;
    const IT* vp = reinterpret_cast<const IT*>(p.v) + (tok * p.hv + hv) * V + it.cb;
    const float* bias = reinterpret_cast<const float*>(p.dt_bias) + hv * K;
    const IT* bp = reinterpret_cast<const IT*>(p.beta) + tok * p.hv + hv;
    const bool l2 = p.l2norm != 0u;

    const bool early = EARLY_FITS && nwarps >= 4;
    const int tid = (int)threadIdx.x - 64, dn = (int)blockDim.x - 64; // the gate threads
    // The loads' bits, converted to f32 only after the tile's loads are issued: a conversion
    // right after its load (where the compiler puts it) would make the warp wait for the inputs
    // before it even loads the slot.
    kda_u32 x[KL];               // warp 0: key, warp 1: query, gate threads: raw gates, biases
    kda_u32 vr[VPT], braw = 0u;
    float alog = 0.0f;
    if (early) {
        if (warp == 0 || warp == 1) {
            const IT* src = warp == 0 ? kp : qp;
#pragma unroll
            for (int i = 0; i < KL; ++i) {
                const int kk = lane + 32 * i;
                x[i] = kk < K ? input_bits(src + kk) : 0u;
            }
        } else {
#pragma unroll
            for (int j = 0; j < DKE; ++j) {
                const int kk = tid + j * dn;
                x[j] = kk < K ? input_bits(gp + kk) : 0u;
                x[DKE + j] = kk < K && p.gate_mode != 0u ? __float_as_uint(bias[kk]) : 0u;
            }
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int c = tid + j * dn;
                vr[j] = c < cwv ? input_bits(vp + c) : 0u;
            }
            if (tid == 0) braw = input_bits(bp);
            if (p.gate_mode != 0u) alog = reinterpret_cast<const float*>(p.a_log)[hv];
        }
    }

    if (SLOT_AGAIN || !KDA_GRID_DEPENDENCY || p.early != EARLY_SLOT_ONCE)
        slot = reinterpret_cast<const kda_u32*>(p.slots)[eager_seq(p, item)];
    ST* head = state_head(p, slot, hv);
    const int col0l = warp * WC + lv * TV, col0 = it.cb + col0l;
    float s[TK][TV];
    kda_u32 w[TW];
    RegsWord wr[RW];
    ST* const bt = reinterpret_cast<ST*>(eager_dsm); // the bulk tile
    if constexpr (REGS) {
        regs_load(head, wr);
    } else if constexpr (BULK) {
        if (warp == 0) {
            if (lane == 0) bulk_bar_init(&bulk_bar);
            KDA_SYNCWARP();
            tile_bulk<true>(bt, head, it.cb, cw, cwv, &bulk_bar, lane);
        }
    } else if constexpr (STAGED) {
        tile_issue(eager_dsm, head, it.cb, cw, cwv);
        cp_async_commit();
    } else if constexpr (TILE_WORDS) {
        load_tile_words(head, lk, col0l < cwv ? col0 : V, w);
    } else {
        load_tile(head, lk, col0l < cwv ? col0 : V, s);
    }

    if (early) {
        if (warp == 0 || warp == 1) {
            float xf[KL];
#pragma unroll
            for (int i = 0; i < KL; ++i) xf[i] = input_from_bits(x[i]);
            if (warp == 0) {
                act_finish(xf, ak, l2, false, p.scale, lane);
            } else {
                act_finish(xf, aq, l2, true, p.scale, lane);
            }
        } else {
            const float a_exp = p.gate_mode ? expf(alog) : 0.0f;
#pragma unroll
            for (int j = 0; j < DKE; ++j) {
                const int kk = tid + j * dn;
                const float b = __uint_as_float(x[DKE + j]);
                if (kk < K) ad[kk] = decay_at(input_from_bits(x[j]), &b, p, a_exp);
            }
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int c = tid + j * dn;
                if (c < cwv) av[c] = input_from_bits(vr[j]);
            }
            if (tid == 0) abeta = act_beta(input_from_bits(braw), p);
        }
    } else {
        eager_activate(p, kp, qp, gp, bias, vp, cwv, kda_load(*bp),
                       p.gate_mode ? reinterpret_cast<const float*>(p.a_log)[hv] : 0.0f, ak, aq, ad, av, &abeta);
    }
    if constexpr (STAGED) cp_async_wait<0>();
    __syncthreads();
    // the lane's part of the bulk tile: K-first, its rows' shift (bulk_row); columns relative
    // to the item's first
    ST* const bl = bt + (VFIRST ? 0 : lk * WC);
    const int bcol = col0l < cwv ? col0l : V;
    if constexpr (REGS) {
        // the words stay in registers (token_step_regs)
    } else if constexpr (BULK) {
        bulk_bar_wait(&bulk_bar);
        if constexpr (STREAM) {
            // the tile stays in shared memory (token_step_stream)
        } else if constexpr (TILE_WORDS) {
            load_tile_words(bl, lk, bcol, w, cw);
            tile_from_words(w, s);
        } else {
            load_tile(bl, lk, bcol, s, cw);
        }
    } else if constexpr (STAGED) {
        tile_from_stage(reinterpret_cast<const ST*>(eager_dsm), lk, col0l, cwv, cw, s);
    } else if constexpr (TILE_WORDS) {
        tile_from_words(w, s);
    }
    if constexpr (REGS) {
        IT* const op = reinterpret_cast<IT*>(p.out) + (tok * p.hv + hv) * V;
        const kda_u32 elem0 = tile_elem0<false>(hv, 0);
        if (p.sr) {
            const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;
            token_step_regs<true>(wr, head, ak, ad, aq, av, abeta, op, kda_sr_base(seed, p.layer, slot, call_epoch(p)), elem0);
        } else {
            token_step_regs<false>(wr, head, ak, ad, aq, av, abeta, op, 0u, elem0);
        }
        return;
    }
    float o[TV];
    if constexpr (STREAM) {
        const kda_u32 elem0 = tile_elem0<true>(hv, it.cb);
        if (p.sr) {
            const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;
            token_step_stream<true>(bl, lk, bcol, cw, ak, ad, aq, av + col0l, cwv - col0l, abeta, o,
                                    kda_sr_base(seed, p.layer, slot, call_epoch(p)), elem0);
        } else {
            token_step_stream<false>(bl, lk, bcol, cw, ak, ad, aq, av + col0l, cwv - col0l, abeta, o, 0u, elem0);
        }
    } else {
        token_step(s, ak, ad, aq, av + col0l, cwv - col0l, abeta, lk, true, o);
    }
    if (!BULK_OUT && col0l >= cwv) return;
    if (col0l < cwv) {
        if (lk == 0) store_out(reinterpret_cast<IT*>(p.out) + (tok * p.hv + hv) * V + col0, o, col0);
        // BULK_OUT: into the bulk tile where it came from (columns relative to the item's
        // first), then out by bulk copies below
        ST* const dst = BULK_OUT ? bl : head;
        const int dcol = BULK_OUT ? col0l : col0;
        const kda_u32 elem0 = tile_elem0<BULK_OUT>(hv, it.cb);
        const int rs = BULK_OUT ? cw : V;
        if constexpr (STREAM) {
            // there already (token_step_stream)
        } else if (p.sr) {
            const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;
            store_tile<true>(dst, lk, dcol, s, kda_sr_base(seed, p.layer, slot, call_epoch(p)), elem0, rs);
        } else {
            store_tile<false>(dst, lk, dcol, s, 0u, elem0, rs);
        }
    }
    if constexpr (BULK_OUT) {
        bulk_fence();
        __syncthreads();
        if (warp == 0) {
            tile_bulk<false>(bt, head, it.cb, cw, cwv, &bulk_bar, lane);
            bulk_out_done();
        }
    }
}

extern "C" __global__ void KDA_EAGER_TILE_BOUNDS kda_eager_tile(const KdaParams p) {
    eager_tile_run<MOVE_DIRECT>(p);
}

// kda_eager_tile with its tile copied in through shared memory (dynamic: K x the CTA's columns).
extern "C" __global__ void KDA_EAGER_TILE_BOUNDS kda_eager_tile_staged(const KdaParams p) {
    eager_tile_run<MOVE_STAGED>(p);
}

// kda_eager_tile with its tile moved in and out by bulk copies through shared memory (dynamic:
// the bulk tile, K x the CTA's columns and, K-first, LK x WC elements of row shifts).
extern "C" __global__ void KDA_EAGER_TILE_BOUNDS kda_eager_tile_bulk(const KdaParams p) {
    eager_tile_run<MOVE_BULK>(p);
}

// kda_eager_tile_bulk with its updated tile stored from registers, as kda_eager_tile does.
extern "C" __global__ void KDA_EAGER_TILE_BOUNDS kda_eager_tile_bulk_in(const KdaParams p) {
    eager_tile_run<MOVE_BULK_IN>(p);
}

// CTAs of 8 warps per SM that kda_eager_tile_stream's registers allow: for 2-byte K-first pools
// as many as their bulk tiles of whole heads fit in shared memory (6 at K = V = 128, 40
// registers; the launch asks for the shared memory of 5, which measured faster, and keeps
// these registers: STREAM_CTAS_PER_SM in eager_plan.rs); 3 for fp32 pools (their 64 KB tiles
// fit 3 times) and 2-byte V-first pools (with fewer than 80 registers they spilled).
#define KDA_EAGER_STREAM_CTAS (sizeof(KDA_ST) == 4 || KDA_VFIRST ? 3 : 6)

// kda_eager_tile with the whole head in registers, a whole row per warp access
// (token_step_regs; K-first pools with K = V = 128 only, the host's plan); same bits.
extern "C" __global__ void __launch_bounds__(256, REGS_CTAS) kda_eager_regs(const KdaParams p) {
    if constexpr (REGS_OK) eager_tile_run<MOVE_REGS>(p);
}

// kda_eager_tile_bulk with its token step streamed from the bulk tile (token_step_stream), so
// a thread holds no tile in registers and more CTAs share an SM; same bits.
extern "C" __global__ void __launch_bounds__(256, KDA_EAGER_STREAM_CTAS) kda_eager_tile_stream(const KdaParams p) {
    eager_tile_run<MOVE_STREAM>(p);
}

// ---------------------------------------------------------------------------------------------
// kda_eager_bulk_pipe: eager decode of whole heads (cw = V) by persistent CTAs whose warps each
// have one role, over a ring of p.stages buffers in shared memory (a head's bulk tile, its
// token's input rows and scalars). With G step groups (blockDim.x = (8 G + 2) 32) item t of the
// CTA (blockIdx.x + t gridDim.x) goes to buffer t % p.stages and step group t % G:
// - the loader warp (warp 8 G): reads the slots, betas and a_logs of its next 32 items at once
//   (one round trip per 32 items), then for each item waits until its buffer is empty and
//   fills it by bulk copies (the tile, the key, query, gate and value rows, the gate biases),
//   which complete on the buffer's `full` barrier;
// - the step groups (8 warps each, their own named barrier): activate the inputs from the
//   buffer, run token_step_stream on its tile (written back in place) and store the outputs,
//   then mark the buffer `computed`;
// - the storer warp (warp 8 G + 1): bulk-stores each computed tile to its head, in order, and
//   marks the buffer `empty` once the copies have read it.
// So the loads of the next items, the steps of these and the stores of the last ones overlap in
// every CTA, and no CTA exits between two heads. Waits are on a barrier phase's parity, so no
// waiter may be two phases behind: p.stages is a multiple of G (the host's `pipe_buffers`),
// and a group's wait on a buffer follows its own earlier item there. The same functions as the
// other eager kernels in the same order, so the same bits. sm_90 and later only (the host
// launches it only where bulk copies exist).
constexpr int PIPE_WARPS = 8;      // warps of one step group
constexpr int PIPE_MAX_GROUPS = 3; // step groups per CTA: (blockDim.x / 32 - 2) / PIPE_WARPS
constexpr int PIPE_THREADS = (PIPE_MAX_GROUPS * PIPE_WARPS + 2) * 32;
constexpr int PIPE_MAX_BUFFERS = 8;
constexpr kda_u32 PIPE_ALIGN = 128;

// One buffer's layout (bytes from its start): the bulk tile of a whole head (bulk_row layout,
// K-first), the key, query and gate rows, the value row, the gate biases, then the scalars
// (raw beta bits, a_log, slot).
struct PipeBuffer {
    int k, q, g, v, bias, scal, bytes;
    __device__ __forceinline__ PipeBuffer() {
        const int tile = (K * V + (VFIRST ? 0 : LK * WC)) * (int)sizeof(ST);
        k = roundup(tile, 16);
        q = k + roundup(K * (int)sizeof(IT), 16);
        g = q + roundup(K * (int)sizeof(IT), 16);
        v = g + roundup(K * (int)sizeof(IT), 16);
        bias = v + roundup(V * (int)sizeof(IT), 16);
        scal = bias + roundup(K * 4, 16);
        bytes = roundup(scal + 16, 128);
    }
};

#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_wait(kda_u64* bar, kda_u32 parity) {
    kda_u32 done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    }
}
__device__ __forceinline__ void mbar_arrive(kda_u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// A step group's own barrier (named barrier 1 + group), leaving the other warps out.
__device__ __forceinline__ void pipe_step_sync(int group) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "n"(PIPE_WARPS * 32) : "memory");
}

// The loader warp: fills the buffers with this CTA's items in order. (Its tile copies and the
// storer's are tile_bulk's for a whole head, written out here: the same kernel issuing them
// through tile_bulk measured 3.7% slower at 768 heads on the H200, thirty-second session.)
__device__ __forceinline__ void pipe_load(const KdaParams& p, unsigned char* dsm, kda_u64* full, kda_u64* empty,
                                          kda_u32 total, int nb, int lane) {
    const PipeBuffer L;
    const kda_u32 step = gridDim.x;
    kda_u32 t = 0;
    for (kda_u32 base = blockIdx.x; base < total; base += 32u * step) {
        // the scalars of items base + l step, lane l
        const kda_u32 mine = base + (kda_u32)lane * step;
        kda_u32 slot = 0u, braw = 0u, alog = 0u;
        if (mine < total) {
            const kda_u32 n = eager_seq(p, mine), hv = mine - n * p.hv;
            slot = reinterpret_cast<const kda_u32*>(p.slots)[n];
            braw = input_bits(reinterpret_cast<const IT*>(p.beta) + (size_t)n * p.hv + hv);
            if (p.gate_mode != 0u) alog = reinterpret_cast<const kda_u32*>(p.a_log)[hv];
        }
        const kda_u32 cnt = cmin(32, (int)((total - base + step - 1) / step));
        for (kda_u32 i = 0; i < cnt; ++i, ++t) {
            const kda_u32 item = base + i * step;
            const kda_u32 s = KDA_SHFL(slot, (int)i), b = KDA_SHFL(braw, (int)i), a = KDA_SHFL(alog, (int)i);
            const int bi = (int)(t % (kda_u32)nb);
            const kda_u32 round = t / (kda_u32)nb;
            unsigned char* buf = dsm + bi * L.bytes;
            if (round > 0u) mbar_wait(&empty[bi], (round - 1u) & 1u);
            const kda_u32 n = eager_seq(p, item), hv = item - n * p.hv;
            const size_t h = kda_div(hv, p.div_grp);
            const bool gated = p.gate_mode != 0u;
            if (lane == 0) {
                kda_u32* sc = reinterpret_cast<kda_u32*>(buf + L.scal);
                sc[0] = b;
                sc[1] = a;
                sc[2] = s;
                const kda_u32 rows = (kda_u32)(3 * K + V) * sizeof(IT) + (gated ? (kda_u32)K * 4u : 0u);
                bulk_bar_expect(&full[bi], (kda_u32)(K * V) * sizeof(ST) + rows);
            }
            KDA_SYNCWARP();
            ST* const head = state_head(p, s, hv);
            ST* const tile = reinterpret_cast<ST*>(buf);
            if constexpr (VFIRST) {
                if (lane == 0) bulk_in(tile, head, (kda_u32)(K * V) * sizeof(ST), &full[bi]);
            } else {
                for (int r = lane * TK; r < K; r += 32 * TK)
                    bulk_in(tile + bulk_row(r, V), head + (size_t)r * V, (kda_u32)(cmin(TK, K - r) * V) * sizeof(ST),
                            &full[bi]);
            }
            const size_t tk = (size_t)n * p.h + h, tv = (size_t)n * p.hv + hv;
            const kda_u32 kb = (kda_u32)K * sizeof(IT);
            if (lane == 27) bulk_in(buf + L.k, reinterpret_cast<const IT*>(p.k) + tk * K, kb, &full[bi]);
            if (lane == 28) bulk_in(buf + L.q, reinterpret_cast<const IT*>(p.q) + tk * K, kb, &full[bi]);
            if (lane == 29) bulk_in(buf + L.g, reinterpret_cast<const IT*>(p.g) + tv * K, kb, &full[bi]);
            if (lane == 30)
                bulk_in(buf + L.v, reinterpret_cast<const IT*>(p.v) + tv * V, (kda_u32)V * sizeof(IT), &full[bi]);
            if (lane == 31 && gated)
                bulk_in(buf + L.bias, reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K, (kda_u32)K * 4u,
                        &full[bi]);
        }
    }
}

// The storer warp: stores each computed tile to its head, then frees its buffer.
__device__ __forceinline__ void pipe_store(const KdaParams& p, unsigned char* dsm, kda_u64* computed,
                                           kda_u64* empty, kda_u32 total, int nb, int lane) {
    const PipeBuffer L;
    kda_u32 t = 0;
    for (kda_u32 item = blockIdx.x; item < total; item += gridDim.x, ++t) {
        const int bi = (int)(t % (kda_u32)nb);
        unsigned char* buf = dsm + bi * L.bytes;
        mbar_wait(&computed[bi], (t / (kda_u32)nb) & 1u);
        const kda_u32 n = eager_seq(p, item), hv = item - n * p.hv;
        const kda_u32 s = reinterpret_cast<const kda_u32*>(buf + L.scal)[2];
        ST* const head = state_head(p, s, hv);
        const ST* const tile = reinterpret_cast<const ST*>(buf);
        if constexpr (VFIRST) {
            if (lane == 0) bulk_out(head, tile, (kda_u32)(K * V) * sizeof(ST));
        } else {
            for (int r = lane * TK; r < K; r += 32 * TK)
                bulk_out(head + (size_t)r * V, tile + bulk_row(r, V), (kda_u32)(cmin(TK, K - r) * V) * sizeof(ST));
        }
        bulk_out_done();
        KDA_SYNCWARP();
        if (lane == 0) mbar_arrive(&empty[bi]);
    }
}

// The token-step warps: each item's activation and token step, in the buffer.
__device__ __forceinline__ void pipe_step(const KdaParams& p, unsigned char* dsm, kda_u64* full, kda_u64* computed,
                                          kda_u32 total, int nb, int groups, int gw, int lane) {
    // (the rows in token_step_stream's padded layout)
    __shared__ __align__(16) float sk[PIPE_MAX_GROUPS][KP], sd[PIPE_MAX_GROUPS][KP], sq[PIPE_MAX_GROUPS][KP],
        sv[PIPE_MAX_GROUPS][VS];
    __shared__ float sbeta[PIPE_MAX_GROUPS];
    const int group = gw / PIPE_WARPS, warp = gw % PIPE_WARPS;
    float *const ak = sk[group], *const ad = sd[group], *const aq = sq[group], *const av = sv[group];
    float& abeta = sbeta[group];
    const PipeBuffer L;
    const int lk = lane / LV, lv = lane % LV;
    const int col0l = warp * WC + lv * TV;
    const int bcol = col0l < V ? col0l : V;
    const bool l2 = p.l2norm != 0u;
    const kda_u64 seed = ((kda_u64)p.seed_hi << 32) | p.seed_lo;
    // the group's items: the CTA's items t = group, group + groups, ...
    kda_u32 t = (kda_u32)group;
    for (kda_u32 item = blockIdx.x + t * gridDim.x; item < total;
         item += (kda_u32)groups * gridDim.x, t += (kda_u32)groups) {
        const int bi = (int)(t % (kda_u32)nb);
        unsigned char* buf = dsm + bi * L.bytes;
        mbar_wait(&full[bi], (t / (kda_u32)nb) & 1u);
        const kda_u32 n = eager_seq(p, item), hv = item - n * p.hv;
        const kda_u32* sc = reinterpret_cast<const kda_u32*>(buf + L.scal);
        if (warp == 0) {
            act_row<false, true>(reinterpret_cast<const IT*>(buf + L.k), ak, l2, false, p.scale, lane);
        } else if (warp == 1) {
            act_row<false, true>(reinterpret_cast<const IT*>(buf + L.q), aq, l2, true, p.scale, lane);
        } else if (warp == 2) {
            const float a_exp = p.gate_mode ? expf(__uint_as_float(sc[1])) : 0.0f;
            act_decay<true>(reinterpret_cast<const IT*>(buf + L.g), reinterpret_cast<const float*>(buf + L.bias), ad, p,
                      a_exp, lane);
        } else if (warp == 3) {
            const IT* vr = reinterpret_cast<const IT*>(buf + L.v);
            for (int c = lane; c < V; c += 32) av[c] = kda_load(vr[c]);
            if (lane == 0) abeta = act_beta(input_from_bits(sc[0]), p);
        }
        pipe_step_sync(group);
        ST* const bl = reinterpret_cast<ST*>(buf) + (VFIRST ? 0 : lk * WC);
        const kda_u32 elem0 = tile_elem0<true>(hv, 0);
        float o[TV];
        if (p.sr) {
            token_step_stream<true, true>(bl, lk, bcol, V, ak, ad, aq, av + col0l, V - col0l, abeta, o,
                                          kda_sr_base(seed, p.layer, sc[2], call_epoch(p)), elem0);
        } else {
            token_step_stream<false, true>(bl, lk, bcol, V, ak, ad, aq, av + col0l, V - col0l, abeta, o, 0u,
                                           elem0);
        }
        if (lk == 0 && col0l < V) store_out(reinterpret_cast<IT*>(p.out) + ((size_t)n * p.hv + hv) * V + col0l, o, col0l);
        bulk_fence();
        // every warp of the group is past this item's activations and tile before the next
        // item's activations overwrite ak.. and the storer reads the tile
        pipe_step_sync(group);
        if (warp == 0 && lane == 0) mbar_arrive(&computed[bi]);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(PIPE_THREADS, 1) kda_eager_bulk_pipe(const KdaParams p) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) unsigned char eager_dsm[];
    __shared__ kda_u64 full[PIPE_MAX_BUFFERS], computed[PIPE_MAX_BUFFERS], empty[PIPE_MAX_BUFFERS];
    // the buffers from a 128-byte boundary (the host adds PIPE_ALIGN bytes): bulk copies into
    // buffers only 16-byte aligned measured 10-20% slower on the H200 (thirty-first session)
    unsigned char* const dsm = eager_dsm + ((PIPE_ALIGN - (smem_addr(eager_dsm) & (PIPE_ALIGN - 1))) & (PIPE_ALIGN - 1));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = ((int)(blockDim.x >> 5) - 2) / PIPE_WARPS;
    const int nb = cmin((int)p.stages, PIPE_MAX_BUFFERS);
    const kda_u32 total = live_seqs(p) * p.hv;
    if (threadIdx.x < (unsigned)nb) {
        bulk_bar_init(&full[threadIdx.x]);
        bulk_bar_init(&computed[threadIdx.x]);
        bulk_bar_init(&empty[threadIdx.x]);
    }
    __syncthreads();
    KDA_DEPENDENT_LAUNCH();
    if (blockIdx.x == 0 && threadIdx.x == 0 && total > 0) atomicOr(reinterpret_cast<kda_u32*>(p.err) + 2, 1u);
    if (warp == groups * PIPE_WARPS) {
        pipe_load(p, dsm, full, empty, total, nb, lane);
    } else if (warp == groups * PIPE_WARPS + 1) {
        pipe_store(p, dsm, computed, empty, total, nb, lane);
    } else {
        pipe_step(p, dsm, full, computed, total, nb, groups, warp, lane);
    }
#endif
}
