// Element load/store and rounding shared by the KDA kernels.
//
// Mirrors crates/kda-kernels/src/rounding.rs BIT FOR BIT: mix32, sr_base, sr_bits, sr_bf16,
// sr_f16. Every float operation of the rounding helpers is an explicit round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn, __fsub_rn), so the compiler cannot contract them into FMAs,
// and scaling is done by multiplications with exact powers of two, never by divisions.
#pragma once
#include "kda_compat.cuh"

typedef unsigned int kda_u32;
typedef unsigned long long kda_u64;

// ---------------------------------------------------------------------------------------------
// Up-casts (exact) and round-to-nearest-even stores of one element.

__device__ __forceinline__ float kda_load(float x) { return x; }
__device__ __forceinline__ float kda_load(kda_half x) { return kda_half_to_float(x); }
__device__ __forceinline__ float kda_load(kda_bf16 x) { return kda_bf16_to_float(x); }

template <typename T> struct KdaElem;

template <> struct KdaElem<float> {
    static __device__ __forceinline__ float from_f32(float x) { return x; }
};
template <> struct KdaElem<kda_half> {
    static __device__ __forceinline__ kda_half from_f32(float x) { return kda_float_to_half(x); }
};
template <> struct KdaElem<kda_bf16> {
    static __device__ __forceinline__ kda_bf16 from_f32(float x) { return kda_float_to_bf16(x); }
};

// ---------------------------------------------------------------------------------------------
// The counter-based RNG of stochastic rounding (rounding.rs).

// lowbias32: a bijective 32-bit integer hash (Wellons).
__device__ __forceinline__ kda_u32 kda_mix32(kda_u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// The per-(seed, layer, slot, epoch) base of the stream.
__device__ __forceinline__ kda_u32 kda_sr_base(kda_u64 seed, kda_u32 layer, kda_u32 slot,
                                               kda_u32 epoch) {
    kda_u32 s = kda_mix32((kda_u32)seed ^ kda_mix32((kda_u32)(seed >> 32) ^ 0x9e3779b9u));
    return kda_mix32(kda_mix32(kda_mix32(s ^ layer) ^ slot) ^ epoch);
}

// The random bits of element `elem` (its offset in the slot's ssm plane).
__device__ __forceinline__ kda_u32 kda_sr_bits(kda_u32 base, kda_u32 elem) {
    return kda_mix32(base ^ (elem * 0x9e3779b9u));
}

// Stochastic rounding to bf16: add the low 16 random bits below the kept mantissa, truncate.
__device__ __forceinline__ kda_bf16 kda_sr_bf16(float x, kda_u32 r) {
    if (!isfinite(x)) return kda_float_to_bf16(x);
    kda_u32 bits = (__float_as_uint(x) + (r & 0xffffu)) & 0xffff0000u;
    return KDA_BF16_FROM_BITS(bits >> 16);
}

// Stochastic rounding to fp16 (subnormals included): up with probability equal to the
// discarded fraction of an ulp; values that round to nearest to infinity give infinity.
__device__ __forceinline__ kda_half kda_sr_f16(float x, kda_u32 r) {
    if (!isfinite(x)) return kda_float_to_half(x);
    float m = fabsf(x);
    if (m >= 65520.0f) return kda_float_to_half(x);
    // Exponent of m, clamped at fp16's smallest normal exponent; the fp16 ulp is 2^(e-10).
    int e = (m >= 6.103515625e-05f) ? (int)(__float_as_uint(m) >> 23) - 127 : -14;
    float ulp = __uint_as_float((kda_u32)(e - 10 + 127) << 23);
    float inv_ulp = __uint_as_float((kda_u32)(127 - (e - 10)) << 23);
    float lo = __fmul_rn(floorf(__fmul_rn(m, inv_ulp)), ulp);
    float frac = __fmul_rn(__fsub_rn(m, lo), inv_ulp);
    float u = __fmul_rn((float)(r >> 8), 5.9604644775390625e-08f);  // 2^-24
    float y = (u < frac) ? __fadd_rn(lo, ulp) : lo;
    return kda_float_to_half(copysignf(fminf(y, 65504.0f), x));
}

// Two f32 values rounded to nearest even into one 32-bit word of two 2-byte elements (`lo` at
// the lower address): one conversion instruction for both where the device has it, the same
// bits as two single conversions.
template <typename T> __device__ __forceinline__ kda_u32 kda_pack2_rn(float lo, float hi);
template <> __device__ __forceinline__ kda_u32 kda_pack2_rn<kda_half>(float lo, float hi) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    kda_u32 w;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
#else
    return (kda_u32)KDA_HALF_BITS(kda_float_to_half(lo)) | ((kda_u32)KDA_HALF_BITS(kda_float_to_half(hi)) << 16);
#endif
}
template <> __device__ __forceinline__ kda_u32 kda_pack2_rn<kda_bf16>(float lo, float hi) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    kda_u32 w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
#else
    return (kda_u32)KDA_BF16_BITS(kda_float_to_bf16(lo)) | ((kda_u32)KDA_BF16_BITS(kda_float_to_bf16(hi)) << 16);
#endif
}
template <> __device__ __forceinline__ kda_u32 kda_pack2_rn<float>(float, float) { return 0u; } // unused

// Stochastic store of one element of type T (exact for f32).
template <typename T> struct KdaSr;
template <> struct KdaSr<float> {
    static __device__ __forceinline__ float round(float x, kda_u32) { return x; }
};
template <> struct KdaSr<kda_half> {
    static __device__ __forceinline__ kda_half round(float x, kda_u32 r) { return kda_sr_f16(x, r); }
};
template <> struct KdaSr<kda_bf16> {
    static __device__ __forceinline__ kda_bf16 round(float x, kda_u32 r) { return kda_sr_bf16(x, r); }
};

// ---------------------------------------------------------------------------------------------
// Vector loads and stores of N consecutive elements (N * sizeof(T) in 4, 8 or 16 bytes, the
// pointer aligned to that size), up-cast to / rounded from f32.

template <int BYTES> struct KdaRaw;
template <> struct KdaRaw<2> { typedef unsigned short t; };
template <> struct KdaRaw<4> { typedef unsigned int t; };
template <> struct KdaRaw<8> { typedef uint2 t; };
template <> struct KdaRaw<16> { typedef uint4 t; };

template <typename T> __device__ __forceinline__ float kda_from_bits(unsigned short b);
template <> __device__ __forceinline__ float kda_from_bits<kda_half>(unsigned short b) {
    return kda_half_to_float(KDA_HALF_FROM_BITS(b));
}
template <> __device__ __forceinline__ float kda_from_bits<kda_bf16>(unsigned short b) {
    return __uint_as_float(((kda_u32)b) << 16);
}
// The low (hi = false) or high half of a word of two 2-byte values of type T, as f32 (exact).
template <typename T> __device__ __forceinline__ float kda_word_half(kda_u32 word, bool hi) {
    return kda_from_bits<T>((unsigned short)(hi ? word >> 16 : word & 0xffffu));
}
__device__ __forceinline__ unsigned short kda_bits(kda_half h) { return KDA_HALF_BITS(h); }
__device__ __forceinline__ unsigned short kda_bits(kda_bf16 h) { return KDA_BF16_BITS(h); }

// Unpacks `words` 32-bit words of raw data into f32 values.
template <typename T, int N>
__device__ __forceinline__ void kda_unpack(const kda_u32 (&w)[(N * sizeof(T) + 3) / 4], float (&out)[N]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = kda_word_half<T>(w[i / 2], i & 1);
    }
}

// Loads N elements at p (aligned to N * sizeof(T) bytes, a power of two <= 16) as f32.
template <typename T, int N>
__device__ __forceinline__ void kda_load_vec(const T* p, float (&out)[N]) {
    constexpr int BYTES = N * (int)sizeof(T);
    constexpr int WORDS = (BYTES + 3) / 4;
    kda_u32 w[WORDS];
    if constexpr (BYTES == 16) {
        uint4 x = *reinterpret_cast<const uint4*>(p);
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    } else if constexpr (BYTES == 8) {
        uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x; w[1] = x.y;
    } else if constexpr (BYTES == 4) {
        w[0] = *reinterpret_cast<const kda_u32*>(p);
    } else {
        static_assert(BYTES == 2, "vector of 2, 4, 8 or 16 bytes");
        w[0] = *reinterpret_cast<const unsigned short*>(p);
    }
    kda_unpack<T, N>(w, out);
}

// Packs N rounded elements into 32-bit words.
template <typename T, int N>
__device__ __forceinline__ void kda_pack(const T (&v)[N], kda_u32 (&w)[(N * sizeof(T) + 3) / 4]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < (N + 1) / 2; ++i) w[i] = 0;
#pragma unroll
        for (int i = 0; i < N; ++i) w[i / 2] |= ((kda_u32)kda_bits(v[i])) << ((i & 1) * 16);
    }
}

// Stores N elements (already rounded) at p (aligned like kda_load_vec).
template <typename T, int N>
__device__ __forceinline__ void kda_store_vec(T* p, const T (&v)[N]) {
    constexpr int BYTES = N * (int)sizeof(T);
    constexpr int WORDS = (BYTES + 3) / 4;
    kda_u32 w[WORDS];
    kda_pack<T, N>(v, w);
    if constexpr (BYTES == 16) {
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (BYTES == 8) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else if constexpr (BYTES == 4) {
        *reinterpret_cast<kda_u32*>(p) = w[0];
    } else {
        static_assert(BYTES == 2, "vector of 2, 4, 8 or 16 bytes");
        *reinterpret_cast<unsigned short*>(p) = (unsigned short)w[0];
    }
}

// ---------------------------------------------------------------------------------------------
// Warp reductions.

// One round of warp_sums_transposed: 2 HALF values still apart; the lane keeps the half its
// bit OFF names and adds the partner's copy of it. After the last round, butterfly sums over
// the lane bits below OFF.
template <int HALF, int OFF, int N>
__device__ __forceinline__ float warp_sums_transposed_round(float (&x)[N], int lane) {
    const bool up = (lane & OFF) != 0;
#pragma unroll
    for (int m = 0; m < HALF; ++m) {
        const float send = up ? x[m] : x[m + HALF], keep = up ? x[m + HALF] : x[m];
        x[m] = keep + KDA_SHFL_XOR(send, OFF);
    }
    if constexpr (HALF == 1) {
        float s = x[0];
#pragma unroll
        for (int o = OFF / 2; o >= 1; o /= 2) s += KDA_SHFL_XOR(s, o);
        return s;
    } else {
        return warp_sums_transposed_round<HALF / 2, OFF / 2>(x, lane);
    }
}

// Sums each of a lane's N values x (N a power of two, 2 to 32) over the warp, transposed: lane
// L gets the sum of value (L >> (5 - log2 N)) % N (N = 8: lanes 4 m .. 4 m + 3 value m; N = 32:
// lane L value L). N - 1 shuffles in the transposed rounds, 5 - log2 N after them: 8 values
// take 9 and 32 take 31, where N warp sums take 5 N. x is clobbered.
template <int N>
__device__ __forceinline__ float warp_sums_transposed(float (&x)[N], int lane) {
    static_assert(N >= 2 && N <= 32 && (N & (N - 1)) == 0, "warp_sums_transposed: N a power of two, 2 to 32");
    return warp_sums_transposed_round<N / 2, 16>(x, lane);
}

// ---------------------------------------------------------------------------------------------
// Products on the tensor cores in f32 accuracy (kda_ring_mma, kda_chunk_state).

// tf32 operands of mma.sync: the value rounded to tf32 (nearest, ties away from zero, in
// integer arithmetic: cheaper than cvt.rna.tf32, which sm_90 runs as several instructions) and
// what is left, rounded the same way; x - hi is exact in f32.
constexpr kda_u32 TF32_BITS = 0xffffe000u; // the bits of an f32 that mma.sync reads as tf32 (its top 19)
__device__ __forceinline__ kda_u32 tf32_of(float x) { return (__float_as_uint(x) + 0x1000u) & TF32_BITS; }
__device__ __forceinline__ void tf32_split(float x, kda_u32& hi, kda_u32& lo) {
    hi = tf32_of(x);
    lo = tf32_of(x - __uint_as_float(hi));
}
// The same in two instructions: mma.sync reads a tf32 operand's top 19 bits, so x itself is
// its truncation's hi part, and the rest x - trunc(x) (exact in f32) counts truncated too. The
// dropped terms (the rests' truncations and their product) come to at most about 3 x 2^-20 of
// |a b| per product term, where rounding hi (three instructions) gave about 2^-21: the chunked
// prefill's products (1-3% faster, errors against the f64 recurrence about 1.5x larger, still
// near 1e-6: sixty-first session).
__device__ __forceinline__ void tf32_split_fast(float x, kda_u32& hi, kda_u32& lo) {
    hi = __float_as_uint(x);
    lo = __float_as_uint(x - __uint_as_float(hi & TF32_BITS));
}

// c += a b for one m16n8k8 tile (row-major A fragment a, column-major B fragment b0, b1, f32
// accumulators c: PTX's mma.m16n8k8 fragment layouts).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const kda_u32 (&a)[4], kda_u32 b0, kda_u32 b1) {
#if !defined(__HIPCC__) && !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(KDA_EMU_MMA_TF32)
    KDA_EMU_MMA_TF32(c, a, b0, b1); // tools/offline/chunk_emu: the shuffles below, one exchange
#else
    // the same product from the same fragments through shuffles (devices without mma.sync),
    // the operands read as tf32 as mma.sync reads them (their low 13 bits ignored)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    constexpr kda_u32 M = TF32_BITS;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const float a_lo = __uint_as_float(KDA_SHFL(kk < 4 ? a[0] : a[2], 4 * g + (kk & 3)) & M);
        const float a_hi = __uint_as_float(KDA_SHFL(kk < 4 ? a[1] : a[3], 4 * g + (kk & 3)) & M);
        const float b_0 = __uint_as_float(KDA_SHFL(kk < 4 ? b0 : b1, 8 * t + (kk & 3)) & M);
        const float b_1 = __uint_as_float(KDA_SHFL(kk < 4 ? b0 : b1, 8 * t + 4 + (kk & 3)) & M);
        c[0] = fmaf(a_lo, b_0, c[0]);
        c[1] = fmaf(a_lo, b_1, c[1]);
        c[2] = fmaf(a_hi, b_0, c[2]);
        c[3] = fmaf(a_hi, b_1, c[3]);
    }
#endif
}

// The A fragment of one m16n8k8 tile, split into tf32 hi parts and rests (tf32_split_fast): the
// lane's elements (g, t4), (g + 8, t4), (g, t4 + 4), (g + 8, t4 + 4), from a tile stored
// transposed (element (row, column) at p0[column * ld + row]): p points at the lane's (g, t4),
// i.e. p0 + t4 ld + g. (Row-major tiles: kda_chunk.cu's frag_a_tile.)
__device__ __forceinline__ void frag_a_split_t(const float* p, int ld, kda_u32 (&h)[4], kda_u32 (&l)[4]) {
    tf32_split_fast(p[0], h[0], l[0]);
    tf32_split_fast(p[8], h[1], l[1]);
    tf32_split_fast(p[4 * ld], h[2], l[2]);
    tf32_split_fast(p[4 * ld + 8], h[3], l[3]);
}

// c += a b with both operands split (3xTF32) as mma_3xtf32 below, the two small products into
// accumulators of their own (s1, s2; the caller adds them to c after its last k-step): each
// chain of dependent mma.sync is one per k-step instead of three (the chunked prefill's
// products: sixtieth session).
__device__ __forceinline__ void mma_3xtf32_apart(float (&c)[4], float (&s1)[4], float (&s2)[4], const kda_u32 (&ah)[4],
                                                 const kda_u32 (&al)[4], kda_u32 bh0, kda_u32 bh1, kda_u32 bl0,
                                                 kda_u32 bl1) {
    mma_tf32(s1, al, bh0, bh1);
    mma_tf32(s2, ah, bl0, bl1);
    mma_tf32(c, ah, bh0, bh1);
}

// c += a b with both operands split (3xTF32), or with b exact in tf32 (bl unused: a 2-byte
// state element is).
template <bool B_EXACT>
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const kda_u32 (&ah)[4], const kda_u32 (&al)[4], kda_u32 bh0,
                                           kda_u32 bh1, kda_u32 bl0, kda_u32 bl1) {
    mma_tf32(c, al, bh0, bh1);
    if constexpr (!B_EXACT) mma_tf32(c, ah, bl0, bl1);
    mma_tf32(c, ah, bh0, bh1);
}

