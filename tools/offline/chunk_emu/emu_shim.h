// A host stand-in for the CUDA names the chunked prefill's kernels (kernels/kda_chunk.cu) and
// the helpers they use (kernels/kda_common.cuh, the helper part of kernels/kda_decode.cu)
// need, so that g++ compiles the kernel source unchanged and runs it on the CPU: one
// std::thread per CUDA thread of a block, __syncthreads as a barrier of the block, the warp
// shuffles through a per-warp exchange and barrier, shared memory as statics (one block runs at
// a time). It replaces kernels/kda_compat.cuh. A check of what the code computes, not of its
// speed, its memory model or its races beyond the barriers it has.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define __maxnreg__(n)

struct dim3e {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;

struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// (the program is compiled with -ffp-contract=off: these are single roundings)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

// 2-byte element types with round-to-nearest-even conversions (as kda_compat.cuh's).
struct kda_half {
    unsigned short bits;
};
struct kda_bf16 {
    unsigned short bits;
};
inline float kda_half_to_float(kda_half h) {
    _Float16 x;
    std::memcpy(&x, &h.bits, 2);
    return (float)x;
}
inline kda_half kda_float_to_half(float f) {
    _Float16 x = (_Float16)f;
    kda_half h;
    std::memcpy(&h.bits, &x, 2);
    return h;
}
inline float kda_bf16_to_float(kda_bf16 h) { return __uint_as_float(((unsigned)h.bits) << 16); }
inline kda_bf16 kda_float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    kda_bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return h;
}
#define KDA_HALF_FROM_BITS(b) (kda_half{(unsigned short)(b)})
#define KDA_BF16_FROM_BITS(b) (kda_bf16{(unsigned short)(b)})
#define KDA_HALF_BITS(h) ((h).bits)
#define KDA_BF16_BITS(h) ((h).bits)

// One block's synchronisation: the block barrier and each warp's exchange.
struct EmuBlock {
    explicit EmuBlock(unsigned threads) : bar((std::ptrdiff_t)threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<Warp>());
    }
    std::barrier<> bar;
    struct Warp {
        std::barrier<> bar{32};
        uint64_t slot[32];
        uint32_t frag[32][6];
    };
    std::vector<std::unique_ptr<Warp>> warps;
};
inline thread_local EmuBlock* emu_block = nullptr;

inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
inline void __syncwarp() { emu_block->warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline void __threadfence() {}

template <typename T> T emu_shfl(T x, int src_lane) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    auto& w = *emu_block->warps[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    uint64_t b = 0;
    std::memcpy(&b, &x, sizeof(T));
    w.slot[lane] = b;
    w.bar.arrive_and_wait();
    T y;
    std::memcpy(&y, &w.slot[src_lane & 31], sizeof(T));
    w.bar.arrive_and_wait();
    return y;
}
inline int emu_lane() { return (int)(threadIdx.x % 32); }

// kda_common.cuh's mma_tf32 fallback in one exchange of the warp's fragments instead of 32
// shuffles: the same reads of the same lanes, the same fmaf order, so the same bits.
template <typename U>
void emu_mma_tf32(float (&c)[4], const U (&a)[4], U b0, U b1) {
    auto& w = *emu_block->warps[threadIdx.x / 32];
    const int lane = emu_lane(), g = lane >> 2, t = lane & 3;
    uint32_t* mine = w.frag[lane];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    w.bar.arrive_and_wait();
    auto f = [&](int src, int i) { // read as tf32, as mma.sync reads it: the low 13 bits ignored
        const uint32_t bits = w.frag[src][i] & 0xffffe000u;
        float x;
        std::memcpy(&x, &bits, 4);
        return x;
    };
    for (int kk = 0; kk < 8; ++kk) {
        const float a_lo = f(4 * g + (kk & 3), kk < 4 ? 0 : 2), a_hi = f(4 * g + (kk & 3), kk < 4 ? 1 : 3);
        const float b_0 = f(8 * t + (kk & 3), kk < 4 ? 4 : 5), b_1 = f(8 * t + 4 + (kk & 3), kk < 4 ? 4 : 5);
        c[0] = fmaf(a_lo, b_0, c[0]);
        c[1] = fmaf(a_lo, b_1, c[1]);
        c[2] = fmaf(a_hi, b_0, c[2]);
        c[3] = fmaf(a_hi, b_1, c[3]);
    }
    w.bar.arrive_and_wait();
}
#define KDA_EMU_MMA_TF32(c, a, b0, b1) emu_mma_tf32((c), (a), (b0), (b1))
#define KDA_SHFL_XOR(val, mask) emu_shfl((val), emu_lane() ^ (int)(mask))
#define KDA_SHFL(val, src) emu_shfl((val), (int)(src))
#define KDA_SYNCWARP() __syncwarp()
#define KDA_PREFETCH_L2(ptr) ((void)(ptr))
#define KDA_STORE_STREAM(ptr, val) (*(ptr) = (val))
#define KDA_GRID_DEPENDENCY 0
#define KDA_DEPENDENT_LAUNCH() ((void)0)

inline std::mutex emu_atomics;
inline unsigned atomicOr(unsigned* p, unsigned v) {
    std::lock_guard<std::mutex> g(emu_atomics);
    unsigned o = *p;
    *p = o | v;
    return o;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    std::lock_guard<std::mutex> g(emu_atomics);
    unsigned o = *p;
    *p = o + v;
    return o;
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    std::lock_guard<std::mutex> g(emu_atomics);
    unsigned o = *p;
    if (o == cmp) *p = v;
    return o;
}

// cp.async (kda_decode.cu's cp_async16 / cp_async_commit / cp_async_wait, which this part of
// the source does not include): each thread's copies are held back in their committed groups
// and made only when a wait lets them land, so a read of shared memory before its wait sees
// the poison of `emu_launch`'s `before`, not the data (the source must not change in between:
// the kernels copy only what an earlier launch wrote).
struct EmuCopy {
    void* dst;
    const void* src;
};
inline thread_local std::vector<EmuCopy> emu_open;                 // issued, not yet committed
inline thread_local std::vector<std::vector<EmuCopy>> emu_groups; // committed, oldest first
inline void cp_async16(void* dst, const void* src) { emu_open.push_back({dst, src}); }
inline void cp_async_commit() {
    emu_groups.push_back(std::move(emu_open));
    emu_open.clear();
}
template <int N> inline void cp_async_wait() {
    while (emu_groups.size() > (size_t)N) {
        for (const EmuCopy& c : emu_groups.front()) std::memcpy(c.dst, c.src, 16);
        emu_groups.erase(emu_groups.begin());
    }
}

// The dynamic shared memory of every kernel (`extern __shared__ __align__(16) float csm[]`:
// chunk_emu.sh drops the `__shared__ __align__(16)` of extern declarations).
alignas(16) inline float csm[1 << 16];

// Runs `kernel` on a grid of `grid` blocks of `threads` threads, one block after the other,
// `before` ahead of each (poisoning the shared memory).
inline void emu_launch(unsigned grid, unsigned threads, const std::function<void()>& kernel,
                       const std::function<void()>& before) {
    for (unsigned b = 0; b < grid; ++b) {
        before();
        EmuBlock blk(threads);
        std::vector<std::thread> ts;
        ts.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
            ts.emplace_back([&, t, b] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                blockDim = {threads, 1, 1};
                gridDim = {grid, 1, 1};
                emu_block = &blk;
                kernel();
                if (!emu_open.empty() || !emu_groups.empty()) {
                    std::fprintf(stderr, "block %u thread %u ended with cp.async copies not waited for\n", b, t);
                    std::abort();
                }
            });
        }
        for (auto& t : ts) t.join();
    }
}
