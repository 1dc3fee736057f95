// Chunked prefill (spec section 3) in three kernels per window of chunks (docs/architecture.md,
// "Chunked prefill"); part of the kda_step module (the activations, the layouts and the
// rounding are kda_decode.cu's). The host cuts the call's sequences into chunks of at most BT
// tokens (never across a sequence) and packs them, in order, into windows whose scratch fits a
// budget; a sequence longer than a window continues in the next one (its f32 state carried).
// Per window:
// - kda_chunk_prep, one CTA per (chunk, value head), every chunk at once: the activations, the
//   chunk-local cumulative log-decay Gc, Akk and Aqk, w = (I + Akk)^-1 (beta k exp(Gc)) and
//   u = (I + Akk)^-1 (beta v) by blocked substitution, q exp(Gc), k exp(Gc_last - Gc) and
//   exp(Gc_last), into f32 scratch;
// - kda_chunk_state, one CTA per (piece, value head, BV value columns; kda_chunk_state_narrow:
//   BVN columns, where the wider CTAs would leave multiprocessors idle): the state's columns in
//   shared memory, chunk after chunk the state at the chunk's start to the scratch, v_new = u -
//   w S (over u) and S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T v_new; the state read from
//   the slot (or the carry) at the piece's start and stored, rounded to the pool's element, at
//   its end;
// - kda_chunk_out, one CTA per (chunk, value head, OBV value columns), every chunk at once: the
//   outputs q exp(Gc) S + Aqk v_new.
// Every exponent is a difference Gc_i - Gc_j with j <= i, or Gc itself, kept in log2 units
// (exp2_nonpos), so nothing overflows for log-decays <= 0. A ring's pending entries are folded
// first by kda_chunk_state in f32 (no store in between), and kda_chunk_ring_reset empties the
// ring after the last window.

// Must match crates/kda-kernels/src/cuda/chunk_plan.rs (`ChunkParams`) field for field.
struct KdaChunkParams {
    kda_u64 chunks;               // u32 [n_chunks][2]: first token, tokens (1..=BT)
    kda_u64 pieces;               // u32 [n_pieces][4]: first chunk, chunks, sequence, flags
    // f32 scratch, per (chunk, value head): w, kg [BT][SK] (as swz lays them out), qg [BT][K], u [BT][V],
    // aqk [BT][BT], gl [K]
    kda_u64 w, qg, kg, u, aqk, gl;
    kda_u64 hs;                   // f32 scratch, per (chunk, value head): [K][V] the state at the chunk's start
    kda_u64 carry;                // f32 [HV][K][V]: the state of the sequence a window leaves open
    kda_u64 prep_items;           // kda_chunk_prep's (chunk, value head) items: the window's chunks x HV
};

#define KDA_PIECE_FROM_SLOT 1u // the piece starts from the slot's state (else from the carry)
#define KDA_PIECE_TO_SLOT 2u   // the piece ends by storing the slot's state (else the carry)

namespace kda {

constexpr int BT = 64;                 // tokens per chunk (cpu::chunk::BT)
constexpr int CK = roundup(K, 4) + 4;  // smem row stride of K-wide rows: 16-byte rows, j-th row at bank 4 j
constexpr int CV = roundup(V, 4) + 4;  // of V-wide rows
constexpr int CA = BT + 4;             // of Akk rows
constexpr int PREP_THREADS = 512;
constexpr int BC = 16;                 // tokens per sub-chunk of Akk and Aqk
constexpr int TS = BC + 4;             // smem row stride of kda_chunk_prep's T_I blocks (A fragments conflict-free)
constexpr int BV = 32;                 // value columns per kda_chunk_state CTA
constexpr int BVN = 16;                // per kda_chunk_state_narrow CTA
constexpr int STATE_THREADS = 256;     // eight warps: phase A by 16-row blocks and column halves
constexpr int OBV = 64;                // value columns per kda_chunk_out CTA
constexpr int OSS = OBV + 8;           // smem row stride of its state's and v_new's columns
constexpr int OUT_THREADS = 256;       // one warp per 16 chunk rows and 32 value columns
constexpr float LOG2E = 1.4426950408889634f;
// w and k exp(Gc_last - Gc): their rows in the scratch and in kda_chunk_state's tW, tK. Where
// K % 32 == 0 (SWZ), rows of K floats, dense, each row's 16-byte pieces permuted as swz lays
// them out; else rows of CK, as in shared memory elsewhere.
constexpr bool SWZ = K % 32 == 0;
constexpr int SK = SWZ ? K : CK;
// kda_chunk_prep's sQ and sV, where step 5 solves its right-hand sides in place: where XSW (K
// and V multiples of 16), rows of CX and CVX floats, 16 mod 32 (two adjacent rows' 16-byte
// pieces in different bank quads), step 5's elements where xsw puts them, so that its B
// fragments and the rows of its tiles are conflict-free (in rows of CK, 4 mod 32, both were
// two-way conflicts: ncu, seventieth session); else rows of CK and CV.
constexpr bool XSW = K % 16 == 0 && V % 16 == 0;
constexpr int CX = XSW ? roundup(K, 32) + 16 : CK;
constexpr int CVX = XSW ? roundup(V, 32) + 16 : CV;
// Shared-memory layouts, float offsets. kda_chunk_prep: sK, sQ, sG, sV, sA, sB, sF (step 3's
// factored columns of the diagonal blocks, then its factored rows and columns of the blocks left
// of them, then step 5's inverses of the diagonal blocks).
constexpr int PREP_Q = BT * CK, PREP_G = PREP_Q + BT * CX, PREP_V = PREP_G + BT * CK, PREP_A = PREP_V + BT * CVX,
              PREP_B = PREP_A + BT * CA, PREP_F = PREP_B + BT,
              PREP_END = PREP_F + ((BT + BC) * CK > BT * TS ? (BT + BC) * CK : BT * TS);
// kda_chunk_state with NB value columns per CTA: sS, sN (rows of SS = NB + 8 floats: B
// fragments conflict-free), then the chunk's scratch tW, tK, tU, tG (two CTAs per SM at K = V
// = 128). kda_chunk_out: sS, sN (OBV columns), tQ, tA.
template <int NB> struct StateCols {
    static constexpr int SS = NB + 8;
    static constexpr int N = K * SS, W = N + BT * SS, KG = W + BT * SK, U = KG + BT * SK, G = U + BT * NB, END = G + K;
};
constexpr int OUT_N = K * OSS, OUT_Q = OUT_N + BT * OSS, OUT_A = OUT_Q + BT * CK, OUT_END = OUT_A + BT * CA;
static_assert(STATE_THREADS == 32 * (BT / 16) * 2, "kda_chunk_state: four warps per column half");
static_assert(OUT_THREADS == 32 * (BT / 16) * (OBV / 32), "kda_chunk_out: one warp per 16 rows and 32 columns");
static_assert(PREP_THREADS % BT == 0 && PREP_THREADS % (BT / BC) == 0 && PREP_THREADS % 64 == 0,
              "kda_chunk_prep: its thread maps");
// Whether kda_chunk_prep stages an item's raw rows (k, q, g, v and dt_bias) in shared memory by
// cp.async, issued during the previous item's solve (step 5) into sK and sG, which the solve no
// longer reads: 2-byte inputs whose raw rows fit there, each thread's share of them read in one
// pass of step 1 (its registers hold them across the barrier before the f32 rows overwrite
// them). At one CTA per SM an item's loads waited on DRAM: about a fifth of the kernel.
constexpr bool PREP_STAGED = sizeof(IT) == 2 && BT * K <= 16 * PREP_THREADS && BT * V <= 16 * PREP_THREADS &&
                             2 * BT * (K + V) + 4 * K <= 4 * BT * CK && K % 8 == 0 && V % 8 == 0;
// Whether kda_chunk_state copies a chunk's w, k exp(Gc_last - Gc) and exp(Gc_last) as bulk
// copies (sm_90's cp.async.bulk on an mbarrier; and the offline emulator, through their plain
// stand-ins), else by cp.async from every thread.
#if (!defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || \
    defined(KDA_EMU_MMA_TF32)
constexpr bool STATE_BULK = true;
#else
constexpr bool STATE_BULK = false;
#endif

} // namespace kda

// The dynamic shared memory each kernel carves up, in bytes, and whether kda_chunk_prep
// stages its items (PREP_STAGED), between two marker words: the host sizes its launches with
// chunk_plan.rs's prep_smem, state_smem and out_smem and picks the preparation's grid with its
// prep_staged, and the NVRTC test of registry.rs reads these words out of the compiled module
// to hold the two to the same numbers.
extern "C" __device__ const kda_u32 kda_chunk_smem_bytes[7] = {
    0x4b444153u, 4u * kda::PREP_END, 4u * kda::StateCols<kda::BV>::END, 4u * kda::StateCols<kda::BVN>::END,
    4u * kda::OUT_END, kda::PREP_STAGED ? 1u : 0u, 0x534d454du};

namespace kda {

// 2^x for x <= 0 (every exponent of kda_chunk_prep): ex2.approx.ftz, without exp2f's range
// check for results below 2^-126 (flushed to 0 here: a decay that small adds nothing). exp2f
// elsewhere.
__device__ __forceinline__ float exp2_nonpos(float x) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// Scratch of (chunk ch, value head hv): the element offset of its block of `per` floats.
__device__ __forceinline__ size_t chunk_block(const KdaParams& p, kda_u32 ch, kda_u32 hv, size_t per) {
    return ((size_t)ch * p.hv + hv) * per;
}

// The offset of element (r, c) of a [BT][SK] block of w or k exp(Gc_last - Gc). With SWZ, row
// r's 16-byte piece c / 4 lies at piece (c / 4) ^ swz_f(r % 8), swz_f = 0 2 4 6 1 3 5 7: one
// piece of eight consecutive rows (phase A's ldmatrix) and two adjacent pieces of rows t4 or
// t4 + 4, t4 < 4 (phase C's transposed fragments) fall in eight different bank quads, while
// the block stays dense: rows in whole 128-byte lines. (Rows of CK in the scratch, every other
// one 16 bytes past a line, ran kda_chunk_state_narrow 25% longer where it read them with
// cp.async: sixty-eighth session.)
__device__ __forceinline__ int swz_f(int r) { return ((r & 3) << 1) | ((r >> 2) & 1); }
__device__ __forceinline__ int swz(int r, int c) {
    if constexpr (SWZ)
        return r * SK + (((c >> 2) ^ swz_f(r)) << 2) + (c & 3);
    else
        return r * SK + c;
}

// ROWS rows of `width` floats (a multiple of 4, at most WIDTH) from src (row stride ss) to dst
// (row stride DS), 16 bytes per cp.async, by the CTA's NT threads. Where NT is a multiple of
// the pieces per row, each thread keeps one column and steps down the rows by constant
// strides (the loop with a division per piece took a fifth of kda_chunk_state's
// instructions: sixtieth session).
template <int ROWS, int WIDTH, int DS, int NT>
__device__ __forceinline__ void copy_rows(float* dst, const float* src, size_t ss, int width = WIDTH) {
    constexpr int PIECES = WIDTH >= 4 ? WIDTH / 4 : 1; // (WIDTH < 4: a shape no window launches)
    const int tid = threadIdx.x;
    if constexpr (NT % PIECES == 0) {
        constexpr int RSTEP = NT / PIECES;
        const int x = 4 * (tid % PIECES), r = tid / PIECES;
        if (x >= width) return;
        dst += r * DS + x;
        src += r * ss + x;
#pragma unroll
        for (int i = 0; i < (ROWS + RSTEP - 1) / RSTEP; ++i)
            if ((ROWS % RSTEP == 0 || r + i * RSTEP < ROWS)) cp_async16(dst + i * RSTEP * DS, src + i * RSTEP * ss);
    } else {
        const int pieces = width / 4;
        for (int e = tid; e < ROWS * pieces; e += NT) {
            const int r = e / pieces, x = 4 * (e - r * pieces);
            cp_async16(dst + r * DS + x, src + r * ss + x);
        }
    }
}

// Where step 5 of kda_chunk_prep keeps element (r, c) of its right-hand sides (row r of sQ or
// sV, column c): with XSW, each row's 16-byte pieces within an aligned group of four (a warp's
// 16 columns) swapped in pairs where r & 2, so that a B fragment's rows t4 and t4 + 2 and a
// tile's rows g and g + 2 meet different bank quads.
__device__ __forceinline__ int xsw(int r, int c) {
    if constexpr (XSW)
        return c ^ ((r & 2) << 2);
    else
        return c;
}

#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KDA_LDMATRIX 1
// frag_a_tile's ldmatrix.x4, row: the lane's row address (a tf32 row of four is a b16 row of
// eight; matrix m from lanes 8 m .. 8 m + 7 gives register m), split into tf32 hi parts and rests.
__device__ __forceinline__ void ldmatrix_split(const float* row, kda_u32 (&h)[4], kda_u32 (&l)[4]) {
    kda_u32 x[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "r"(smem_addr(row)));
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_split_fast(__uint_as_float(x[i]), h[i], l[i]);
}
#else
#define KDA_LDMATRIX 0
#endif

// The A fragment of the m16n8k8 tile at a (row-major, row stride ld, in shared memory, 16-byte
// aligned rows), split into tf32 hi parts and rests (the lane's (g, t4), (g + 8, t4), (g, t4 +
// 4), (g + 8, t4 + 4)): one ldmatrix.x4 where the device has it, in place of four 4-byte loads
// (the chunk kernels' products: sixty-fourth session).
__device__ __forceinline__ void frag_a_tile(const float* a, int ld, kda_u32 (&h)[4], kda_u32 (&l)[4]) {
    const int lane = threadIdx.x & 31;
#if KDA_LDMATRIX
    ldmatrix_split(a + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 4 * (lane >> 4), h, l);
#else
    const float* p = a + (lane >> 2) * ld + (lane & 3);
    tf32_split_fast(p[0], h[0], l[0]);
    tf32_split_fast(p[8 * ld], h[1], l[1]);
    tf32_split_fast(p[4], h[2], l[2]);
    tf32_split_fast(p[8 * ld + 4], h[3], l[3]);
#endif
}

// frag_a_tile's fragment at column k0 (a multiple of 8) of a [BT][SK] block laid out as swz
// does (a: the tile's first row, one at a multiple of 8 in the block, so that swz's offsets
// from it hold).
__device__ __forceinline__ void frag_a_tile_swz(const float* a, int k0, kda_u32 (&h)[4], kda_u32 (&l)[4]) {
    const int lane = threadIdx.x & 31;
#if KDA_LDMATRIX
    // (swz's offset written out, as measured; through swz, 8 instructions fewer, unmeasured)
    const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
    ldmatrix_split(a + r * SK + ((((k0 >> 2) + (lane >> 4)) ^ swz_f(lane & 7)) << 2), h, l);
#else
    const int g = lane >> 2, c = k0 + (lane & 3);
    tf32_split_fast(a[swz(g, c)], h[0], l[0]);
    tf32_split_fast(a[swz(g + 8, c)], h[1], l[1]);
    tf32_split_fast(a[swz(g, c + 4)], h[2], l[2]);
    tf32_split_fast(a[swz(g + 8, c + 4)], h[3], l[3]);
#endif
}

// acc += A B for a warp's 16 rows and 8 NT columns of B on the tensor cores (3xTF32): NT
// interleaved m16n8k8 tiles sharing the A fragments. A's rows from a (row-major in shared
// memory as frag_a_tile takes it, the warp's first row), kn columns of it (a multiple of 8);
// B's kn rows from b (row stride ldb, in shared memory, b and ldb aligned to NT floats). Tile
// nt's column j is b's column NT j + nt, so that a lane's B elements of all tiles are adjacent
// (one NT-wide load a row; as 8-column tiles side by side they were NT loads) and its
// accumulators adjacent columns: see frag_row. ASW: A is a [BT][SK] block laid out as swz does
// (frag_a_tile_swz). BSW: B's element (r, c) lies at column xsw(r, c) (b's first row a multiple
// of 16 rows into the block xsw lays out).
template <int NT, bool ASW = false, bool BSW = false>
__device__ __forceinline__ void warp_product(float (&acc)[NT][4], const float* a, int lda, const float* b, int ldb,
                                             int kn, int g, int t4) {
    static_assert(NT == 1 || NT == 2 || NT == 4, "warp_product: 1, 2 or 4 tiles");
    float s1[NT][4] = {}, s2[NT][4] = {};
#pragma unroll 4
    for (int k0 = 0; k0 < kn; k0 += 8) {
        kda_u32 ah[4], al[4];
        if constexpr (ASW)
            frag_a_tile_swz(a, k0, ah, al); // (lda: SK)
        else
            frag_a_tile(a + k0, lda, ah, al);
        float b0[NT], b1[NT];
        const int bc = BSW ? xsw(t4, NT * g) : NT * g; // (k0 % 8 == 0: rows k0 + t4 and k0 + t4 + 4 alike)
        kda_load_vec<float, NT>(b + (k0 + t4) * ldb + bc, b0);
        kda_load_vec<float, NT>(b + (k0 + t4 + 4) * ldb + bc, b1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            kda_u32 bh0, bl0, bh1, bl1;
            tf32_split_fast(b0[nt], bh0, bl0);
            tf32_split_fast(b1[nt], bh1, bl1);
            mma_3xtf32_apart(acc[nt], s1[nt], s2[nt], ah, al, bh0, bh1, bl0, bl1);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += s1[nt][e] + s2[nt][e];
}

// A lane's accumulators of warp_product<NT> in its row g + 8 h, in column order: x[c] is column
// 2 NT t4 + c of the product (c < 2 NT).
template <int NT>
__device__ __forceinline__ void frag_row(const float (&acc)[NT][4], int h, float (&x)[2 * NT]) {
#pragma unroll
    for (int c = 0; c < 2 * NT; ++c) x[c] = acc[c % NT][2 * h + c / NT];
}

// x = y (SUB: x -= y) for a lane's elements of warp_product<NT>'s product y, in rows g and g + 8
// of x (row stride rs, 8 NT columns; x and rs aligned to 2 NT floats; XS: at xsw's columns, x's
// first row a multiple of 16 rows into the block xsw lays out).
template <int NT, bool SUB, bool XS = false>
__device__ __forceinline__ void frag_rows_to(float* x, int rs, const float (&y)[NT][4], int g, int t4) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float v[2 * NT];
        frag_row<NT>(y, h, v);
        float* xr = x + (g + 8 * h) * rs + (XS ? xsw(g, 2 * NT * t4) : 2 * NT * t4);
#pragma unroll
        for (int c0 = 0; c0 < 2 * NT; c0 += 4) { // 16 bytes at most a load and store
            constexpr int W = 2 * NT < 4 ? 2 * NT : 4;
            float o[W];
            if constexpr (SUB) kda_load_vec<float, W>(xr + c0, o);
#pragma unroll
            for (int c = 0; c < W; ++c) {
                if constexpr (SUB)
                    o[c] -= v[c0 + c];
                else
                    o[c] = v[c0 + c];
            }
            kda_store_vec<float, W>(xr + c0, o);
        }
    }
}

// kda_chunk_prep's step 5 for one warp's 8 NT columns x of [w | u] (row stride rs): block after
// block I, R_I = rhs_I - Akk_{I,<I} x_{<I}, then x_I = T_I R_I, in place for the blocks after
// it and to out (global memory: the scratch; column oc, row stride os, or with sw (NT == 2) a
// [BT][SK] block laid out as swz does) from the tiles. XS: x's elements where xsw puts them.
template <int NT, bool XS>
__device__ __forceinline__ void prep_solve_cols(float* out, int os, int oc, bool sw, float* x, int rs, const float* sA,
                                                const float* sT, int g, int t4) {
    for (int i0 = 0; i0 < BT; i0 += BC) {
        float r[NT][4] = {};
        warp_product<NT, false, XS>(r, sA + i0 * CA, CA, x, rs, i0, g, t4);
        frag_rows_to<NT, true, XS>(x + i0 * rs, rs, r, g, t4);
        KDA_SYNCWARP(); // R_I in place, for the B fragments
        float y[NT][4] = {};
        warp_product<NT, false, XS>(y, sT + i0 * TS, TS, x + i0 * rs, rs, BC, g, t4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v[2 * NT];
            frag_row<NT>(y, h, v);
            const int i = i0 + g + 8 * h, cc = oc + 2 * NT * t4;
            kda_store_vec<float, 2 * NT>(sw ? out + swz(i, cc) : out + (size_t)i * os + cc, v);
        }
        if (i0 + BC < BT) {
            KDA_SYNCWARP(); // every lane has read R_I
            frag_rows_to<NT, false, XS>(x + i0 * rs, rs, y, g, t4);
            KDA_SYNCWARP(); // x_I in place, for the next blocks' B fragments
        }
    }
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

// The slot's pending ring entries folded into the state's NB columns sS ([K][NB + 8], f32) as tokens
// without output (spec section 2: decay, v - k S, the rank-1 update), so the prefill starts from
// the true state without a store in between (a 2-byte pool rounds it once, at the end). The
// ring record is read here, checked and clamped by kda_step's plan (plan_from: a prefill
// folds the pending entries, drops the drafts), and cleared by kda_chunk_ring_reset after the
// call's last window. `first`: the CTA that records a corrupt record in the error word.
template <int NB>
__device__ __forceinline__ void fold_pending(const KdaParams& p, kda_u32 slot, kda_u32 hv, int v0, float* sS,
                                             bool first) {
    constexpr int SS = StateCols<NB>::SS;
    __shared__ float fk[K], fd[K], fv[NB], fu[NB], fred[STATE_THREADS / 32][NB + 1];
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
        if (lane == 0) fred[warp][NB] = ss;
        for (int cc = tid; cc < NB; cc += blockDim.x) fv[cc] = v0 + cc < V ? kda_load(vp[v0 + cc]) : 0.0f;
        if (tid == 0) fbeta = act_beta(kda_load(base[ring_off_beta(p, hv)]), p);
        __syncthreads();
        if (p.l2norm) {
            float tot = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += fred[w][NB];
            const float nrm = sqrtf(tot + 1e-6f);
            __syncthreads(); // every thread has read the sums
            for (int kk = tid; kk < K; kk += blockDim.x) fk[kk] = fk[kk] / nrm;
            __syncthreads();
        }
        // decay the rows, then k S per column
        float part[NB];
#pragma unroll
        for (int cc = 0; cc < NB; ++cc) part[cc] = 0.0f;
        for (int k = tid; k < K; k += blockDim.x) {
#pragma unroll
            for (int cc = 0; cc < NB; ++cc) {
                const float x = sS[k * SS + cc] * fd[k];
                sS[k * SS + cc] = x;
                part[cc] += fk[k] * x;
            }
        }
#pragma unroll
        for (int cc = 0; cc < NB; ++cc) {
            const float x = warp_sum(part[cc]);
            if (lane == 0) fred[warp][cc] = x;
        }
        __syncthreads();
        if (tid < NB) {
            float ks = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) ks += fred[w][tid];
            fu[tid] = fbeta * (fv[tid] - ks);
        }
        __syncthreads();
        for (int k = tid; k < K; k += blockDim.x) {
#pragma unroll
            for (int cc = 0; cc < NB; ++cc) sS[k * SS + cc] += fk[k] * fu[cc];
        }
        __syncthreads();
    }
}

// kda_chunk_prep's item: chunk ch of the window and value head hv (item = ch * HV + hv), the
// chunk's first token and tokens, the raw A_log of hv and, per thread, the raw beta of token
// tid (kept raw until used, so that its load stays in flight).
struct PrepItem {
    kda_u32 ch, hv, tok0;
    int len;
    float a_log;
    IT beta_raw;
};

// The table row and A_log of item `item` (its beta: prep_beta, once tok0 has arrived).
__device__ __forceinline__ PrepItem prep_item(const KdaParams& p, const KdaChunkParams& c, kda_u32 item) {
    const kda_u32 ch = item / p.hv, hv = item - ch * p.hv;
    const kda_u32* ct = reinterpret_cast<const kda_u32*>(c.chunks) + 2 * (size_t)ch;
    PrepItem it;
    it.ch = ch;
    it.hv = hv;
    it.tok0 = ct[0];
    it.len = (int)ct[1];
    it.a_log = p.gate_mode ? reinterpret_cast<const float*>(p.a_log)[hv] : 0.0f;
    return it;
}

// Thread tid's raw beta of `it` (token tid of the chunk, where it has one).
__device__ __forceinline__ void prep_beta(const KdaParams& p, PrepItem& it, int tid) {
    if (tid < it.len) it.beta_raw = reinterpret_cast<const IT*>(p.beta)[(it.tok0 + (size_t)tid) * p.hv + it.hv];
}

// Where PREP_STAGED's raw rows of an item lie in kda_chunk_prep's shared memory (prep_raw): k,
// then q in sK; g, v, then dt_bias's row in f32 in sG (BT rows of K or V elements an array).
struct PrepRaw {
    IT *k, *q, *g, *v;
    float* bias;
};

__device__ __forceinline__ PrepRaw prep_raw(float* sK, float* sG) {
    IT* k = reinterpret_cast<IT*>(sK);
    IT* g = reinterpret_cast<IT*>(sG);
    return {k, k + BT * K, g, g + BT * K, reinterpret_cast<float*>(g + BT * K + BT * V)};
}

// The raw rows of `it` into sK and sG as prep_raw lays them out, by cp.async, 16 bytes a copy,
// by threads tid = 0 .. nt - 1 of the CTA, one committed group each; rows past the chunk's end
// are not copied (step 1 reads zeros for them).
__device__ __forceinline__ void prep_stage(const KdaParams& p, const PrepItem& it, float* sK, float* sG, int tid,
                                           int nt) {
    const PrepRaw raw = prep_raw(sK, sG);
    const size_t h = it.hv / (p.hv / p.h);
    constexpr int EK = K / 8, EV = V / 8; // 16-byte pieces of a row
    for (int e = tid; e < it.len * EK; e += nt) {
        const int t = e / EK, x = 8 * (e - t * EK);
        const size_t tok = it.tok0 + (size_t)t;
        cp_async16(raw.k + t * K + x, reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K + x);
        cp_async16(raw.q + t * K + x, reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K + x);
        cp_async16(raw.g + t * K + x, reinterpret_cast<const IT*>(p.g) + (tok * p.hv + it.hv) * K + x);
    }
    for (int e = tid; e < it.len * EV; e += nt) {
        const int t = e / EV, x = 8 * (e - t * EV);
        cp_async16(raw.v + t * V + x, reinterpret_cast<const IT*>(p.v) + ((it.tok0 + (size_t)t) * p.hv + it.hv) * V + x);
    }
    if (p.gate_mode)
        for (int e = tid; e < K / 4; e += nt)
            cp_async16(raw.bias + 4 * e, reinterpret_cast<const float*>(p.dt_bias) + (size_t)it.hv * K + 4 * e);
    cp_async_commit();
}

// kda_chunk_prep's work on one item in its dynamic shared memory csm; `next` (where `more`)
// is the CTA's next item, whose beta is read and (PREP_STAGED) raw rows copied once this item's
// step 4 is done.
__device__ __forceinline__ void prep_chunk(float* csm, const KdaParams& p, const KdaChunkParams& c,
                                           const PrepItem& it, PrepItem& next, bool more) {
    float* sK = csm;             // [BT][CK] activated keys (PREP_STAGED: first the raw k and q)
    float* sQ = csm + PREP_Q;    // [BT][CX] activated, scaled queries; then beta k exp(Gc), then w's first blocks
    float* sG = csm + PREP_G;    // [BT][CK] log-decays; then Gc in log2 units (PREP_STAGED: first the raw g, v, dt_bias)
    float* sV = csm + PREP_V;    // [BT][CVX] values; then beta v, then u's first blocks
    float* sA = csm + PREP_A;    // [BT][CA] Akk: beta_i k_i . k_j exp(Gc_i - Gc_j), j < i
    float* sB = csm + PREP_B;    // [BT] beta
    float* sF = csm + PREP_F;    // [2 BC + BT - BC][CK] the factored rows and columns of Akk, Aqk
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = PREP_THREADS / 32;
    const kda_u32 ch = it.ch, hv = it.hv, tok0 = it.tok0;
    const int len = it.len;
    const size_t h = hv / (p.hv / p.h);
    const float a_exp = p.gate_mode ? expf(it.a_log) : 0.0f;
    const PrepRaw raw = prep_raw(sK, sG);
    const IT* in_k = PREP_STAGED ? raw.k : reinterpret_cast<const IT*>(p.k);
    const IT* in_q = PREP_STAGED ? raw.q : reinterpret_cast<const IT*>(p.q);
    const IT* in_g = PREP_STAGED ? raw.g : reinterpret_cast<const IT*>(p.g);
    const IT* in_v = PREP_STAGED ? raw.v : reinterpret_cast<const IT*>(p.v);
    const float* bias = PREP_STAGED ? raw.bias : reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K;
    if constexpr (PREP_STAGED) cp_async_wait<0>(); // this item's raw rows (prep_stage)
    __syncthreads(); // and the previous item's step 5 has read sQ and sV

    // 1. The chunk's raw rows, four channels per load and LB loads per thread and array in
    //    flight before any is used (one at a time, each waited on, this step took about a
    //    third of the kernel: fifty-ninth session); the log-decays in log2 units, for a
    //    2-byte pool from the approximate softplus as its decode takes them (about 35
    //    instructions fewer per element; an fp32 pool keeps the CPU backend's arithmetic:
    //    docs/accuracy.md); rows past the chunk's end 0 (they change nothing).
    {
        constexpr int LV = 4, LB = 4;                       // K % 16 == 0, V % 8 == 0 (chunk_supported)
        constexpr int NK = BT * K / LV, NV = BT * V / LV, NE = NK > NV ? NK : NV;
        static_assert(!PREP_STAGED || NE <= LB * PREP_THREADS, "kda_chunk_prep: staged rows read in one pass");
        // a thread's row and channels in the input (staged: the row of the chunk)
        const auto row_k = [&](size_t t, size_t heads, size_t head) { return PREP_STAGED ? t : (tok0 + t) * heads + head; };
        for (int e0 = 0; e0 < NE; e0 += LB * PREP_THREADS) {
            float kx[LB][LV], qx[LB][LV], gx[LB][LV], vx[LB][LV], bx[LB][LV];
#pragma unroll
            for (int b = 0; b < LB; ++b) {
                const int e = e0 + b * PREP_THREADS + tid;
                const int t = e * LV / K, kk = e * LV - t * K, tv = e * LV / V, cv = e * LV - tv * V;
#pragma unroll
                for (int i = 0; i < LV; ++i) kx[b][i] = qx[b][i] = gx[b][i] = vx[b][i] = bx[b][i] = 0.0f;
                if (e < NK && t < len) {
                    kda_load_vec<IT, LV>(in_k + row_k(t, p.h, h) * K + kk, kx[b]);
                    kda_load_vec<IT, LV>(in_q + row_k(t, p.h, h) * K + kk, qx[b]);
                    kda_load_vec<IT, LV>(in_g + row_k(t, p.hv, hv) * K + kk, gx[b]);
                    if (p.gate_mode) kda_load_vec<float, LV>(bias + kk, bx[b]); // log_decay_at's dt_bias
                }
                if (e < NV && tv < len) kda_load_vec<IT, LV>(in_v + row_k(tv, p.hv, hv) * V + cv, vx[b]);
            }
            if constexpr (PREP_STAGED) __syncthreads(); // every raw row read before the f32 rows overwrite them
#pragma unroll
            for (int b = 0; b < LB; ++b) {
                const int e = e0 + b * PREP_THREADS + tid;
                const int t = e * LV / K, kk = e * LV - t * K, tv = e * LV / V, cv = e * LV - tv * V;
                if (e < NK) {
#pragma unroll
                    for (int i = 0; i < LV; ++i) {
                        sK[t * CK + kk + i] = kx[b][i];
                        sQ[t * CX + kk + i] = qx[b][i];
                        sG[t * CK + kk + i] = t < len ? log_decay_at<sizeof(ST) == 2>(gx[b][i], &bx[b][i], p, a_exp) * LOG2E : 0.0f;
                    }
                }
                if (e < NV) {
#pragma unroll
                    for (int i = 0; i < LV; ++i) sV[tv * CVX + cv + i] = vx[b][i];
                }
            }
        }
        if (tid < BT) sB[tid] = tid < len ? act_beta(kda_load(it.beta_raw), p) : 0.0f;
    }
    __syncthreads();

    // 2. l2norm (and the query's scale) in place, one warp per row, act_finish's FAST
    //    arithmetic (times rsqrt: IEEE division called a subroutine, sixtieth session); Gc, one
    //    thread per key channel.
    for (int r = warp; r < 2 * len; r += nwarps) {
        float* row = r < len ? sK + r * CK : sQ + (r - len) * CX;
        float x[KL];
#pragma unroll
        for (int i = 0; i < KL; ++i) {
            const int kk = lane + 32 * i;
            x[i] = kk < K ? row[kk] : 0.0f; // each lane rewrites only the elements it read
        }
        act_finish<true>(x, row, p.l2norm != 0u, r >= len, p.scale, lane);
    }
    for (int kk = tid; kk < K; kk += PREP_THREADS) {
        float run = 0.0f;
        for (int t0 = 0; t0 < BT; t0 += 16) { // 16 loads in flight, then the running sums
            float x[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) x[i] = sG[(t0 + i) * CK + kk];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                run += x[i];
                sG[(t0 + i) * CK + kk] = run;
            }
        }
    }
    __syncthreads();

    // 3. Akk and Aqk over sub-chunks of BC tokens. Diagonal blocks: a warp per two rows, 7 of
    //    their 15 pairs with the exact exp2(Gc_i - Gc_j) of each element (below). Blocks left
    //    of the diagonal (block I, columns of blocks J < I): with r the first token of I,
    //    exp2(Gc_i - Gc_j) =
    //    exp2(Gc_i - Gc_r) exp2(Gc_r - Gc_j), both factors <= 1 (j < r <= i), so the rows k_i
    //    and q_i times the first factor and the columns k_j times the second (in sF, per block
    //    I) meet in a plain product: BT K exponentials per block row instead of one per element
    //    and pair. Aqk (j <= i, else 0) goes to the scratch, beta_i Akk (j < i) to sA.
    {
        float* aq = reinterpret_cast<float*>(c.aqk) + chunk_block(p, ch, hv, (size_t)BT * BT);
        // the diagonal blocks, a warp per task: block blk, its rows a = il and b = BC - 1 - il
        // (il < BC / 2; 15 pairs j < i and two diagonal elements between them), its lanes four key
        // channels each. Row b's pairs with the block's first BC / 2 columns (j < m <= b, m the
        // block's middle row) factor as the blocks left of the diagonal do: k_b and q_b times
        // exp2(Gc_b - Gc_m), column j times exp2(Gc_m - Gc_j) (in sF, once per block), both
        // factors <= 1, their products without exponentials. The task's other 7 pairs (row a's
        // il, row b's last 7 - il) take an exponential per channel. A lane's 32 partial sums
        // (beta_i Akk and Aqk of each pair, then the two rows' q_i . k_i) are reduced transposed
        // at the end, lane L taking sum L. (A thread per pair over all channels loaded from up to
        // 16 rows at once, four wavefronts a load whatever its lanes shared, and took 13.3
        // thousand cycles: sixtieth and sixty-first sessions.)
        {
            static_assert(BC == 16, "kda_chunk_prep: a diagonal task's 2 x 15 + 2 sums fill a warp's lanes");
            constexpr int MB = BC / 2, EX = BC / 2 - 1; // factored and exact pairs of a task
            static_assert((BT / BC) * MB <= BT + BC, "kda_chunk_prep: the factored columns fit sF");
            for (int e = tid; e < (BT / BC) * MB * K / 4; e += PREP_THREADS) {
                const int row = 4 * e / K, kk = 4 * e - row * K;
                const int j = (row / MB) * BC + row % MB, m = (row / MB) * BC + MB;
                const float4 k4 = *reinterpret_cast<const float4*>(sK + j * CK + kk);
                const float4 gj = *reinterpret_cast<const float4*>(sG + j * CK + kk);
                const float4 gm = *reinterpret_cast<const float4*>(sG + m * CK + kk);
                *reinterpret_cast<float4*>(sF + row * CK + kk) =
                    make_float4(k4.x * exp2_nonpos(gm.x - gj.x), k4.y * exp2_nonpos(gm.y - gj.y),
                                k4.z * exp2_nonpos(gm.z - gj.z), k4.w * exp2_nonpos(gm.w - gj.w));
            }
            __syncthreads();
            for (int task = warp; task < (BT / BC) * MB; task += nwarps) {
                const int blk = task / MB, il = task - blk * MB, j0 = blk * BC;
                const int ia = j0 + il, ib = j0 + BC - 1 - il;
                const float* cf = sF + blk * MB * CK; // the block's factored columns
                float x[32];
#pragma unroll
                for (int e = 0; e < 32; ++e) x[e] = 0.0f;
#pragma unroll
                for (int c = 0; c < (K + 127) / 128; ++c) {
                    const int kc = 4 * lane + 128 * c;
                    if (K % 128 != 0 && kc >= K) break; // K % 4 == 0
                    const float4 ka = *reinterpret_cast<const float4*>(sK + ia * CK + kc);
                    const float4 qa = *reinterpret_cast<const float4*>(sQ + ia * CX + kc);
                    const float4 ga = *reinterpret_cast<const float4*>(sG + ia * CK + kc);
                    const float4 kb = *reinterpret_cast<const float4*>(sK + ib * CK + kc);
                    const float4 qb = *reinterpret_cast<const float4*>(sQ + ib * CX + kc);
                    const float4 gb = *reinterpret_cast<const float4*>(sG + ib * CK + kc);
                    const float4 gm = *reinterpret_cast<const float4*>(sG + (j0 + MB) * CK + kc);
                    const float f0 = exp2_nonpos(gb.x - gm.x), f1 = exp2_nonpos(gb.y - gm.y);
                    const float f2 = exp2_nonpos(gb.z - gm.z), f3 = exp2_nonpos(gb.w - gm.w);
                    const float4 kf = make_float4(kb.x * f0, kb.y * f1, kb.z * f2, kb.w * f3);
                    const float4 qf = make_float4(qb.x * f0, qb.y * f1, qb.z * f2, qb.w * f3);
#pragma unroll
                    for (int t = 0; t < MB; ++t) { // sums 2 t, 2 t + 1: row b, column j0 + t
                        const float4 c4 = *reinterpret_cast<const float4*>(cf + t * CK + kc);
                        x[2 * t] += kf.x * c4.x + kf.y * c4.y + kf.z * c4.z + kf.w * c4.w;
                        x[2 * t + 1] += qf.x * c4.x + qf.y * c4.y + qf.z * c4.z + qf.w * c4.w;
                    }
#pragma unroll
                    for (int u = 0; u < EX; ++u) { // sums 2 (MB + u) (+ 1): row a's pairs, then row b's last
                        const bool on_a = u < il; // warp-uniform
                        const int j = j0 + (on_a ? u : MB + u - il);
                        const float4 kj = *reinterpret_cast<const float4*>(sK + j * CK + kc);
                        const float4 gj = *reinterpret_cast<const float4*>(sG + j * CK + kc);
                        const float4 ki = on_a ? ka : kb, qi = on_a ? qa : qb, gi = on_a ? ga : gb;
                        const float e0 = kj.x * exp2_nonpos(gi.x - gj.x), e1 = kj.y * exp2_nonpos(gi.y - gj.y);
                        const float e2 = kj.z * exp2_nonpos(gi.z - gj.z), e3 = kj.w * exp2_nonpos(gi.w - gj.w);
                        x[2 * (MB + u)] += ki.x * e0 + ki.y * e1 + ki.z * e2 + ki.w * e3;
                        x[2 * (MB + u) + 1] += qi.x * e0 + qi.y * e1 + qi.z * e2 + qi.w * e3;
                    }
                    x[30] += qa.x * ka.x + qa.y * ka.y + qa.z * ka.z + qa.w * ka.w;
                    x[31] += qb.x * kb.x + qb.y * kb.y + qb.z * kb.z + qb.w * kb.w;
                }
                const float sum = warp_sums_transposed(x, lane);
                const int v = lane >> 1; // the pair (or the diagonal) of the lane's sum
                if (v < MB + EX) {
                    const bool on_a = v >= MB && v - MB < il;
                    const int i = on_a ? ia : ib, j = j0 + (v < MB ? v : on_a ? v - MB : v - il);
                    if (lane & 1)
                        aq[i * BT + j] = sum;
                    else
                        sA[i * CA + j] = sB[i] * sum;
                } else {
                    const int i = lane & 1 ? ib : ia;
                    aq[i * BT + i] = sum;
                }
            }
        }
        // Aqk above the diagonal: 0 (Akk there, and on it, is never read)
        for (int e = tid; e < BT * BT; e += PREP_THREADS) {
            const int i = e / BT, j = e - i * BT;
            if (j > i) aq[e] = 0.0f;
        }
        // the blocks left of it, one block row I at a time: sF holds the rows k_i and q_i of I
        // times exp2(Gc_i - Gc_r) (rows 0 .. 2 BC), then the columns j < r times exp2(Gc_r -
        // Gc_j); their products on the tensor cores (3xTF32), warp w the 16 x 8 tile (rows of
        // k if w is even, of q if odd; columns 8 (w / 2) ..), its k-steps in two interleaved
        // sums. (On the CUDA cores, with three quarters to one quarter of the threads idle,
        // these blocks took a quarter of the kernel: fifty-ninth session.)
        const int g = lane >> 2, t4 = lane & 3;
        for (int bi = 1; bi < BT / BC; ++bi) {
            const int r = bi * BC;
            __syncthreads(); // sF free (the previous block row's products done)
            // (a token of block I: its k row to sF's row t - r, its q row to BC + t - r, one
            // exponential for both; a column j < r: its k row to 2 BC + j)
            for (int e = tid; e < (BC + r) * K / 4; e += PREP_THREADS) {
                const int row = 4 * e / K, kk = 4 * e - row * K;
                const float4 gr = *reinterpret_cast<const float4*>(sG + r * CK + kk);
                const bool is_row = row < BC; // warp-uniform where K % 128 == 0
                const int t = is_row ? r + row : row - BC;
                const float4 k4 = *reinterpret_cast<const float4*>(sK + t * CK + kk);
                const float4 gt = *reinterpret_cast<const float4*>(sG + t * CK + kk);
                const float s = is_row ? 1.0f : -1.0f; // exp2(Gc_t - Gc_r) for rows, exp2(Gc_r - Gc_t) for columns
                const float f[4] = {exp2_nonpos(s * (gt.x - gr.x)), exp2_nonpos(s * (gt.y - gr.y)),
                                    exp2_nonpos(s * (gt.z - gr.z)), exp2_nonpos(s * (gt.w - gr.w))};
                *reinterpret_cast<float4*>(sF + (is_row ? row : BC + row) * CK + kk) =
                    make_float4(k4.x * f[0], k4.y * f[1], k4.z * f[2], k4.w * f[3]);
                if (is_row) {
                    const float4 q4 = *reinterpret_cast<const float4*>(sQ + t * CX + kk);
                    *reinterpret_cast<float4*>(sF + (BC + row) * CK + kk) =
                        make_float4(q4.x * f[0], q4.y * f[1], q4.z * f[2], q4.w * f[3]);
                }
            }
            __syncthreads();
            if (warp < 2 * (r / 8)) {
                const int mt = warp & 1, n0 = 8 * (warp >> 1);
                float acc[2][4];
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[h2][e] = 0.0f;
                float s1[2][4] = {}, s2[2][4] = {};
                for (int k0 = 0; k0 < K; k0 += 16) { // K % 16 == 0
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2) {
                        kda_u32 ah[4], al[4], bh0, bl0, bh1, bl1;
                        frag_a_tile(sF + BC * mt * CK + k0 + 8 * h2, CK, ah, al);
                        const float* br = sF + (2 * BC + n0 + g) * CK + k0 + 8 * h2 + t4;
                        tf32_split_fast(br[0], bh0, bl0);
                        tf32_split_fast(br[4], bh1, bl1);
                        mma_3xtf32_apart(acc[h2], s1[h2], s2[h2], ah, al, bh0, bh1, bl0, bl1);
                    }
                }
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[h2][e] += s1[h2][e] + s2[h2][e];
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2) {
                    const int i = r + g + 8 * h2, j = n0 + 2 * t4;
                    const float a0 = acc[0][2 * h2] + acc[1][2 * h2], a1 = acc[0][2 * h2 + 1] + acc[1][2 * h2 + 1];
                    if (mt) {
                        *reinterpret_cast<float2*>(aq + i * BT + j) = make_float2(a0, a1);
                    } else {
                        sA[i * CA + j] = sB[i] * a0;
                        sA[i * CA + j + 1] = sB[i] * a1;
                    }
                }
            }
        }
    }
    __syncthreads();

    // 4. q exp(Gc), k exp(Gc_last - Gc) and exp(Gc_last) to the scratch; the right-hand sides
    //    beta k exp(Gc) (over the queries) and beta v (in place).
    {
        float* qg = reinterpret_cast<float*>(c.qg) + chunk_block(p, ch, hv, (size_t)BT * K);
        float* kg = reinterpret_cast<float*>(c.kg) + chunk_block(p, ch, hv, (size_t)BT * SK); // as swz lays it out
        float* gl = reinterpret_cast<float*>(c.gl) + chunk_block(p, ch, hv, K);
        for (int e = tid; e < BT * K / 4; e += PREP_THREADS) { // four channels at a time
            const int t = 4 * e / K, kk = 4 * e - t * K;
            const float4 g4 = *reinterpret_cast<const float4*>(sG + t * CK + kk);
            const float4 gl4 = *reinterpret_cast<const float4*>(sG + (BT - 1) * CK + kk);
            const float4 k4 = *reinterpret_cast<const float4*>(sK + t * CK + kk);
            const float4 q4 = *reinterpret_cast<const float4*>(sQ + t * CX + kk);
            const float gt[4] = {g4.x, g4.y, g4.z, g4.w}, glast[4] = {gl4.x, gl4.y, gl4.z, gl4.w};
            const float kx[4] = {k4.x, k4.y, k4.z, k4.w}, qx[4] = {q4.x, q4.y, q4.z, q4.w};
            float oq[4], ok[4], orhs[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float eg = exp2_nonpos(gt[i]);
                oq[i] = qx[i] * eg;
                ok[i] = kx[i] * exp2_nonpos(glast[i] - gt[i]);
                orhs[i] = sB[t] * kx[i] * eg;
            }
            *reinterpret_cast<float4*>(qg + 4 * e) = make_float4(oq[0], oq[1], oq[2], oq[3]);
            *reinterpret_cast<float4*>(kg + swz(t, kk)) = make_float4(ok[0], ok[1], ok[2], ok[3]);
            // (where xsw moves it, another lane's q4: every lane's read first; BT K / 4 and BT V / 4
            // are multiples of 32, so every lane of a warp takes each pass)
            if constexpr (XSW) KDA_SYNCWARP();
            *reinterpret_cast<float4*>(sQ + t * CX + xsw(t, kk)) = make_float4(orhs[0], orhs[1], orhs[2], orhs[3]);
            if (t == 0)
                *reinterpret_cast<float4*>(gl + kk) =
                    make_float4(exp2_nonpos(glast[0]), exp2_nonpos(glast[1]), exp2_nonpos(glast[2]), exp2_nonpos(glast[3]));
        }
        for (int e = tid; e < BT * V / 4; e += PREP_THREADS) {
            const int t = 4 * e / V, cv = 4 * e - t * V;
            const float4 x = *reinterpret_cast<const float4*>(sV + t * CVX + cv);
            const float b = sB[t];
            if constexpr (XSW) KDA_SYNCWARP();
            *reinterpret_cast<float4*>(sV + t * CVX + xsw(t, cv)) = make_float4(x.x * b, x.y * b, x.z * b, x.w * b);
        }
    }
    __syncthreads();
    // the next item's beta and (staged) raw rows, in flight during the solve: sK and sG are
    // not read again. The copies are issued by the warps that do not compute the inverses
    // below, beside them (issued by every warp before the inverses, they took 2.5 thousand
    // cycles, then the inverses 1.2 thousand on two warps: sixty-third session).
    static_assert(BT % 32 == 0 && BT < PREP_THREADS, "kda_chunk_prep: the inverses' threads are whole warps, not all");
    if (more) {
        prep_beta(p, next, tid);
        if constexpr (PREP_STAGED)
            if (tid >= BT) prep_stage(p, next, sK, sG, tid - BT, PREP_THREADS - BT);
    }

    // 5. w and u: (I + Akk) x = rhs in blocks of BC rows, on the tensor cores (3xTF32, f32
    //    accuracy). First T_I = (I + Akk_II)^-1 of each diagonal block, one thread per block
    //    and column, by substitution (Akk is strictly lower: unit diagonal). Then each warp
    //    takes 16 columns of [w | u] (two interleaved tiles, warp_product<2>) and solves them
    //    block after block, in place in sQ and sV for the blocks after it and from the tiles
    //    to the scratch (prep_solve_cols). A warp owns its columns, so blocks wait on warp
    //    syncs, not barriers.
    //    (Row by row on the CUDA cores, two lanes per column, this step took a quarter of the
    //    kernel: fifty-ninth session. The scratch's w and u copied out of sQ and sV after a
    //    barrier cost 1% of the prefill; T = (I + Akk)^-1 formed first, then every block row of
    //    x = T rhs at once, 2% more: sixty-seventh session.)
    {
        float* sT = sF; // [BT / BC][BC][TS] the inverses T_I (sF is free after step 3)
        for (int e = tid; e < BT; e += PREP_THREADS) {
            const int i0 = (e / BC) * BC, c = e % BC;
            float x[BC];
#pragma unroll
            for (int i = 0; i < BC; ++i) {
                float acc = i == c ? 1.0f : 0.0f;
#pragma unroll
                for (int j = 0; j < i; ++j) acc -= sA[(i0 + i) * CA + i0 + j] * x[j];
                x[i] = acc;
                sT[(i0 + i) * TS + c] = acc;
            }
        }
        __syncthreads();
        const int g = lane >> 2, t4 = lane & 3;
        // a warp's 16 columns of [w | u] (K % 16 == 0: all of w or all of u; V % 16 == 8: u's
        // last 8 alone), to the scratch from the tiles (32-byte row pieces: whole sectors; the
        // next item's barrier orders these reads of sQ and sV before its writes)
        float* wout = reinterpret_cast<float*>(c.w) + chunk_block(p, ch, hv, (size_t)BT * SK); // as swz lays it out
        float* uout = reinterpret_cast<float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V);
        for (int c0 = 16 * warp; c0 < K + V; c0 += 16 * nwarps) {
            const bool of_w = c0 < K;
            float* x = of_w ? sQ + c0 : sV + (c0 - K);
            float* out = of_w ? wout : uout;
            const int rs = of_w ? CX : CVX, os = of_w ? SK : V, oc = of_w ? c0 : c0 - K;
            if ((K + V) % 16 == 0 || c0 + 16 <= K + V)
                prep_solve_cols<2, XSW>(out, os, oc, of_w && SWZ, x, rs, sA, sT, g, t4);
            else // (u's last 8 columns: SWZ's w is whole 16-column blocks; V % 16 != 0, so no XSW)
                prep_solve_cols<1, false>(out, os, oc, false, x, rs, sA, sT, g, t4);
        }
    }
}

} // namespace kda

// Persistent CTAs over the window's (chunk, value head) items, item = chunk * HV + hv, CTA b
// taking items b, b + gridDim.x, ... (c.prep_items in all): with PREP_STAGED, the host launches
// one CTA per SM (its shared memory holds one) and each item's raw rows arrive during the
// previous item's solve; else one CTA per item.
extern "C" __global__ void __launch_bounds__(kda::PREP_THREADS) kda_chunk_prep(const KdaParams p,
                                                                              const KdaChunkParams c) {
    using namespace kda;
    extern __shared__ __align__(16) float csm[]; // chunk_plan.rs's prep_smem
    kda_u32 item = blockIdx.x;
    if (item >= c.prep_items) return;
    PrepItem it = prep_item(p, c, item);
    prep_beta(p, it, threadIdx.x);
    if constexpr (PREP_STAGED) prep_stage(p, it, csm, csm + PREP_G, threadIdx.x, PREP_THREADS);
    for (;;) {
        const kda_u32 after = item + gridDim.x;
        const bool more = after < c.prep_items;
        PrepItem next = more ? prep_item(p, c, after) : it;
        prep_chunk(csm, p, c, it, next, more);
        if (!more) break;
        it = next;
        item = after;
    }
}

// kda_chunk_state's body for NB value columns per CTA (BV, or BVN for kda_chunk_state_narrow).
// One CTA per (piece of the window, value head, NB value columns): blockIdx.x = (piece * HV +
// hv) * vblocks + vb. The chain of a piece, chunk after chunk: the state at the chunk's start
// to the scratch (hs, for kda_chunk_out), v_new = u - w S (to the scratch, over u's columns),
// S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T v_new. The outputs are kda_chunk_out's, every
// chunk at once, off the chain (the chain's work per chunk was 2.5 products, now 2; its
// shared memory fits two CTAs per SM: fifty-ninth session). A chunk's scratch reaches shared
// memory in two groups of copies (bulk copies and cp.async: see issue below), each issued as
// soon as the previous chunk's phase that reads its buffers is done: w and u's columns (phase
// A) during the previous chunk's phase C, k exp(Gc_last - Gc) and exp(Gc_last) (phase C)
// during this chunk's phase A. The products run on the tensor cores (3xTF32 mma.sync, f32
// accuracy). Phase A: warp w the chunk rows 16 (w % 4) .. + 15 and NB / 2 of the CTA's
// columns (NB / 16 tiles of 8). Phase C: warp w 16 columns (two tiles) and every CG-th block
// of 16 key rows, CG = 4 (NB = 32) or 8 (NB = 16), so that a narrow CTA's warps split each A
// fragment once, as the wide one's do.
template <int NB>
__device__ __forceinline__ void kda_chunk_state_cols(const KdaParams& p, const KdaChunkParams& c) {
    using namespace kda;
    static_assert(NB == 16 || NB == 32, "kda_chunk_state: 16 or 32 columns per CTA");
    using L = StateCols<NB>;
    constexpr int SS = L::SS;
    extern __shared__ __align__(16) float csm[]; // chunk_plan.rs's state_smem
    float* sS = csm;        // [K][SS] the state's columns v0 .. v0 + NB
    float* sN = csm + L::N;  // [BT][SS] v_new of the chunk
    float* tW = csm + L::W;  // [BT][SK] w, as swz lays it out
    float* tK = csm + L::KG; // [BT][SK] k exp(Gc_last - Gc), as swz lays it out
    float* tU = csm + L::U;  // [BT][NB] u's columns v0 .. v0 + NB
    float* tG = csm + L::G;  // [K] exp(Gc_last)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    constexpr int VB = (V + NB - 1) / NB;
    const kda_u32 vb = blockIdx.x % VB, rest = blockIdx.x / VB;
    const kda_u32 pi = rest / p.hv, hv = rest - pi * p.hv;
    const kda_u32* pc = reinterpret_cast<const kda_u32*>(c.pieces) + 4 * (size_t)pi;
    const kda_u32 c0 = pc[0], nch = pc[1], seq = pc[2], flags = pc[3];
    const kda_u32 slot = reinterpret_cast<const kda_u32*>(p.slots)[seq];
    const int v0 = (int)vb * NB, nv = V - v0 < NB ? V - v0 : NB; // the CTA's columns that exist
    ST* head = state_head(p, slot, hv);
    float* carry = reinterpret_cast<float*>(c.carry) + (size_t)hv * K * V;

    // The copies of chunk ch's group (1: w, u's columns; 2: k exp(Gc_last - Gc), exp(Gc_last)),
    // committed as one group; none past the piece's last chunk (an empty group, so every
    // thread counts the same groups). STATE_BULK: w, k exp(Gc_last - Gc) (each a contiguous
    // [BT][SK] block) and exp(Gc_last) in one bulk copy each by thread 0, landing on the
    // group's mbarrier (its phase j: the piece's chunk j); u's columns by cp.async from every
    // thread. (Against cp.async from every thread: the wide kernel 1.17x faster, the narrow
    // one 1.07-1.10x, sixty-eighth session; bulk copies of one row each, 193 a chunk, ran the
    // state pass up to twice as long, sixty-seventh.)
    __shared__ kda_u64 bars[2];
    auto issue = [&](int group, kda_u32 ch) {
        if (ch < c0 + nch) {
            constexpr kda_u32 ROWS_BYTES = 4u * BT * SK;
            if (group == 1) {
                const float* W = reinterpret_cast<const float*>(c.w) + chunk_block(p, ch, hv, (size_t)BT * SK);
                if constexpr (STATE_BULK) {
                    if (tid == 0) {
                        bulk_bar_expect(bars, ROWS_BYTES);
                        bulk_in(tW, W, ROWS_BYTES, bars);
                    }
                } else {
                    copy_rows<BT, K, SK, STATE_THREADS>(tW, W, SK);
                }
                const float* U = reinterpret_cast<const float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V);
                copy_rows<BT, NB, NB, STATE_THREADS>(tU, U + v0, V, nv); // V % 8 == 0: whole 16-byte pieces
            } else {
                const float* KG = reinterpret_cast<const float*>(c.kg) + chunk_block(p, ch, hv, (size_t)BT * SK);
                const float* GL = reinterpret_cast<const float*>(c.gl) + chunk_block(p, ch, hv, K);
                if constexpr (STATE_BULK) {
                    if (tid == 0) {
                        bulk_bar_expect(bars + 1, ROWS_BYTES + 4u * K);
                        bulk_in(tK, KG, ROWS_BYTES, bars + 1);
                        bulk_in(tG, GL, 4u * K, bars + 1); // K % 16 == 0: whole 16-byte pieces
                    }
                } else {
                    copy_rows<BT, K, SK, STATE_THREADS>(tK, KG, SK);
                    copy_rows<1, K, K, STATE_THREADS>(tG, GL, K);
                }
            }
        }
        cp_async_commit();
    };
    if constexpr (STATE_BULK) {
        if (tid == 0) {
            bulk_bar_init(bars);
            bulk_bar_init(bars + 1);
        }
        __syncthreads();
    }
    issue(1, c0);
    issue(2, c0);

    for (int e = tid; e < K * NB; e += STATE_THREADS) {
        const int k = e / NB, cc = e - k * NB, v = v0 + cc;
        float x = 0.0f;
        if (v < V) x = (flags & KDA_PIECE_FROM_SLOT) ? kda_load(head[state_off(k, v)]) : carry[(size_t)k * V + v];
        sS[k * SS + cc] = x;
    }
    __syncthreads();
    if ((flags & KDA_PIECE_FROM_SLOT) && p.ring_len > 0) fold_pending<NB>(p, slot, hv, v0, sS, vb == 0 && hv == 0);

    constexpr int RW = BT / 16;                // warps over a chunk's rows (phase A)
    constexpr int NTA = NB / 16;               // phase A's tiles of 8 columns per warp
    constexpr int CG = STATE_THREADS / 32 / (NB / 16); // phase C: warps per 16 columns
    const int r0 = 16 * (warp % RW), ca = (NB / 2) * (warp / RW); // phase A: first row, column
    const int mc = 16 * (warp % CG), cc0 = 16 * (warp / CG);     // phase C: first key row, column
    for (kda_u32 ch = c0; ch < c0 + nch; ++ch) {
        // in flight: groups 1 and 2 of ch; the barrier also orders the previous phase C's state
        const kda_u32 parity = (ch - c0) & 1u;
        cp_async_wait<1>();
        if constexpr (STATE_BULK) bulk_bar_wait<true>(bars, parity);
        __syncthreads();

        // the state at the chunk's start, for kda_chunk_out
        float* hs = reinterpret_cast<float*>(c.hs) + chunk_block(p, ch, hv, (size_t)K * V) + v0;
        {
            constexpr int KSTEP = STATE_THREADS / (NB / 4); // the thread's column stays, its rows step
            static_assert(STATE_THREADS % (NB / 4) == 0, "kda_chunk_state: hs's thread map");
            const int k0 = tid / (NB / 4), cc = 4 * (tid % (NB / 4));
            if (cc < nv) // nv % 8 == 0
#pragma unroll
                for (int k = k0; k < K; k += KSTEP)
                    *reinterpret_cast<float4*>(hs + (size_t)k * V + cc) =
                        *reinterpret_cast<const float4*>(sS + k * SS + cc);
        }

        // A. v_new = u - w S for the warp's 16 rows and NTA 8-column tiles, to sN and over u
        float ws[NTA][4];
#pragma unroll
        for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ws[nt][e] = 0.0f;
        warp_product<NTA, SWZ>(ws, tW + r0 * SK, SK, sS + ca, SS, K, g, t4);
        float* U = reinterpret_cast<float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V) + v0;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            constexpr int W = 2 * NTA; // the lane's adjacent columns of a row (frag_row)
            const int i = r0 + g + 8 * h2, cc = ca + W * t4;
            const bool on = cc < nv; // nv % 8 == 0, cc % W == 0: all W columns or none
            float n[W], u[W] = {};
            frag_row<NTA>(ws, h2, n);
            if (on) kda_load_vec<float, W>(tU + i * NB + cc, u);
#pragma unroll
            for (int x = 0; x < W; ++x) n[x] = on ? u[x] - n[x] : 0.0f;
            kda_store_vec<float, W>(sN + i * SS + cc, n);
            if (on) kda_store_vec<float, W>(U + (size_t)i * V + cc, n);
        }
        cp_async_wait<0>(); // group 2 of ch landed
        if constexpr (STATE_BULK) bulk_bar_wait<true>(bars + 1, parity);
        __syncthreads();
        issue(1, ch + 1); // tW, tU: phase A is done with them

        // C. S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T v_new, 16 key rows per warp at a time
        // The wide CTA's two tiles interleaved, as warp_product<2>'s: acc[nt][e] is (key row m0 + g
        // + 8 (e / 2), column cc0 + 4 t4 + 2 (e % 2) + nt). The narrow CTA's side by side (column
        // cc0 + 8 nt + 2 t4 + e % 2), each tile's B elements loaded in the tile loop: interleaved,
        // it took 117 registers instead of 80 and its prefills ran 1.5-2% slower (sixty-sixth
        // session).
        constexpr bool INTER = NB == BV;
        // the narrow CTA's element (nt, e) of the tiles at key row m0: its offset in sS
        const auto side_at = [&](int m0, int nt, int e) {
            return (m0 + g + 8 * (e >> 1)) * SS + cc0 + 8 * nt + 2 * t4 + (e & 1);
        };
        for (int m0 = mc; m0 < K; m0 += 16 * CG) {
            float acc[2][4];
            if constexpr (INTER) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int k = m0 + g + 8 * h;
                    const float4 x = *reinterpret_cast<const float4*>(sS + k * SS + cc0 + 4 * t4);
                    acc[0][2 * h] = tG[k] * x.x, acc[1][2 * h] = tG[k] * x.y;
                    acc[0][2 * h + 1] = tG[k] * x.z, acc[1][2 * h + 1] = tG[k] * x.w;
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[nt][e] = tG[m0 + g + 8 * (e >> 1)] * sS[side_at(m0, nt, e)];
            }
            // (warp_product's loop with a transposed A, in place of this one, measured up to 2.5%
            // slower: sixtieth session)
            float s1[2][4] = {}, s2[2][4] = {};
#pragma unroll
            for (int i0 = 0; i0 < BT; i0 += 8) {
                // A = (k exp(Gc_last - Gc))^T: element (key row, chunk row i) is KG[i][key]
                kda_u32 ah[4], al[4];
                if constexpr (SWZ) { // frag_a_split_t's elements, where swz puts them
                    tf32_split_fast(tK[swz(i0 + t4, m0 + g)], ah[0], al[0]);
                    tf32_split_fast(tK[swz(i0 + t4, m0 + g + 8)], ah[1], al[1]);
                    tf32_split_fast(tK[swz(i0 + t4 + 4, m0 + g)], ah[2], al[2]);
                    tf32_split_fast(tK[swz(i0 + t4 + 4, m0 + g + 8)], ah[3], al[3]);
                } else {
                    frag_a_split_t(tK + (i0 + t4) * SK + m0 + g, SK, ah, al);
                }
                float2 b0 = {}, b1 = {};
                if constexpr (INTER) {
                    b0 = *reinterpret_cast<const float2*>(sN + (i0 + t4) * SS + cc0 + 2 * g);
                    b1 = *reinterpret_cast<const float2*>(sN + (i0 + t4 + 4) * SS + cc0 + 2 * g);
                }
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    kda_u32 bh0, bl0, bh1, bl1;
                    if constexpr (INTER) {
                        tf32_split_fast(nt ? b0.y : b0.x, bh0, bl0);
                        tf32_split_fast(nt ? b1.y : b1.x, bh1, bl1);
                    } else {
                        tf32_split_fast(sN[(i0 + t4) * SS + cc0 + 8 * nt + g], bh0, bl0);
                        tf32_split_fast(sN[(i0 + t4 + 4) * SS + cc0 + 8 * nt + g], bh1, bl1);
                    }
                    mma_3xtf32_apart(acc[nt], s1[nt], s2[nt], ah, al, bh0, bh1, bl0, bl1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] += s1[nt][e] + s2[nt][e];
            // (the warp's own rows of sS: phase A's reads of them are behind the barrier above)
            if constexpr (INTER) {
                frag_rows_to<2, false>(sS + m0 * SS + cc0, SS, acc, g, t4);
            } else {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sS[side_at(m0, nt, e)] = acc[nt][e];
            }
        }
        __syncthreads(); // phase C is done with tK, tG (and sS is whole, for the next chunk)
        issue(2, ch + 1);
    }
    cp_async_wait<0>(); // the last chunk's empty groups (none in flight past the piece)
    __syncthreads();

    // The state of the piece's end: rounded into the slot, or carried in f32 to the next window.
    if (flags & KDA_PIECE_TO_SLOT) {
        const kda_u32 sr_base =
            p.sr ? kda_sr_base(((kda_u64)p.seed_hi << 32) | p.seed_lo, p.layer, slot, call_epoch(p)) : 0u;
        const kda_u32 elem0 = hv * (kda_u32)(K * V);
        for (int e = tid; e < K * NB; e += STATE_THREADS) {
            const int k = e / NB, cc = e - k * NB, v = v0 + cc;
            if (v >= V) continue;
            const kda_u32 off = state_off(k, v);
            const float x = sS[k * SS + cc];
            head[off] = p.sr ? round_elem<true>(x, sr_base, elem0 + off) : round_elem<false>(x, sr_base, elem0 + off);
        }
    } else {
        for (int e = tid; e < K * NB; e += STATE_THREADS) {
            const int k = e / NB, cc = e - k * NB, v = v0 + cc;
            if (v < V) carry[(size_t)k * V + v] = sS[k * SS + cc];
        }
    }
}

// The state pass in BV (32) value columns per CTA, and in BVN (16) for calls whose wider CTAs
// would not fill the multiprocessors (chunk_plan.rs's state_columns: a chain's chunk takes
// about as long as its CTA's work, not its latency, so half the columns run a chunk faster
// where each CTA has a multiprocessor to itself).
extern "C" __global__ void __launch_bounds__(kda::STATE_THREADS) kda_chunk_state(const KdaParams p,
                                                                                const KdaChunkParams c) {
    kda_chunk_state_cols<kda::BV>(p, c);
}
extern "C" __global__ void __launch_bounds__(kda::STATE_THREADS) kda_chunk_state_narrow(const KdaParams p,
                                                                                       const KdaChunkParams c) {
    kda_chunk_state_cols<kda::BVN>(p, c);
}

// One CTA per (chunk of the window, value head, OBV value columns): blockIdx.x = (chunk * HV +
// hv) * vblocks + vb; after kda_chunk_state, every chunk at once. The chunk's outputs of the
// CTA's columns: q exp(Gc) S + Aqk v_new, with S the state at the chunk's start and v_new as
// kda_chunk_state left them in the scratch; warp w the chunk rows 16 (w % 4) .. + 15 and the
// columns 32 (w / 4) .. + 31, four tiles sharing each A fragment. (With 32 columns per CTA,
// q exp(Gc) and Aqk were read four times per block, and each A fragment split for two tiles:
// sixtieth session.)
extern "C" __global__ void __launch_bounds__(kda::OUT_THREADS) kda_chunk_out(const KdaParams p,
                                                                            const KdaChunkParams c) {
    using namespace kda;
    extern __shared__ __align__(16) float csm[]; // chunk_plan.rs's out_smem
    float* sS = csm;         // [K][OSS] the state's columns v0 .. v0 + OBV at the chunk's start
    float* sN = csm + OUT_N; // [BT][OSS] v_new's columns
    float* tQ = csm + OUT_Q; // [BT][CK] q exp(Gc)
    float* tA = csm + OUT_A; // [BT][CA] Aqk
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    constexpr int VB = (V + OBV - 1) / OBV;
    const kda_u32 vb = blockIdx.x % VB, rest = blockIdx.x / VB;
    const kda_u32 ch = rest / p.hv, hv = rest - ch * p.hv;
    const kda_u32* ct = reinterpret_cast<const kda_u32*>(c.chunks) + 2 * (size_t)ch;
    const kda_u32 tok0 = ct[0];
    const int len = (int)ct[1];
    const int v0 = (int)vb * OBV, nv = V - v0 < OBV ? V - v0 : OBV;
    const size_t kb = chunk_block(p, ch, hv, (size_t)BT * K);
    copy_rows<BT, K, CK, OUT_THREADS>(tQ, reinterpret_cast<const float*>(c.qg) + kb, K);
    copy_rows<BT, BT, CA, OUT_THREADS>(tA, reinterpret_cast<const float*>(c.aqk) + chunk_block(p, ch, hv, (size_t)BT * BT), BT);
    copy_rows<K, OBV, OSS, OUT_THREADS>(sS, reinterpret_cast<const float*>(c.hs) + chunk_block(p, ch, hv, (size_t)K * V) + v0, V, nv);
    copy_rows<BT, OBV, OSS, OUT_THREADS>(sN, reinterpret_cast<const float*>(c.u) + chunk_block(p, ch, hv, (size_t)BT * V) + v0, V, nv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // (columns past V, where the CTA has fewer than OBV: whatever shared memory held; each
    // output column reads only its own column of S and v_new, and these are not stored)

    constexpr int RW = BT / 16, NT = 4;
    const int r0 = 16 * (warp % RW), cb = 8 * NT * (warp / RW);
    float o[NT][4] = {};
    warp_product<NT>(o, tQ + r0 * CK, CK, sS + cb, OSS, K, g, t4); // q exp(Gc) S
    // + Aqk v_new (Aqk is 0 right of the diagonal: the warp's k-steps end at its rows)
    warp_product<NT>(o, tA + r0 * CA, CA, sN + cb, OSS, r0 + 16, g, t4);
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        constexpr int W = 2 * NT, WS = 16 / sizeof(IT) < W ? 16 / sizeof(IT) : W; // columns; a store's
        const int i = r0 + g + 8 * h2, cc = cb + W * t4;
        if (i < len && cc < nv) { // nv % 8 == 0, cc % 8 == 0: all W columns or none
            float x[W];
            frag_row<NT>(o, h2, x);
            IT* dst = reinterpret_cast<IT*>(p.out) + ((tok0 + (size_t)i) * p.hv + hv) * V + v0 + cc;
#pragma unroll
            for (int c0 = 0; c0 < W; c0 += WS) {
                IT y[WS];
#pragma unroll
                for (int c = 0; c < WS; ++c) y[c] = KdaElem<IT>::from_f32(x[c0 + c]);
                kda_store_vec<IT, WS>(dst + c0, y);
            }
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
