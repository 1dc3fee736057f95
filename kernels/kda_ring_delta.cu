// Ring decode and spec_verify over stored delta vectors (kda_ring_delta): kda_ring_tile's items
// (sequence, value head, block of RCW columns), one per CTA, its lane mapping, tile in registers
// and row copies; what differs is that an item does not replay its pending entries. Every entry
// this kernel appends leaves its delta vector u_j = beta_j (v_j - (diag(d_j) S_{j-1})^T k_j)
// (f32, [HV][V] per entry) in the pool's delta plane, and the ring record counts the entries
// whose vectors are there (RingMeta::cached; every other kernel writes 0). A verify's drafts
// are appended too, and the accepted ones are a prefix, so their vectors stay valid. With S the
// tile's state (the committed one, or the one after a commit), the item's tokens 0 .. (the
// pending entries, then the new ones) with decays d_t, P_t = d_0 ... d_t and
// R_tj = d_{j+1} ... d_t (products of decays, never quotients), the state after tokens 0 .. t-1 is
//   S_{t-1} = diag(P_{t-1}) S + sum_{j<t} (R_{t-1,j} k_j) u_j^T,
// so each new token t needs only two products with the tile, which is read and never written:
//   u_t = beta_t (v_t - S^T (P_t k_t) - sum_{j<t} c_tj u_j),   c_tj = sum_k k_t R_tj k_j,
//   o_t = S^T (P_t q_t) + sum_{j<t} e_tj u_j + (q_t . k_t) u_t,   e_tj = sum_k q_t R_tj k_j,
// the new tokens in order (u_t needs the u_j of the drafts before it): two multiply-adds per
// element and new token instead of kda_ring_tile's three per pending entry and four per new
// token, plus a reduction each. A commit is the rank-pend update above, rounded to nearest
// once. An item whose pending entries lack stored vectors (another kernel appended them)
// replays them with kda_step's token step, as kda_ring_tile does, and stores their vectors on
// the way, so the next call takes the short path. Any number of new tokens per sequence
// (decode, spec_verify) or none (replay). Nearest rounding only, as kda_ring_tile. The f32
// arithmetic differs from kda_step's order on the short path, so the bits do too; the l2norm
// uses an approximate rsqrt as well, and with a 2-byte pool the decays approximate exp and log.
//
// Where it runs (`delta_default` in ring_plan.rs; docs/performance.md, twenty-fourth and
// twenty-fifth sessions): by default for ring decode and spec_verify on pools with a delta
// plane (an opt-in `PoolConfig::ring_deltas`), where it measured 3-12% (ring decode), up to 21%
// (one draft) and 2-18% (two to four drafts) faster than the kernels chosen before. Its time
// is each item's fixed cost (the plan's dependent loads, the pending entries' rows and
// activations, the pair sums, the barriers between them), not the tile's bytes: variants that
// fit three CTAs per SM by loading a 2-byte tile's words late (twenty-fourth session) or by
// keeping the tile in shared memory (twenty-sixth) were slower. The lean path with its tile in
// shared memory (kda_ring_delta_staged, below) was 3-7% faster for 2-byte ring decode calls of
// 3072-8192 items and up to 9% slower for small ones (thirty-sixth session): the default from
// 2048 items. At four CTAs per SM (64 registers, spills on the item's chain) it was 35-60%
// slower, and runs of items per CTA with each item's copies issued while the item before it
// computed (kda_ring_delta_loop, in the history as 561687c) 35-63% slower (thirty-seventh).
// Without its fixed work at all (a probe) an item of this kernel would still make 2-byte ring
// decode only 1.03-1.09x as fast as eager decode, while the eager bulk pipe with no stores and
// its step cut to these two products ran 1.8-2.1x as fast (thirty-eighth session). That pipe
// with each item's fixed work prepared by warps of their own (kda_ring_delta_pipe, in the
// history as 8e56fe1) was correct and 16-95% slower: its preparing warps did not keep up. With
// that work as a kernel of its own ahead of the pipe (kda_ring_delta_prep, one warp per item,
// records in a scratch buffer; in the history as 5493693) it was correct, 2-10% faster for
// 2-byte calls of 2048-8192 items and slower for the rest, still slower than eager decode:
// the two kernels did not overlap, the records took 8-20 us (ncu), and the pipe's products
// and commit folds ran on the CUDA cores (thirty-ninth session). With its commit fold on the
// tensor cores (3xTF32, as kda_ring_mma; c7c0158), a shorter record chain (d1d2cb1) and the
// step's P k and P q rows in registers (5adc3a0) it was correct and 6-13% faster for 2-byte
// calls of 2048-8192 items, still 0.6-1.6% slower than eager decode there and slower than
// this kernel elsewhere; the records overlapped with the pipe on the same SMs (flags instead of
// the grid wait; 6fd2b57) were 6-74% slower (fortieth session).
#include "kda_ring.cu"

namespace kda {

// Byte offsets in dynamic shared memory past RingTileLayout's (mirrored by `ring_plan` in
// ring_plan.rs): f32 arrays ua [mt][RCW] (the delta vectors of the item's columns, by combined
// token), ek [max(mq, 1)][mt][KS] (R k rows: a block per new token; a commit's in the first),
// kp, qp [mq][KS] (P_t k_t, P_t q_t), pm [KS] (P at a commit), ce [2][mq][mt] (c_tj, e_tj) and
// qk [mq] (q_t . k_t).
struct DeltaLayout {
    int ua, ek, kp, qp, pm, ce, qk;
    __device__ __forceinline__ DeltaLayout(const RingTileLayout& L, int mt, int mq) {
        ua = L.sbeta + round16(4 * mt);
        ek = ua + 4 * mt * RCW;
        kp = ek + 4 * (mq > 1 ? mq : 1) * mt * KS;
        qp = kp + 4 * mq * KS;
        pm = qp + 4 * mq * KS;
        ce = pm + 4 * KS;
        qk = ce + 4 * 2 * mq * mt; // then round16(4 mq) bytes: the end
    }
};

// The delta vectors of entry e of a slot's ring, value head hv, from column cb.
__device__ __forceinline__ float* delta_row(const KdaParams& p, kda_u32 slot, kda_u32 e, int hv, int cb) {
    return reinterpret_cast<float*>(p.delta) + (((size_t)slot * p.ring_len + e) * p.hv + (size_t)hv) * V + cb;
}

// Stores a lane's TV delta values of columns col0l.. (of cwv) at dst (16-byte aligned when whole).
__device__ __forceinline__ void store_delta(float* dst, const float (&u)[TV], int col0l, int cwv) {
    if (TV == 4 && col0l + TV <= cwv) {
        *reinterpret_cast<float4*>(dst) = make_float4(u[0], u[1], u[2], u[3]);
    } else {
#pragma unroll
        for (int c = 0; c < TV; ++c)
            if (col0l + c < cwv) dst[c] = u[c];
    }
}

// A commit's fold of the lane's tile: its rows times the factors of an f32 K row in shared
// memory (diag(P) S), and plus an outer product e u^T of an f32 K row e and the lane's TV = 4
// columns u of a delta vector (16-byte aligned).
__device__ __forceinline__ void tile_scale_rows(float (&s)[TK][TV], const float* row, int lk) {
    float pv[TK];
    rows_from_smem(row, lk, pv);
#pragma unroll
    for (int r = 0; r < TK; ++r)
#pragma unroll
        for (int c = 0; c < TV; ++c) s[r][c] *= pv[r];
}
__device__ __forceinline__ void tile_add_outer(float (&s)[TK][TV], const float* erow, const float* u, int lk) {
    float ev[TK];
    rows_from_smem(erow, lk, ev);
    const float4 u4 = *reinterpret_cast<const float4*>(u);
    const float uv[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
    for (int r = 0; r < TK; ++r)
#pragma unroll
        for (int c = 0; c < TV; ++c) s[r][c] = fmaf(ev[r], uv[c % 4], s[r][c]);
}

// Adds to ak, aq the lane's partial products of two f32 K rows in shared memory (P_t k_t,
// P_t q_t) with its tile: k S and q S over its rows, for its TV columns (summed over the
// lanes later).
__device__ __forceinline__ void tile_products(const float (&s)[TK][TV], const float* krow, const float* qrow,
                                              int lk, float (&ak)[TV], float (&aq)[TV]) {
    float kv[TK], qv[TK];
    rows_from_smem(krow, lk, kv);
    rows_from_smem(qrow, lk, qv);
#pragma unroll
    for (int r = 0; r < TK; ++r)
#pragma unroll
        for (int c = 0; c < TV; ++c) {
            ak[c] = fmaf(kv[r], s[r][c], ak[c]);
            aq[c] = fmaf(qv[r], s[r][c], aq[c]);
        }
}

// Eight lanes per column group and four columns per lane (K = 128): the new tokens' sums are
// scattered over the group's lanes instead of reduced into every lane (scatter_sums).
constexpr bool SCATTER = LK == 8 && TV == 4;

// Sums a lane's partial products k S (ak) and q S (aq) of its TV = 4 columns over the LK = 8
// lanes of its column group and returns one of the eight sums: lane lk gets column lk & 3 of
// k S (lk < 4) or of q S. Seven shuffles where reduce_k takes twelve per vector.
__device__ __forceinline__ float scatter_sums(const float (&ak)[TV], const float (&aq)[TV], int lk) {
    float x[8] = {ak[0], ak[1], ak[2], ak[3], aq[0], aq[1], aq[2], aq[3]};
    // lk's bit b is the lane's bit b + log2(LV): each round keeps the half of the values its
    // bit names and adds the partner's copy of it
    const bool b2 = (lk & 4) != 0, b1 = (lk & 2) != 0, b0 = (lk & 1) != 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const float send = b2 ? x[m] : x[m + 4], keep = b2 ? x[m + 4] : x[m];
        x[m] = keep + KDA_SHFL_XOR(send, 4 * LV);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const float send = b1 ? x[m] : x[m + 2], keep = b1 ? x[m + 2] : x[m];
        x[m] = keep + KDA_SHFL_XOR(send, 2 * LV);
    }
    const float send = b0 ? x[0] : x[1], keep = b0 ? x[1] : x[0];
    return keep + KDA_SHFL_XOR(send, LV);
}

// ---------------------------------------------------------------------------------------------
// Ring decode on the short path, lean (ring_delta_decode): one new token per item and every
// pending entry's delta vector stored, K = V = 128. The general item below spends most of a
// decode item's instructions on integer work and on phases that a few warps run while the
// others wait at a barrier (docs/performance.md, thirty-fourth session). Here every warp
// plans the item for itself (no barrier), the new token's inputs go straight into registers,
// split over the lanes (lane L holds K rows 4 L .. 4 L + 3), a warp copies and then activates
// one pending entry (its own copies: no barrier between), and after the one barrier (the
// activations) every warp computes, for itself, the pair sums c_tj and e_tj over the split rows
// (four entries at a time, one transposed reduction: warp_sums_transposed), P_t k_t and P_t q_t
// (turned into the tile's lane mapping through a row of its own in shared memory), the two products
// with the tile and the corrections sum_j c_tj u_j, sum_j e_tj u_j. One barrier per item
// before the end instead of six. A commit (pend = ring_len) folds the pending entries into the
// tile (diag(P) S, then the rank-pend update, a warp's R k rows through its row) and decodes
// the new token in the committed frame. On the H200 ring decode measured 4-12% faster than the
// general item (14-16% at N = 1; thirty-fourth session, then with three barriers), and the
// per-warp plan, the warp's own copies and the transposed pair sums 2-3% faster again for
// fp16, 4-5% for bf16 and 1% for fp32 (thirty-fifth session); slower were the tile's loads
// issued before the plan (5-12%), every ring entry's rows copied before it (6-15%), and mixed
// the new token activated by one warp and shared (-1.4% to +2.4%): an item's time is the
// latency of its chain, not its instructions. The same scheme for spec_verify (each warp
// stepping the new tokens in order over its columns, with every pair sum of every token)
// measured 0-9% slower than the general item (thirty-fifth session).
constexpr bool LEAN_FITS = K == 128 && V == 128 && SCATTER && RCW == V;
// K rows per lane in the split layout (the path runs only where LEAN_FITS: 4)
constexpr int KR = LEAN_FITS ? 4 : 1;

// Byte offsets in dynamic shared memory of the lean path (mirrored by `ring_plan` in
// ring_plan.rs): per pending entry its raw k and g rows (RK each), its delta vector (f32 [V]),
// its activated key and decay (f32 [K] each); then two f32 rows [K] per warp.
struct LeanLayout {
    int raw, u, ka, da, pw, st;
    __device__ __forceinline__ explicit LeanLayout(int ring_len) {
        raw = 0;
        u = raw + ring_len * 2 * RK;
        ka = u + ring_len * 4 * V;
        da = ka + ring_len * 4 * K;
        pw = da + ring_len * 4 * K;
        st = pw + (RT / 32) * 2 * 4 * K; // then the staged tile (kda_ring_delta_staged): the end
    }
};

// kda_ring_delta_staged: the lean path with a 2-byte K-first tile staged in shared memory
// instead of registers, so the kernel fits 80 registers (52 bytes spilled: values live across
// the item) and three CTAs per SM. Each lane copies its own TK rows of TV columns (8 bytes
// each, cp.async) and reads back only those, so no barrier guards them: row r of thread t at
// st + (r RT + t) 8 (a warp's lanes read 256 contiguous bytes).
constexpr bool STAGE_FITS = LEAN_FITS && TILE_WORDS && !VFIRST;

#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__)
// Rows R.. of stage_tile: one base address each side, the rows as immediate offsets (K-first:
// a lane's rows are consecutive).
template <int R> __device__ __forceinline__ void stage_rows(kda_u32 dst, const ST* src) {
    if constexpr (R < TK) {
        asm volatile("cp.async.ca.shared.global [%0+%2], [%1+%3], 8;\n" ::"r"(dst), "l"(src), "n"(R * RT * 8),
                     "n"(R * V * (int)sizeof(ST))
                     : "memory");
        stage_rows<R + 1>(dst, src);
    }
}
#endif
__device__ __forceinline__ void stage_tile(unsigned char* st, const ST* head, int lk, int col0) {
    const ST* src = head + (size_t)row_of(lk, 0) * V + col0;
#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#pragma unroll
    for (int r = 0; r < TK; ++r)
        cp_async8(st + ((size_t)r * RT + threadIdx.x) * 8, src + (size_t)r * V);
#else
    stage_rows<0>(smem_addr(st) + threadIdx.x * 8, src);
#endif
}
// (templates, so only 2-byte modules compile the conversions)
template <typename T = ST> __device__ __forceinline__ void staged_row(const unsigned char* st, int r, float (&x)[TV]) {
    const uint2 w = *reinterpret_cast<const uint2*>(st + ((size_t)r * RT + threadIdx.x) * 8);
    x[0] = kda_word_half<T>(w.x, false);
    x[1] = kda_word_half<T>(w.x, true);
    x[2] = kda_word_half<T>(w.y, false);
    x[3] = kda_word_half<T>(w.y, true);
}

// tile_products over the staged tile, four rows at a time (the same order of sums).
template <typename T = ST>
__device__ __forceinline__ void staged_products(const unsigned char* st, const float* krow, const float* qrow,
                                                int lk, float (&ak)[TV], float (&aq)[TV]) {
#pragma unroll
    for (int r0 = 0; r0 < TK; r0 += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(krow + row_of(lk, r0));
        const float4 q4 = *reinterpret_cast<const float4*>(qrow + row_of(lk, r0));
        const float kv[4] = {k4.x, k4.y, k4.z, k4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            float x[TV];
            staged_row<T>(st, r0 + m, x);
#pragma unroll
            for (int c = 0; c < TV; ++c) {
                ak[c] = fmaf(kv[m], x[c], ak[c]);
                aq[c] = fmaf(qv[m], x[c], aq[c]);
            }
        }
    }
}

// A commit on the staged tile, four rows at a time: diag(P) S + sum_j (R_{pend-1,j} k_j) u_j^T
// from the activated keys ka and decays da (f32 [K] rows) and the vectors ua, stored rounded to
// nearest, and the products of the committed (unrounded) rows, as tile_products (the same
// order of operations as the register path's commit).
template <typename T = ST>
__device__ __forceinline__ void staged_commit(const unsigned char* st, ST* head, int lk, int col0, int pend,
                                              const float* ka, const float* da, const float* ua,
                                              const float* krow, const float* qrow, float (&ak)[TV],
                                              float (&aq)[TV]) {
#pragma unroll 1
    for (int r0 = 0; r0 < TK; r0 += 4) {
        const int row = row_of(lk, r0);
        float s4[4][TV], pr[4] = {1.0f, 1.0f, 1.0f, 1.0f}, rk[4] = {1.0f, 1.0f, 1.0f, 1.0f};
#pragma unroll
        for (int m = 0; m < 4; ++m) staged_row<T>(st, r0 + m, s4[m]);
        for (int j = 0; j < pend; ++j) {
            const float4 d = *reinterpret_cast<const float4*>(da + j * K + row);
            pr[0] *= d.x;
            pr[1] *= d.y;
            pr[2] *= d.z;
            pr[3] *= d.w;
        }
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int c = 0; c < TV; ++c) s4[m][c] *= pr[m];
        for (int j = pend - 1; j >= 0; --j) {
            const float4 k = *reinterpret_cast<const float4*>(ka + j * K + row);
            const float4 d = *reinterpret_cast<const float4*>(da + j * K + row);
            const float4 u4 = *reinterpret_cast<const float4*>(ua + j * V + col0);
            const float kv[4] = {k.x, k.y, k.z, k.w}, dv[4] = {d.x, d.y, d.z, d.w};
            const float uv[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float e = rk[m] * kv[m];
                rk[m] *= dv[m];
#pragma unroll
                for (int c = 0; c < TV; ++c) s4[m][c] = fmaf(e, uv[c], s4[m][c]);
            }
        }
        const float4 k4 = *reinterpret_cast<const float4*>(krow + row);
        const float4 q4 = *reinterpret_cast<const float4*>(qrow + row);
        const float kv[4] = {k4.x, k4.y, k4.z, k4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const uint2 w = make_uint2(kda_pack2_rn<T>(s4[m][0], s4[m][1]), kda_pack2_rn<T>(s4[m][2], s4[m][3]));
            KDA_STORE_STREAM(reinterpret_cast<uint2*>(head + (size_t)(row + m) * V + col0), w);
#pragma unroll
            for (int c = 0; c < TV; ++c) {
                ak[c] = fmaf(kv[m], s4[m][c], ak[c]);
                aq[c] = fmaf(qv[m], s4[m][c], aq[c]);
            }
        }
    }
}

// A lane's KR split rows of a K row of inputs (16-byte aligned rows of K elements).
__device__ __forceinline__ void split_load(const IT* row, int lane, float (&x)[KR]) {
    kda_load_vec<IT, KR>(row + KR * lane, x);
}

// l2-normalises the split rows x of a K row (every lane of the warp), FAST as act_finish.
__device__ __forceinline__ void split_l2(float (&x)[KR], bool l2) {
    if (!l2) return;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < KR; ++i) ss += x[i] * x[i];
    const float rn = rsqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
    for (int i = 0; i < KR; ++i) x[i] *= rn;
}

// A lane's split rows of an f32 K row in shared memory: stored, loaded.
__device__ __forceinline__ void split_store(float* row, int lane, const float (&x)[KR]) {
    if constexpr (KR == 4) {
        *reinterpret_cast<float4*>(row + KR * lane) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
#pragma unroll
        for (int i = 0; i < KR; ++i) row[KR * lane + i] = x[i];
    }
}
__device__ __forceinline__ void split_from(const float* row, int lane, float (&x)[KR]) {
    if constexpr (KR == 4) {
        const float4 v = *reinterpret_cast<const float4*>(row + KR * lane);
        x[0] = v.x;
        x[1] = v.y;
        x[2] = v.z;
        x[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < KR; ++i) x[i] = row[KR * lane + i];
    }
}

// Stores KR raw input elements (exact f32 images of IT values) at dst, one at a time (a ring
// row is only ring_gran-aligned).
__device__ __forceinline__ void split_store_raw(IT* dst, const float (&x)[KR]) {
#pragma unroll
    for (int i = 0; i < KR; ++i) dst[i] = KdaElem<IT>::from_f32(x[i]);
}

// The lean path of one item (blockIdx.x); false, before any write, for an item it does not
// take (not one new token, or pending entries without stored vectors): the caller then runs
// the general item. STAGE: the tile staged in shared memory (kda_ring_delta_staged).
template <bool STAGE>
__device__ __forceinline__ bool ring_delta_decode(const KdaParams& p) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ kda_u32 z_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lk = lane / LV, lv = lane % LV;
    TileItem it = tile_item_begin(p);
    if (it.nnew != 1u) return false;
    const kda_u32 slot = it.slot, bos = it.bos;
    const int hv = it.hv, h = it.h;
    const bool gate = p.gate_mode != 0u;
    // every warp plans the item for itself (no barrier): lane 0 loads the ring record, lane 1
    // a_log of the value head
    it.meta = reinterpret_cast<kda_u32*>(p.meta) + (size_t)slot * 4;
    kda_u32 rlen = 0u, rpend = 0u, had = 0u;
    float alog = 0.0f;
    if (lane == 0) {
        const volatile kda_u32* vm = it.meta;
        rlen = vm[0];
        rpend = vm[1];
        had = vm[3];
    }
    if (lane == 1 && gate) alog = reinterpret_cast<const float*>(p.a_log)[hv];
    // the new token's inputs, split (the value: a k lane's one column, below)
    float kt[KR], qt[KR], gt[KR], bias[KR];
    split_load(reinterpret_cast<const IT*>(p.k) + ((size_t)bos * p.h + h) * K, lane, kt);
    split_load(reinterpret_cast<const IT*>(p.q) + ((size_t)bos * p.h + h) * K, lane, qt);
    split_load(reinterpret_cast<const IT*>(p.g) + ((size_t)bos * p.hv + hv) * K, lane, gt);
    if (gate) {
        split_from(reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K, lane, bias);
    } else {
#pragma unroll
        for (int i = 0; i < KR; ++i) bias[i] = 0.0f;
    }
    const int mc = lk & 3, col0l = warp * WC + lv * TV, colm = col0l + mc;
    const bool isq = lk >= 4;
    const float vraw = kda_load(reinterpret_cast<const IT*>(p.v)[((size_t)bos * p.hv + hv) * V + colm]);
    const float braw = kda_load(reinterpret_cast<const IT*>(p.beta)[(size_t)bos * p.hv + hv]);
    rlen = KDA_SHFL(rlen, 0);
    rpend = KDA_SHFL(rpend, 0);
    had = KDA_SHFL(had, 0);
    const Plan pl = plan_from(p, slot, 1u, rlen, rpend, 0u, reinterpret_cast<kda_u32*>(p.err),
                              threadIdx.x == 0 && hv == 0 && it.cb == 0);
    const int pend = (int)pl.pend;
    if (min(had, (kda_u32)pend) != (kda_u32)pend) return false;
    const float a_exp = gate ? expf(KDA_SHFL(alog, 1)) : 0.0f;
    const bool store = pl.store_after != KDA_NONE;
    // a warp per pending entry: its raw key and gate rows and its delta vector (the warp
    // activates the entry below: no barrier between)
    const LeanLayout Z((int)p.ring_len);
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    const int gran = (int)p.ring_gran;
    for (int j = warp; j < pend; j += RT / 32) {
        const IT* e = ring + (size_t)j * entry;
        unsigned char* raw = dsm + Z.raw + j * 2 * RK;
        copy_row(raw, e + (size_t)h * K, K * (int)sizeof(IT), gran, lane);
        copy_row(raw + RK, e + ring_off_g(p, hv), K * (int)sizeof(IT), gran, lane);
        copy_row(dsm + Z.u + j * 4 * V, delta_row(p, slot, (kda_u32)j, hv, 0), 4 * V, 16, lane);
    }
    cp_async_commit();
    ST* head = state_head(p, slot, (size_t)hv);
    unsigned char* st = dsm + Z.st;
    float s[TK][TV]; // (unused when STAGE)
    kda_u32 w[TW];
    if constexpr (STAGE) {
        stage_tile(st, head, lk, col0l);
        cp_async_commit();
    } else {
        tile_load_lane(head, lk, col0l, w, s);
    }
    // the new token's activations, in every warp (the FAST choices of the general item)
    const bool l2 = p.l2norm != 0u;
    split_l2(kt, l2);
    split_l2(qt, l2);
    float dt[KR];
#pragma unroll
    for (int i = 0; i < KR; ++i) {
        qt[i] *= p.scale;
        dt[i] = decay_at<sizeof(ST) == 2>(gt[i], &bias[i], p, a_exp);
    }
    const float bt = act_beta(braw, p);
    // the warp's pending entries activated, split, into shared memory (once its copies landed)
    if constexpr (STAGE) {
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    KDA_SYNCWARP();
    float* ka = reinterpret_cast<float*>(dsm + Z.ka);
    float* da = reinterpret_cast<float*>(dsm + Z.da);
    for (int j = warp; j < pend; j += RT / 32) {
        const unsigned char* raw = dsm + Z.raw + j * 2 * RK;
        float x[KR], g[KR];
        split_load(reinterpret_cast<const IT*>(raw), lane, x);
        split_load(reinterpret_cast<const IT*>(raw + RK), lane, g);
        split_l2(x, l2);
#pragma unroll
        for (int i = 0; i < KR; ++i) g[i] = decay_at<sizeof(ST) == 2>(g[i], &bias[i], p, a_exp);
        split_store(ka + j * K, lane, x);
        split_store(da + j * K, lane, g);
    }
    __syncthreads();
    const kda_u32 old = tile_arrive(it.meta);
    const float* ua = reinterpret_cast<const float*>(dsm + Z.u);
    float* pk = reinterpret_cast<float*>(dsm + Z.pw) + warp * 2 * K;
    float* pq = pk + K;
    const kda_u32 elem0 = (kda_u32)hv * (kda_u32)(K * V);
    // rr: R_{t,j} of the split rows while j goes down, then P_t
    float rr[KR], corr = 0.0f;
#pragma unroll
    for (int i = 0; i < KR; ++i) rr[i] = dt[i];
    if constexpr (TILE_WORDS && !STAGE) tile_from_words(w, s);
    if (!store) {
        // c_tj = k_t . R_tj k_j and e_tj = q_t . R_tj k_j, four entries at a time (j going
        // down): a lane's eight partial sums reduced transposed (warp_sums_transposed), then
        // the lane's correction sum_j (c_tj or e_tj) u_j of its column
        for (int j0 = pend - 1; j0 >= 0; j0 -= 4) {
            float ps[8];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                float c = 0.0f, e = 0.0f;
                if (j0 - m >= 0) {
                    float kj[KR], dj[KR];
                    split_from(ka + (j0 - m) * K, lane, kj);
                    split_from(da + (j0 - m) * K, lane, dj);
#pragma unroll
                    for (int i = 0; i < KR; ++i) {
                        const float x = rr[i] * kj[i];
                        c = fmaf(kt[i], x, c);
                        e = fmaf(qt[i], x, e);
                        rr[i] *= dj[i];
                    }
                }
                ps[2 * m] = c;
                ps[2 * m + 1] = e;
            }
            const float sum = warp_sums_transposed(ps, lane);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float ce = KDA_SHFL(sum, 8 * m + (isq ? 4 : 0));
                if (j0 - m >= 0) corr = fmaf(ce, ua[(j0 - m) * V + colm], corr);
            }
        }
    } else if (!STAGE && pend > 0) {
        // the commit: diag(P) S + sum_j (R_{pend-1,j} k_j) u_j^T, rounded once; P first
        float pr[KR], rk[KR];
#pragma unroll
        for (int i = 0; i < KR; ++i) pr[i] = rk[i] = 1.0f;
        for (int j = 0; j < pend; ++j) {
            float dj[KR];
            split_from(da + j * K, lane, dj);
#pragma unroll
            for (int i = 0; i < KR; ++i) pr[i] *= dj[i];
        }
        split_store(pk, lane, pr);
        KDA_SYNCWARP();
        tile_scale_rows(s, pk, lk);
        for (int j = pend - 1; j >= 0; --j) {
            float kj[KR], dj[KR], ek[KR];
            split_from(ka + j * K, lane, kj);
            split_from(da + j * K, lane, dj);
#pragma unroll
            for (int i = 0; i < KR; ++i) {
                ek[i] = rk[i] * kj[i];
                rk[i] *= dj[i];
            }
            KDA_SYNCWARP();
            split_store(pk, lane, ek);
            KDA_SYNCWARP();
            tile_add_outer(s, pk, ua + j * V + col0l, lk);
        }
        store_tile<false, true>(head, lk, col0l, s, 0u, elem0);
    }
    // q_t . k_t (here, where k_t and q_t are last needed); P_t k_t and P_t q_t in the tile's
    // lane mapping, through the warp's rows
    float qk = 0.0f;
#pragma unroll
    for (int i = 0; i < KR; ++i) qk = fmaf(qt[i], kt[i], qk);
    qk = warp_sum(qk);
    float x[KR];
#pragma unroll
    for (int i = 0; i < KR; ++i) x[i] = rr[i] * kt[i];
    KDA_SYNCWARP();
    split_store(pk, lane, x);
#pragma unroll
    for (int i = 0; i < KR; ++i) x[i] = rr[i] * qt[i];
    split_store(pq, lane, x);
    KDA_SYNCWARP();
    float ak[TV], aq[TV];
#pragma unroll
    for (int c = 0; c < TV; ++c) ak[c] = aq[c] = 0.0f;
    if constexpr (STAGE) {
        // the lane's own staged rows (no barrier)
        cp_async_wait<0>();
        if (store && pend > 0) {
            staged_commit(st, head, lk, col0l, pend, ka, da, ua, pk, pq, ak, aq);
        } else {
            staged_products(st, pk, pq, lk, ak, aq);
        }
    } else {
        tile_products(s, pk, pq, lk, ak, aq);
    }
    // lane lk of a column group: k S of column mc (lk < 4) or q S of it, then the new token's
    // delta vector (the k lanes) and output (the q lanes)
    const float a = scatter_sums(ak, aq, lk) + corr;
    const float u = bt * (vraw - a);
    const float uq = KDA_SHFL_XOR(u, 4 * LV);
    if (!isq) {
        if (pl.append_at != KDA_NONE) delta_row(p, slot, pl.append_at, hv, colm)[0] = u;
    } else {
        reinterpret_cast<IT*>(p.out)[((size_t)bos * p.hv + hv) * V + colm] = KdaElem<IT>::from_f32(fmaf(qk, uq, a));
    }
    // the new entry's raw inputs (a commit's: the slot's last CTA, in tile_settle)
    if (!store && pl.append_at != KDA_NONE) {
        IT* e = reinterpret_cast<IT*>(p.ring) + ((size_t)slot * p.ring_len + pl.append_at) * entry;
        if (!isq) e[ring_off_v(p, hv) + colm] = KdaElem<IT>::from_f32(vraw);
        if (warp == 0 && hv == h * it.group) {
            float r[KR];
            split_load(reinterpret_cast<const IT*>(p.k) + ((size_t)bos * p.h + h) * K, lane, r);
            split_store_raw(e + (size_t)h * K + KR * lane, r);
        } else if (warp == 1) {
            if constexpr (STAGE) {
                // (loaded again: not kept live across the item)
                float r[KR];
                split_load(reinterpret_cast<const IT*>(p.g) + ((size_t)bos * p.hv + hv) * K, lane, r);
                split_store_raw(e + ring_off_g(p, hv) + KR * lane, r);
            } else {
                split_store_raw(e + ring_off_g(p, hv) + KR * lane, gt);
            }
        } else if (warp == 2 && lane == 0) {
            e[ring_off_beta(p, hv)] = KdaElem<IT>::from_f32(braw);
        }
    }
    tile_settle(p, pl, old, it.per_seq, store, it.meta, slot, bos, 1u, z_last, pl.new_len);
    return true;
}

// The general item (any number of new tokens, the long path).
__device__ __forceinline__ void ring_delta_item(const KdaParams& p) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Plan s_plan;
    __shared__ float s_aexp;
    __shared__ kda_u32 s_last, s_cached;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lk = lane / LV, lv = lane % LV;
    TileItem it = tile_item_begin(p);
    const RingTileLayout L((int)p.ring_mt, (int)p.ring_mq);
    const DeltaLayout D(L, (int)p.ring_mt, (int)p.ring_mq);
    const int mq = (int)p.ring_mq;
    // the plan's loads (and thread 64 the entries with stored vectors), the new rows' copies,
    // then the plan; the tile's loads only after the pending rows' copies (below): issued before
    // them, as until the twenty-seventh session, ring decode was up to 8% and spec_verify up to
    // 13% slower on the H200 (docs/performance.md)
    const TilePlanLoads pl0 = tile_plan_loads(p, it);
    kda_u32 had = 0u;
    if (threadIdx.x == 64) had = reinterpret_cast<const volatile kda_u32*>(it.meta)[3];
    const kda_u32 per_seq = it.per_seq, slot = it.slot, bos = it.bos, nnew = it.nnew;
    const int hv = it.hv, cb = it.cb, cwv = it.cwv, h = it.h, group = it.group;
    kda_u32* meta = it.meta;
    ST* head = state_head(p, slot, (size_t)hv);
    const int col0l = warp * WC + lv * TV, col0 = cb + col0l;
    float s[TK][TV];
    kda_u32 w[TW];
    const int gran = (int)p.ring_gran;
    tile_new_rows(dsm, L, p, bos, nnew, h, hv, cb, cwv, gran);
    cp_async_commit();
    tile_plan_finish(p, it, pl0, s_plan, s_aexp);
    if (threadIdx.x == 64) s_cached = had;
    __syncthreads();
    const Plan pl = s_plan;
    const int pend = (int)pl.pend, ntok = pend + (int)nnew;
    const bool store = pl.store_after != KDA_NONE;
    const bool work = nnew > 0 || store;
    // the pending entries whose delta vectors are stored (accepted drafts are among them when
    // this kernel verified them)
    const int have = (int)min(s_cached, (kda_u32)pend);
    const bool fast = have == pend;
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    float* ua = reinterpret_cast<float*>(dsm + D.ua);
    if (work) {
        // the stored vectors join tile_pending_rows' copy group
        const int ugran = cwv % 4 == 0 ? 16 : 4;
        for (int j = warp; j < have; j += RT / 32)
            copy_row(reinterpret_cast<unsigned char*>(ua + j * RCW), delta_row(p, slot, (kda_u32)j, hv, cb), 4 * cwv,
                     ugran, lane);
        // the short path replays nothing: no pending values or betas (its vectors hold them)
        tile_pending_rows(dsm, L, p, ring, entry, pend, ntok, mq, bos, h, hv, cb, cwv, gran, !fast);
    }
    // the tile, first needed by the products after the activations
    tile_load_lane(head, lk, col0l < cwv ? col0 : V, w, s);
    cp_async_wait<0>();
    __syncthreads();
    const kda_u32 old = tile_arrive(meta);
    if (work) {
        const TileRows rows(dsm, L);
        float *ka = rows.ka, *da = rows.da, *qa = rows.qa, *va = rows.va;
        // The l2norm from an approximate rsqrt for every pool; the decays from approximate exp
        // and log for 2-byte pools only (2-5% faster there, with errors far below a 2-byte
        // state's rounding). fp32 pools keep the CPU backend's decays: approximate ones moved
        // their outputs up to 7.2e-6 from the CPU's, near the 1e-5 allowed; with the rsqrt
        // alone they stay at 3.6e-7 (docs/performance.md, twenty-eighth and twenty-ninth
        // sessions).
        tile_activate<true, sizeof(ST) == 2>(dsm, L, rows, p, pend, ntok, (int)nnew, mq, cwv, s_aexp, warp,
                                             lane, fast ? pend : 0);
        __syncthreads();
        if constexpr (TILE_WORDS) tile_from_words(w, s);
        const float* sbeta = reinterpret_cast<const float*>(dsm + L.sbeta);
        const kda_u32 elem0 = (kda_u32)hv * (kda_u32)(K * V);
        float o[TV];
        if (!fast) {
            // the long path: the pending entries replayed (kda_ring_tile's), their missing vectors
            // stored unless a commit restarts the ring
            for (int t = 0; t < pend; ++t) {
                float uo[TV];
                token_step<true, true>(s, ka + t * KS, da + t * KS, qa, va + t * RCW + col0l, cwv - col0l, sbeta[t],
                                       lk, false, o, uo);
                if (!store && t >= have && lk == 0 && col0l < cwv)
                    store_delta(delta_row(p, slot, (kda_u32)t, hv, col0), uo, col0l, cwv);
            }
            if (store && pend > 0 && col0l < cwv) store_tile<false, true>(head, lk, col0, s, 0u, elem0);
        }
        // the pending entries still in the tile's frame: 0 .. pend on the short path without a commit
        const int base = (fast && !store) ? 0 : pend;
        const bool fold = fast && store && pend > 0;
        const int nn = (int)nnew, mt = (int)p.ring_mt;
        float* ek = reinterpret_cast<float*>(dsm + D.ek);
        float* kp = reinterpret_cast<float*>(dsm + D.kp);
        float* qp = reinterpret_cast<float*>(dsm + D.qp);
        float* pm = reinterpret_cast<float*>(dsm + D.pm);
        float* ce = reinterpret_cast<float*>(dsm + D.ce);
        float* qk = reinterpret_cast<float*>(dsm + D.qk);
        // a thread per k: at a short-path commit R_{pend-1,j} k_j into ek's first block and
        // P_{pend-1} into pm
        if (fold) {
            for (int k = (int)threadIdx.x; k < KS; k += RT) {
                float r = 1.0f;
                if (k < K) {
                    for (int j = pend - 1; j >= 0; --j) {
                        ek[j * KS + k] = r * ka[j * KS + k];
                        r *= da[j * KS + k];
                    }
                }
                pm[k] = r;
            }
        }
        // a thread per (new token i, k): R_tj k_j (j in the frame before t = pend + i) into ek
        // block i, P_t k_t and P_t q_t into kp, qp row i (the fold's rows lie below the frame)
        for (int x = (int)threadIdx.x; x < nn * KS; x += RT) {
            const int i = x / KS, k = x - i * KS, t = pend + i;
            if (k >= K) {
                kp[x] = qp[x] = 0.0f;
                continue;
            }
            float r = da[t * KS + k];
            for (int j = t - 1; j >= base; --j) {
                ek[(i * mt + j) * KS + k] = r * ka[j * KS + k];
                r *= da[j * KS + k];
            }
            kp[x] = r * ka[t * KS + k];
            qp[x] = r * qa[x];
        }
        __syncthreads();
        // c_tj = k_t . R_tj k_j and e_tj = q_t . R_tj k_j, a warp per pair (i, j) of the frame;
        // j = t gives q_t . k_t
        const int span = pend - base + nn;
        for (int x = warp; x < nn * span; x += RT / 32) {
            const int i = x / span, j = base + (x - i * span), t = pend + i;
            if (j > t) continue;
            const float* kt = ka + t * KS;
            const float* qt = qa + i * KS;
            const float* r = j < t ? ek + (i * mt + j) * KS : kt;
            float pc = 0.0f, pe = 0.0f;
            for (int k = lane; k < K; k += 32) {
                pc = fmaf(kt[k], r[k], pc);
                pe = fmaf(qt[k], r[k], pe);
            }
            pc = warp_sum(pc);
            pe = warp_sum(pe);
            if (lane == 0) {
                if (j < t) {
                    ce[i * mt + j] = pc;
                    ce[(mq + i) * mt + j] = pe;
                } else {
                    qk[i] = pe;
                }
            }
        }
        if (fold) {
            // the commit: diag(P) S + sum_j (R k_j) u_j^T, rounded once
            tile_scale_rows(s, pm, lk);
            for (int j = 0; j < pend; ++j) tile_add_outer(s, ek + j * KS, ua + j * RCW + col0l, lk);
            if (col0l < cwv) store_tile<false, true>(head, lk, col0, s, 0u, elem0);
        }
        __syncthreads();
        // SCATTER: the one element a lane writes per new token (a k lane its column's delta
        // vector, a q lane its column's output), a token (hv V elements) further each token; its
        // address once here, not per token (spec_verify 1-2.5% faster, twenty-ninth session)
        unsigned char* wrow = nullptr;
        size_t wstep = 0;
        if constexpr (SCATTER) {
            const int mc = lk & 3;
            if (lk >= 4) {
                wrow = reinterpret_cast<unsigned char*>(reinterpret_cast<IT*>(p.out) +
                                                        ((size_t)bos * p.hv + hv) * V + col0 + mc);
                wstep = (size_t)p.hv * V * sizeof(IT);
            } else if (pl.append_at != KDA_NONE) {
                wrow = reinterpret_cast<unsigned char*>(delta_row(p, slot, pl.append_at, hv, col0) + mc);
                wstep = (size_t)p.hv * V * 4;
            }
        }
        // the new tokens in order: two products with the tile (frame S) each, then its vector
        // (kept in ua row t for the tokens after it) and output
        for (int i = 0; i < nn; ++i) {
            const int t = pend + i;
            float ak[TV], aq[TV];
#pragma unroll
            for (int c = 0; c < TV; ++c) ak[c] = aq[c] = 0.0f;
            tile_products(s, kp + i * KS, qp + i * KS, lk, ak, aq);
            const float bt = sbeta[t], qkt = qk[i];
            if constexpr (SCATTER) {
                // lane lk of a column group ends with one sum: k S of column lk (lk < 4) or
                // q S of column lk - 4, and steps that column alone
                const int mc = lk & 3;
                const bool isq = lk >= 4;
                float a = scatter_sums(ak, aq, lk);
                const float* cj = ce + (isq ? mq + i : i) * mt;
                for (int j = base; j < t; ++j) a = fmaf(cj[j], ua[j * RCW + col0l + mc], a);
                const bool valid = col0l + mc < cwv;
                const float u = bt * ((valid ? va[t * RCW + col0l + mc] : 0.0f) - a);
                // the q lanes take the vector of their column from the k lanes
                const float uq = KDA_SHFL_XOR(u, 4 * LV);
                if (!isq) {
                    ua[t * RCW + col0l + mc] = u;
                    if (valid && wrow != nullptr) *reinterpret_cast<float*>(wrow) = u;
                } else if (valid) {
                    *reinterpret_cast<IT*>(wrow) = KdaElem<IT>::from_f32(fmaf(qkt, uq, a));
                }
                wrow += wstep;
            } else {
                IT* orow = reinterpret_cast<IT*>(p.out) + ((size_t)(bos + i) * p.hv + hv) * V;
                reduce_k(ak);
                reduce_k(aq);
                for (int j = base; j < t; ++j) {
                    const float4 u4 = *reinterpret_cast<const float4*>(ua + j * RCW + col0l);
                    const float uv[4] = {u4.x, u4.y, u4.z, u4.w};
                    const float cj = ce[i * mt + j], ej = ce[(mq + i) * mt + j];
#pragma unroll
                    for (int c = 0; c < TV; ++c) {
                        ak[c] = fmaf(cj, uv[c % 4], ak[c]);
                        aq[c] = fmaf(ej, uv[c % 4], aq[c]);
                    }
                }
                float u[TV];
#pragma unroll
                for (int c = 0; c < TV; ++c) {
                    const float vv = col0l + c < cwv ? va[t * RCW + col0l + c] : 0.0f;
                    u[c] = bt * (vv - ak[c]);
                    o[c] = fmaf(qkt, u[c], aq[c]);
                }
                if (lk == 0) {
                    *reinterpret_cast<float4*>(ua + t * RCW + col0l) = make_float4(u[0], u[1], u[2], u[3]);
                    if (col0l < cwv) {
                        store_out(orow + col0, o, col0);
                        if (pl.append_at != KDA_NONE)
                            store_delta(delta_row(p, slot, pl.append_at + (kda_u32)i, hv, col0), u, col0l, cwv);
                    }
                }
            }
            // every lane of a column group reads the vectors its k lanes wrote
            KDA_SYNCWARP();
        }
        if (!store && pl.append_at != KDA_NONE && nnew > 0)
            tile_append(dsm, L, p, slot, pl.append_at, bos, nnew, h, hv, group, cb, cwv, gran, entry);
    }
    // every entry the ring keeps has its vector when the item worked; else those it had
    const kda_u32 cached = work ? pl.new_len : min(s_cached, pl.new_len);
    tile_settle(p, pl, old, per_seq, store, meta, slot, bos, nnew, s_last, cached);
}

} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::RT, 2) kda_ring_delta(const KdaParams p) {
    using namespace kda;
    if (padding_cta(p)) return;
    if constexpr (LEAN_FITS) {
        if (p.op == KDA_OP_DECODE && ring_delta_decode<false>(p)) return;
    }
    ring_delta_item(p);
}

namespace kda {
// The general item out of line, so its registers (spilled under three CTAs per SM) do not
// constrain the staged path's.
__device__ __noinline__ void ring_delta_item_far(const KdaParams p) { ring_delta_item(p); }
// The staged lean path where it fits (a template, so other modules never instantiate it).
template <bool FITS> __device__ __forceinline__ bool staged_decode(const KdaParams& p) {
    if constexpr (FITS) {
        return ring_delta_decode<true>(p);
    } else {
        return false;
    }
}
} // namespace kda

// Ring decode of 2-byte K-first pools with K = V = 128 (the host's choice): the lean path with
// the tile staged in shared memory, three CTAs per SM; the general item for what it does not
// take.
extern "C" __global__ void __launch_bounds__(kda::RT, 3) kda_ring_delta_staged(const KdaParams p) {
    using namespace kda;
    if (padding_cta(p)) return;
    if (p.op == KDA_OP_DECODE && staged_decode<STAGE_FITS>(p)) return;
    ring_delta_item_far(p);
}
