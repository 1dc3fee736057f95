// Chunked prefill (spec section 3) in two kernels per window of chunks (docs/architecture.md,
// "Chunked prefill"); part of the kda_step module (the activations, the layouts and the
// rounding are kda_decode.cu's). The host cuts the call's sequences into chunks of at most BT
// tokens (never across a sequence) and packs them, in order, into windows whose scratch fits a
// budget; a sequence longer than a window continues in the next one (its f32 state carried).
// Per window:
// - kda_chunk_prep, one CTA per (chunk, value head), every chunk at once: the activations, the
//   chunk-local cumulative log-decay Gc, Akk and Aqk, w = (I + Akk)^-1 (beta k exp(Gc)) and
//   u = (I + Akk)^-1 (beta v) by forward substitution, q exp(Gc), k exp(Gc_last - Gc) and
//   exp(Gc_last), into f32 scratch;
// - kda_chunk_state, one CTA per (piece, value head, BV value columns): the state's columns in
//   shared memory, chunk after chunk v_new = u - w S, the outputs q exp(Gc) S + Aqk v_new and
//   S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T v_new; the state read from the slot (or the
//   carry) at the piece's start and stored, rounded to the pool's element, at its end.
// Every exponent is a difference Gc_i - Gc_j with j <= i, or Gc itself, kept in log2 units
// (exp2f), so nothing overflows for log-decays <= 0. A ring's pending entries are folded
// first by kda_chunk_state in f32 (no store in between), and kda_chunk_ring_reset empties the
// ring after the last window.

// Must match crates/kda-kernels/src/cuda/chunk_plan.rs (`ChunkParams`) field for field.
struct KdaChunkParams {
    kda_u64 chunks;               // u32 [n_chunks][2]: first token, tokens (1..=BT)
    kda_u64 pieces;               // u32 [n_pieces][4]: first chunk, chunks, sequence, flags
    kda_u64 w, qg, kg, u, aqk, gl; // f32 scratch, per (chunk, value head): [BT][K] x 3, [BT][V], [BT][BT], [K]
    kda_u64 carry;                // f32 [HV][K][V]: the state of the sequence a window leaves open
};

#define KDA_PIECE_FROM_SLOT 1u // the piece starts from the slot's state (else from the carry)
#define KDA_PIECE_TO_SLOT 2u   // the piece ends by storing the slot's state (else the carry)

namespace kda {

constexpr int BT = 64;                 // tokens per chunk (cpu::chunk::BT)
constexpr int CK = roundup(K, 4) + 4;  // smem row stride of K-wide rows: 16-byte rows, j-th row at bank 4 j
constexpr int CV = roundup(V, 4) + 4;  // of V-wide rows
constexpr int CA = BT + 4;             // of Akk rows
constexpr int PREP_THREADS = 256;
constexpr int BV = 16;                 // value columns per kda_chunk_state CTA
constexpr int SS = BV + 4;             // smem row stride of the state's columns
constexpr int STATE_THREADS = 128;     // two per chunk row: BT * 2
constexpr float LOG2E = 1.4426950408889634f;
// Shared-memory layouts, float offsets. kda_chunk_prep: sK, sQ, sG, sV, sA, sB.
constexpr int PREP_Q = BT * CK, PREP_G = PREP_Q + BT * CK, PREP_V = PREP_G + BT * CK, PREP_A = PREP_V + BT * CV,
              PREP_B = PREP_A + BT * CA, PREP_END = PREP_B + BT;
// kda_chunk_state: sS, sN, then the chunk's scratch tW, tQ, tK, tA, tU, tG.
constexpr int ST_N = K * SS, ST_W = ST_N + BT * SS, ST_Q = ST_W + BT * CK, ST_K = ST_Q + BT * CK,
              ST_A = ST_K + BT * CK, ST_U = ST_A + BT * CA, ST_G = ST_U + BT * BV, ST_END = ST_G + K;
static_assert(STATE_THREADS == 2 * BT, "kda_chunk_state: two threads per chunk row");
static_assert(PREP_THREADS % BT == 0, "kda_chunk_prep: whole rows of pairs");

} // namespace kda

// The dynamic shared memory each kernel carves up, in bytes, between two marker words: the
// host sizes its launches with chunk_plan.rs's prep_smem and state_smem, and the NVRTC test
// of registry.rs reads these words out of the compiled module to hold the two to the same
// numbers.
extern "C" __device__ const kda_u32 kda_chunk_smem_bytes[4] = {0x4b444153u, 4u * kda::PREP_END, 4u * kda::ST_END,
                                                                0x534d454du};

namespace kda {

// Scratch of (chunk ch, value head hv): the element offset of its block of `per` floats.
__device__ __forceinline__ size_t chunk_block(const KdaParams& p, kda_u32 ch, kda_u32 hv, size_t per) {
    return ((size_t)ch * p.hv + hv) * per;
}

// Offset of state element (k, v) in a head of the pool's layout.
__device__ __forceinline__ kda_u32 state_off(int k, int v) {
    return VFIRST ? (kda_u32)(v * K + k) : (kda_u32)(k * V + v);
}

// Four f32 values stored as IT at p (aligned to four elements), rounded to nearest even.
__device__ __forceinline__ void store_out4(IT* p, float a, float b, float c, float d) {
    const IT x[4] = {KdaElem<IT>::from_f32(a), KdaElem<IT>::from_f32(b), KdaElem<IT>::from_f32(c),
                     KdaElem<IT>::from_f32(d)};
    kda_store_vec<IT, 4>(p, x);
}

// The slot's pending ring entries folded into the state's columns sS ([K][SS], f32) as tokens
// without output (spec section 2: decay, v - k S, the rank-1 update), so the prefill starts from
// the true state without a store in between (a 2-byte pool rounds it once, at the end). The
// ring record is read here, checked and clamped by kda_step's plan (plan_from: a prefill
// folds the pending entries, drops the drafts), and cleared by kda_chunk_ring_reset after the
// call's last window. `first`: the CTA that records a corrupt record in the error word.
__device__ __forceinline__ void fold_pending(const KdaParams& p, kda_u32 slot, kda_u32 hv, int v0, float* sS,
                                             bool first) {
    __shared__ float fk[K], fd[K], fv[BV], fu[BV], fred[STATE_THREADS / 32][BV + 1];
    __shared__ float fbeta;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const kda_u32* meta = reinterpret_cast<const kda_u32*>(p.meta) + (size_t)slot * 4;
    const kda_u32 pend =
        plan_from<true>(p, slot, 0u, meta[0], meta[1], 0u, reinterpret_cast<kda_u32*>(p.err), first && tid == 0)
            .pend;
    const int h = (int)(hv / (p.hv / p.h));
    const size_t entry = ring_entry_elems(p);
    const float a_exp = p.gate_mode ? expf(reinterpret_cast<const float*>(p.a_log)[hv]) : 0.0f;
    const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K;
    for (kda_u32 e = 0; e < pend; ++e) {
        const IT* base = reinterpret_cast<const IT*>(p.ring) + ((size_t)slot * p.ring_len + e) * entry;
        const IT* kp = base + (size_t)h * K;
        const IT* vp = base + ring_off_v(p, hv);
        const IT* gp = base + ring_off_g(p, hv);
        // the key's squared norm, the decays, the values of the columns, beta
        float ss = 0.0f;
        for (int kk = tid; kk < K; kk += blockDim.x) {
            const float x = kda_load(kp[kk]);
            fk[kk] = x;
            ss += x * x;
            fd[kk] = expf(log_decay_at(kda_load(gp[kk]), bias + kk, p, a_exp));
        }
        ss = warp_sum(ss);
        if (lane == 0) fred[warp][BV] = ss;
        for (int cc = tid; cc < BV; cc += blockDim.x) fv[cc] = v0 + cc < V ? kda_load(vp[v0 + cc]) : 0.0f;
        if (tid == 0) fbeta = act_beta(kda_load(base[ring_off_beta(p, hv)]), p);
        __syncthreads();
        if (p.l2norm) {
            float tot = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += fred[w][BV];
            const float nrm = sqrtf(tot + 1e-6f);
            __syncthreads(); // every thread has read the sums
            for (int kk = tid; kk < K; kk += blockDim.x) fk[kk] = fk[kk] / nrm;
            __syncthreads();
        }
        // decay the rows, then k S per column
        float part[BV];
#pragma unroll
        for (int cc = 0; cc < BV; ++cc) part[cc] = 0.0f;
        for (int k = tid; k < K; k += blockDim.x) {
#pragma unroll
            for (int cc = 0; cc < BV; ++cc) {
                const float x = sS[k * SS + cc] * fd[k];
                sS[k * SS + cc] = x;
                part[cc] += fk[k] * x;
            }
        }
#pragma unroll
        for (int cc = 0; cc < BV; ++cc) {
            const float x = warp_sum(part[cc]);
            if (lane == 0) fred[warp][cc] = x;
        }
        __syncthreads();
        if (tid < BV) {
            float ks = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) ks += fred[w][tid];
            fu[tid] = fbeta * (fv[tid] - ks);
        }
        __syncthreads();
        for (int k = tid; k < K; k += blockDim.x) {
#pragma unroll
            for (int cc = 0; cc < BV; ++cc) sS[k * SS + cc] += fk[k] * fu[cc];
        }
        __syncthreads();
    }
}

} // namespace kda

// One CTA per (chunk of the window, value head): blockIdx.x = chunk * HV + hv.
extern "C" __global__ void __launch_bounds__(kda::PREP_THREADS) kda_chunk_prep(const KdaParams p,
                                                                              const KdaChunkParams c) {
    using namespace kda;
    extern __shared__ __align__(16) float csm[]; // chunk_plan.rs's prep_smem
    float* sK = csm;             // [BT][CK] activated keys
    float* sQ = csm + PREP_Q;    // [BT][CK] activated, scaled queries; then beta k exp(Gc), then w
    float* sG = csm + PREP_G;    // [BT][CK] log-decays; then Gc in log2 units
    float* sV = csm + PREP_V;    // [BT][CV] values; then beta v, then u
    float* sA = csm + PREP_A;    // [BT][CA] Akk: beta_i k_i . k_j exp(Gc_i - Gc_j), j < i
    float* sB = csm + PREP_B;    // [BT] beta
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = blockDim.x >> 5;
    const kda_u32 ch = blockIdx.x / p.hv, hv = blockIdx.x - ch * p.hv;
    const kda_u32* ct = reinterpret_cast<const kda_u32*>(c.chunks) + 2 * (size_t)ch;
    const kda_u32 tok0 = ct[0];
    const int len = (int)ct[1];
    const size_t h = hv / (p.hv / p.h);
    const float a_exp = p.gate_mode ? expf(reinterpret_cast<const float*>(p.a_log)[hv]) : 0.0f;
    const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K;
    const IT* in_k = reinterpret_cast<const IT*>(p.k);
    const IT* in_q = reinterpret_cast<const IT*>(p.q);
    const IT* in_g = reinterpret_cast<const IT*>(p.g);
    const IT* in_v = reinterpret_cast<const IT*>(p.v);

    // 1. The chunk's raw rows (every load independent of the others, so many are in flight);
    //    the log-decays in log2 units; rows past the chunk's end 0 (they change nothing).
    for (int e = tid; e < BT * K; e += blockDim.x) {
        const int t = e / K, kk = e - t * K;
        float kx = 0.0f, qx = 0.0f, gx = 0.0f;
        if (t < len) {
            const size_t tok = tok0 + (size_t)t;
            kx = kda_load(in_k[(tok * p.h + h) * K + kk]);
            qx = kda_load(in_q[(tok * p.h + h) * K + kk]);
            gx = log_decay_at(kda_load(in_g[(tok * p.hv + hv) * K + kk]), bias + kk, p, a_exp) * LOG2E;
        }
        sK[t * CK + kk] = kx;
        sQ[t * CK + kk] = qx;
        sG[t * CK + kk] = gx;
    }
    for (int e = tid; e < BT * V; e += blockDim.x) {
        const int t = e / V, cv = e - t * V;
        sV[t * CV + cv] = t < len ? kda_load(in_v[((tok0 + (size_t)t) * p.hv + hv) * V + cv]) : 0.0f;
    }
    for (int t = tid; t < BT; t += blockDim.x)
        sB[t] = t < len ? act_beta(kda_load(reinterpret_cast<const IT*>(p.beta)[(tok0 + (size_t)t) * p.hv + hv]), p)
                        : 0.0f;
    __syncthreads();

    // 2. l2norm (and the query's scale) in place, one warp per row, act_finish's arithmetic;
    //    Gc, one thread per key channel.
    for (int r = warp; r < 2 * len; r += nwarps) {
        float* row = r < len ? sK + r * CK : sQ + (r - len) * CK;
        float x[KL];
#pragma unroll
        for (int i = 0; i < KL; ++i) {
            const int kk = lane + 32 * i;
            x[i] = kk < K ? row[kk] : 0.0f; // each lane rewrites only the elements it read
        }
        act_finish(x, row, p.l2norm != 0u, r >= len, p.scale, lane);
    }
    for (int kk = tid; kk < K; kk += blockDim.x) {
        float run = 0.0f;
        for (int t = 0; t < BT; ++t) {
            run += sG[t * CK + kk];
            sG[t * CK + kk] = run;
        }
    }
    __syncthreads();

    // 3. Akk and Aqk: thread (row group i0, column j) sums the pairs (i, j) of rows i = i0 + 4 m
    //    over K with the exact exp2(Gc_i - Gc_j) of each element; a warp skips the rows above all
    //    of its columns. Aqk (j <= i, else 0) goes to the scratch, beta_i Akk (j < i) to sA.
    {
        constexpr int RG4 = PREP_THREADS / BT; // row groups
        constexpr int RM = BT / RG4;           // rows per thread
        const int j = tid % BT, i0 = tid / BT, jw = j & ~31;
        float akk[RM], aqk[RM];
#pragma unroll
        for (int m = 0; m < RM; ++m) akk[m] = aqk[m] = 0.0f;
        const float* kj = sK + j * CK;
        const float* gj = sG + j * CK;
        for (int k = 0; k < K; k += 4) {
            const float4 kj4 = *reinterpret_cast<const float4*>(kj + k);
            const float4 gj4 = *reinterpret_cast<const float4*>(gj + k);
#pragma unroll
            for (int m = 0; m < RM; ++m) {
                const int i = i0 + RG4 * m;
                if (i < jw) continue; // every column of the warp is right of the diagonal
                const float4 ki = *reinterpret_cast<const float4*>(sK + i * CK + k);
                const float4 qi = *reinterpret_cast<const float4*>(sQ + i * CK + k);
                const float4 gi = *reinterpret_cast<const float4*>(sG + i * CK + k);
                const float e0 = kj4.x * exp2f(gi.x - gj4.x), e1 = kj4.y * exp2f(gi.y - gj4.y);
                const float e2 = kj4.z * exp2f(gi.z - gj4.z), e3 = kj4.w * exp2f(gi.w - gj4.w);
                akk[m] += ki.x * e0 + ki.y * e1 + ki.z * e2 + ki.w * e3;
                aqk[m] += qi.x * e0 + qi.y * e1 + qi.z * e2 + qi.w * e3;
            }
        }
        float* aq = reinterpret_cast<float*>(c.aqk) + chunk_block(p, ch, hv, (size_t)BT * BT);
#pragma unroll
        for (int m = 0; m < RM; ++m) {
            const int i = i0 + RG4 * m;
            aq[i * BT + j] = j <= i ? aqk[m] : 0.0f;
            sA[i * CA + j] = j < i ? sB[i] * akk[m] : 0.0f;
        }
    }
    __syncthreads();

    // 4. q exp(Gc), k exp(Gc_last - Gc) and exp(Gc_last) to the scratch; the right-hand sides
    //    beta k exp(Gc) (over the queries) and beta v (in place).
    {
        const size_t kb = chunk_block(p, ch, hv, (size_t)BT * K);
        float* qg = reinterpret_cast<float*>(c.qg) + kb;
        float* kg = reinterpret_cast<float*>(c.kg) + kb;
        float* gl = reinterpret_cast<float*>(c.gl) + chunk_block(p, ch, hv, K);
        for (int e = tid; e < BT * K; e += blockDim.x) {
            const int t = e / K, kk = e - t * K;
            const float gt = sG[t * CK + kk], glast = sG[(BT - 1) * CK + kk];
            const float eg = exp2f(gt), kx = sK[t * CK + kk];
            qg[e] = sQ[t * CK + kk] * eg;
            kg[e] = kx * exp2f(glast - gt);
            sQ[t * CK + kk] = sB[t] * kx * eg;
            if (t == 0) gl[kk] = exp2f(glast);
        }
        for (int e = tid; e < BT * V; e += blockDim.x) {
            const int t = e / V, cv = e - t * V;
            sV[t * CV + cv] *= sB[t];
        }
    }
    __syncthreads();

    // 5. w and u: (I + Akk) x = rhs by forward substitution, one thread per column of [w | u],
    //    in place, eight rows at a time: x_i = rhs_i - sum_{j<i} Akk[i][j] x_j, the earlier
    //    rows' sums from shared memory (four columns of Akk per load), the group's own in
    //    registers. (Fully unrolled over all rows the compiler hoisted every load of Akk and
    //    spilled.)
    {
        float* wout = reinterpret_cast<float*>(c.w) + chunk_block(p, ch, hv, (size_t)BT * K);
        float* uout = reinterpret_cast<float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V);
        for (int col = tid; col < K + V; col += blockDim.x) {
            const bool isw = col < K;
            float* x = isw ? sQ + col : sV + (col - K);
            const int rs = isw ? CK : CV;
            for (int g0 = 0; g0 < BT; g0 += 8) {
                float acc[8];
#pragma unroll
                for (int r = 0; r < 8; ++r) acc[r] = x[(g0 + r) * rs];
                for (int j = 0; j < g0; j += 4) {
                    const float x0 = x[j * rs], x1 = x[(j + 1) * rs], x2 = x[(j + 2) * rs], x3 = x[(j + 3) * rs];
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        const float4 a = *reinterpret_cast<const float4*>(sA + (g0 + r) * CA + j);
                        acc[r] -= a.x * x0;
                        acc[r] -= a.y * x1;
                        acc[r] -= a.z * x2;
                        acc[r] -= a.w * x3;
                    }
                }
#pragma unroll
                for (int r = 0; r < 8; ++r) {
#pragma unroll
                    for (int q = 0; q < r; ++q) acc[r] -= sA[(g0 + r) * CA + g0 + q] * acc[q];
                    x[(g0 + r) * rs] = acc[r];
                }
            }
            float* dst = isw ? wout + col : uout + (col - K);
            const int ds = isw ? K : V;
            for (int i = 0; i < BT; ++i) dst[i * ds] = x[i * rs];
        }
    }
}

// One CTA per (piece of the window, value head, BV value columns): blockIdx.x = (piece * HV +
// hv) * vblocks + vb. A chunk's scratch (w, q exp(Gc), u's columns, Aqk, k exp(Gc_last - Gc),
// exp(Gc_last)) reaches shared memory by cp.async in three groups, each issued as soon as the
// previous chunk's phase that reads its buffers is done: w, q exp(Gc) and u (phase A) while
// the previous chunk's phases B and C run, Aqk (phase B) during its phase C and this chunk's
// phase A, k exp(Gc_last - Gc) and exp(Gc_last) (phase C) during this chunk's phases A and B.
// So each phase waits on loads that were in flight for a phase or two, not on a chain of
// dependent global loads (the first version, about 30 us per chunk on an H100: fifty-seventh
// session).
extern "C" __global__ void __launch_bounds__(kda::STATE_THREADS) kda_chunk_state(const KdaParams p,
                                                                                const KdaChunkParams c) {
    using namespace kda;
    extern __shared__ __align__(16) float csm[]; // chunk_plan.rs's state_smem
    float* sS = csm;         // [K][SS] the state's columns v0 .. v0 + BV
    float* sN = csm + ST_N;  // [BT][SS] v_new of the chunk
    float* tW = csm + ST_W;  // [BT][CK] w
    float* tQ = csm + ST_Q;  // [BT][CK] q exp(Gc)
    float* tK = csm + ST_K;  // [BT][CK] k exp(Gc_last - Gc)
    float* tA = csm + ST_A;  // [BT][CA] Aqk
    float* tU = csm + ST_U;  // [BT][BV] u's columns v0 .. v0 + BV
    float* tG = csm + ST_G;  // [K] exp(Gc_last)
    const int tid = threadIdx.x;
    constexpr int VB = (V + BV - 1) / BV;
    const kda_u32 vb = blockIdx.x % VB, rest = blockIdx.x / VB;
    const kda_u32 pi = rest / p.hv, hv = rest - pi * p.hv;
    const kda_u32* pc = reinterpret_cast<const kda_u32*>(c.pieces) + 4 * (size_t)pi;
    const kda_u32 c0 = pc[0], nch = pc[1], seq = pc[2], flags = pc[3];
    const kda_u32 slot = reinterpret_cast<const kda_u32*>(p.slots)[seq];
    const int v0 = (int)vb * BV;
    ST* head = state_head(p, slot, hv);
    float* carry = reinterpret_cast<float*>(c.carry) + (size_t)hv * K * V;

    // `rows` rows of `width` floats (a multiple of 4) from src (row stride ss) to dst (row
    // stride ds), 16 bytes per cp.async.
    auto copy_rows = [&](float* dst, int ds, const float* src, size_t ss, int rows, int width) {
        const int pieces = width / 4;
        for (int e = tid; e < rows * pieces; e += blockDim.x) {
            const int r = e / pieces, x = 4 * (e - r * pieces);
            cp_async16(dst + r * ds + x, src + r * ss + x);
        }
    };
    // The copies of chunk ch's group (1: w, q exp(Gc), u; 2: Aqk; 3: k exp(Gc_last - Gc),
    // exp(Gc_last)), committed as one group; none past the piece's last chunk (an empty group,
    // so every thread counts the same groups).
    auto issue = [&](int group, kda_u32 ch) {
        if (ch < c0 + nch) {
            const size_t kb = chunk_block(p, ch, hv, (size_t)BT * K);
            if (group == 1) {
                copy_rows(tW, CK, reinterpret_cast<const float*>(c.w) + kb, K, BT, K);
                copy_rows(tQ, CK, reinterpret_cast<const float*>(c.qg) + kb, K, BT, K);
                // u's columns v0 .. v0 + BV that exist (V % 8 == 0: whole 16-byte pieces)
                const float* U = reinterpret_cast<const float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V);
                copy_rows(tU, BV, U + v0, V, BT, V - v0 < BV ? V - v0 : BV);
            } else if (group == 2) {
                const float* AQ = reinterpret_cast<const float*>(c.aqk) + chunk_block(p, ch, hv, (size_t)BT * BT);
                copy_rows(tA, CA, AQ, BT, BT, BT);
            } else {
                copy_rows(tK, CK, reinterpret_cast<const float*>(c.kg) + kb, K, BT, K);
                copy_rows(tG, K, reinterpret_cast<const float*>(c.gl) + chunk_block(p, ch, hv, K), K, 1, K);
            }
        }
        cp_async_commit();
    };
    issue(1, c0);
    issue(2, c0);

    for (int e = tid; e < K * BV; e += blockDim.x) {
        const int k = e / BV, cc = e - k * BV, v = v0 + cc;
        float x = 0.0f;
        if (v < V) x = (flags & KDA_PIECE_FROM_SLOT) ? kda_load(head[state_off(k, v)]) : carry[(size_t)k * V + v];
        sS[k * SS + cc] = x;
    }
    __syncthreads();
    if ((flags & KDA_PIECE_FROM_SLOT) && p.ring_len > 0) fold_pending(p, slot, hv, v0, sS, vb == 0 && hv == 0);

    // thread (row i, half): columns cc0 .. cc0 + 8 of chunk row i in phases A and B
    const int i = tid >> 1, cc0 = (tid & 1) * 8;
    const bool cols = v0 + cc0 < V; // V % 8 == 0: all eight or none
    for (kda_u32 ch = c0; ch < c0 + nch; ++ch) {
        const kda_u32* ct = reinterpret_cast<const kda_u32*>(c.chunks) + 2 * (size_t)ch;
        const kda_u32 tok0 = ct[0];
        const int len = (int)ct[1];
        // in flight: groups 1 and 2 of ch; the barrier also orders the previous phase C's state
        cp_async_wait<1>();
        __syncthreads();
        issue(3, ch); // tK and tG: the previous phase C is done with them

        // A. v_new = u - w S and o = q exp(Gc) S for the thread's row and columns
        float vn[8], o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            vn[e] = cols ? tU[i * BV + cc0 + e] : 0.0f;
            o[e] = 0.0f;
        }
        const float* wr = tW + i * CK;
        const float* qr = tQ + i * CK;
#pragma unroll 2
        for (int k = 0; k < K; k += 4) {
            const float4 w4 = *reinterpret_cast<const float4*>(wr + k);
            const float4 q4 = *reinterpret_cast<const float4*>(qr + k);
            const float wk[4] = {w4.x, w4.y, w4.z, w4.w}, qk[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float* srow = sS + (k + r) * SS + cc0;
                const float4 s0 = *reinterpret_cast<const float4*>(srow);
                const float4 s1 = *reinterpret_cast<const float4*>(srow + 4);
                const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    vn[e] -= wk[r] * s[e];
                    o[e] += qk[r] * s[e];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sN[i * SS + cc0 + e] = vn[e];
        cp_async_wait<1>(); // group 2 of ch landed (group 3 may be in flight)
        __syncthreads();
        issue(1, ch + 1); // tW, tQ, tU: phase A is done with them

        // B. o += Aqk v_new (Aqk is 0 right of the diagonal); the outputs of the chunk's tokens
        const float* ar = tA + i * CA;
        for (int j = 0; j <= i; j += 4) {
            const float4 a4 = *reinterpret_cast<const float4*>(ar + j);
            const float a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float* nrow = sN + (j + r) * SS + cc0;
                const float4 n0 = *reinterpret_cast<const float4*>(nrow);
                const float4 n1 = *reinterpret_cast<const float4*>(nrow + 4);
                o[0] += a[r] * n0.x;
                o[1] += a[r] * n0.y;
                o[2] += a[r] * n0.z;
                o[3] += a[r] * n0.w;
                o[4] += a[r] * n1.x;
                o[5] += a[r] * n1.y;
                o[6] += a[r] * n1.z;
                o[7] += a[r] * n1.w;
            }
        }
        if (i < len && cols) {
            IT* op = reinterpret_cast<IT*>(p.out) + ((tok0 + (size_t)i) * p.hv + hv) * V + v0 + cc0;
            store_out4(op, o[0], o[1], o[2], o[3]);
            store_out4(op + 4, o[4], o[5], o[6], o[7]);
        }
        cp_async_wait<1>(); // group 3 of ch landed (group 1 of ch + 1 may be in flight)
        __syncthreads();
        issue(2, ch + 1); // tA: phase B is done with it

        // C. S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T v_new, one thread per key row
        for (int k = tid; k < K; k += blockDim.x) {
            float s[BV];
            const float d = tG[k];
#pragma unroll
            for (int e = 0; e < BV; ++e) s[e] = sS[k * SS + e] * d;
#pragma unroll 4
            for (int t = 0; t < BT; ++t) {
                const float kgv = tK[t * CK + k];
                const float* nrow = sN + t * SS;
#pragma unroll
                for (int e = 0; e < BV; e += 4) {
                    const float4 n4 = *reinterpret_cast<const float4*>(nrow + e);
                    s[e] += kgv * n4.x;
                    s[e + 1] += kgv * n4.y;
                    s[e + 2] += kgv * n4.z;
                    s[e + 3] += kgv * n4.w;
                }
            }
#pragma unroll
            for (int e = 0; e < BV; ++e) sS[k * SS + e] = s[e];
        }
    }
    cp_async_wait<0>(); // the last chunk's empty groups (none in flight past the piece)
    __syncthreads();

    // The state of the piece's end: rounded into the slot, or carried in f32 to the next window.
    if (flags & KDA_PIECE_TO_SLOT) {
        const kda_u32 sr_base =
            p.sr ? kda_sr_base(((kda_u64)p.seed_hi << 32) | p.seed_lo, p.layer, slot, p.epoch) : 0u;
        const kda_u32 elem0 = hv * (kda_u32)(K * V);
        for (int e = tid; e < K * BV; e += blockDim.x) {
            const int k = e / BV, cc = e - k * BV, v = v0 + cc;
            if (v >= V) continue;
            const kda_u32 off = state_off(k, v);
            const float x = sS[k * SS + cc];
            head[off] = p.sr ? round_elem<true>(x, sr_base, elem0 + off) : round_elem<false>(x, sr_base, elem0 + off);
        }
    } else {
        for (int e = tid; e < K * BV; e += blockDim.x) {
            const int k = e / BV, cc = e - k * BV, v = v0 + cc;
            if (v < V) carry[(size_t)k * V + v] = sS[k * SS + cc];
        }
    }
}

// After a chunked prefill's last window on a pool with a ring: each sequence's ring left empty
// (length, pending, arrivals, stored delta vectors), as a prefill must leave it (its pending
// entries were folded by kda_chunk_state, its drafts dropped). One thread per sequence.
extern "C" __global__ void __launch_bounds__(128) kda_chunk_ring_reset(const KdaParams p) {
    const kda_u32 n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= p.n_seqs) return;
    const kda_u32 slot = reinterpret_cast<const kda_u32*>(p.slots)[n];
    kda_u32* meta = reinterpret_cast<kda_u32*>(p.meta) + (size_t)slot * 4;
    meta[0] = meta[1] = meta[2] = meta[3] = 0u;
}
