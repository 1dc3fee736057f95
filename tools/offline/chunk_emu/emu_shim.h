// A host stand-in for the CUDA names the chunked prefill's kernels (kernels/kda_chunk.cu) and
// the helpers they use (kernels/kda_common.cuh, the helper part of kernels/kda_decode.cu)
// need, so that g++ compiles the kernel source unchanged and runs it on the CPU: one fiber
// (its own stack, all on the one OS thread) per CUDA thread of a block, switched
// only at barriers: __syncthreads as a barrier of the block, the warp shuffles through a
// per-warp exchange and barrier; shared memory as statics (one block runs at a time). A barrier
// that can never complete (some threads left or wait elsewhere) aborts with a message. It
// replaces kernels/kda_compat.cuh. A check of what the code computes, not of its speed, its
// memory model or its races beyond the barriers it has (the fibers run in a fixed order:
// ascending in even blocks, descending in odd ones).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
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
inline dim3e threadIdx, blockIdx, blockDim, gridDim; // emu_launch sets threadIdx before each switch into a fiber

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

// A fiber's saved context and the switch between two. On x86-64 a switch saves the registers the
// calling convention keeps across calls on the fiber's own stack and swaps stack pointers (the
// kernels leave the floating-point control words alone); glibc's swapcontext, the fallback
// elsewhere, also saves the signal mask and the FPU environment, which made it ~90% of the
// emulator's time.
#if defined(__x86_64__)
struct EmuContext {
    void* sp = nullptr;
};
extern "C" void emu_switch(EmuContext* save, EmuContext* load);
asm(R"(
    .pushsection .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq (%rsi), %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .popsection
)");
// A context whose first switch-in enters `entry` (which must never return) on `stack`.
inline void emu_context_init(EmuContext& c, char* stack, size_t size, void (*entry)()) {
    auto top = reinterpret_cast<uintptr_t>(stack + size) & ~(uintptr_t)15;
    auto* sp = reinterpret_cast<uintptr_t*>(top);
    *--sp = 0;                                  // `entry`'s return address: none
    *--sp = reinterpret_cast<uintptr_t>(entry); // where emu_switch's `ret` goes
    for (int r = 0; r < 6; ++r) *--sp = 0;      // rbp, rbx, r12-r15
    c.sp = sp;
}
#else
#include <ucontext.h>
struct EmuContext {
    ucontext_t uc;
};
inline void emu_switch(EmuContext* save, EmuContext* load) { swapcontext(&save->uc, &load->uc); }
inline void emu_context_init(EmuContext& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// A barrier of `expected` fibers: the last to arrive completes the phase and goes on; the
// others switch back to the scheduler until it has.
struct EmuBarrier {
    unsigned expected, count = 0;
    uint64_t phase = 0;
    explicit EmuBarrier(unsigned n) : expected(n) {}
};
// One thread's cp.async copies (below): issued and not yet committed, and committed groups,
// oldest first.
struct EmuCopy {
    void* dst;
    const void* src;
};
struct EmuCopies {
    std::vector<EmuCopy> open;
    std::vector<std::vector<EmuCopy>> groups;
};
// One block's synchronisation: the block barrier, each warp's exchange and its threads' copies.
struct EmuBlock {
    explicit EmuBlock(unsigned threads) : bar(threads), copies(threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<Warp>());
    }
    EmuBarrier bar;
    struct Warp {
        EmuBarrier bar{32};
        uint64_t slot[32];
        uint32_t frag[32][6];
    };
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<EmuCopies> copies;
    EmuContext scheduler;               // where a waiting or ended fiber switches to
    std::vector<EmuContext> fibers;     // one per thread
    std::vector<unsigned char> ended;   // per thread: its kernel has returned
    uint64_t progress = 0;              // arrivals and ends, to tell a deadlock
};
inline EmuBlock* emu_block = nullptr;

inline void emu_wait(EmuBarrier& b) {
    EmuBlock& blk = *emu_block;
    ++blk.progress;
    const uint64_t phase = b.phase;
    if (++b.count == b.expected) {
        b.count = 0;
        ++b.phase;
        return;
    }
    while (b.phase == phase) emu_switch(&blk.fibers[threadIdx.x], &blk.scheduler);
}

inline void __syncthreads() { emu_wait(emu_block->bar); }
inline void __syncwarp() { emu_wait(emu_block->warps[threadIdx.x / 32]->bar); }
inline void __threadfence() {}

template <typename T> T emu_shfl(T x, int src_lane) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    auto& w = *emu_block->warps[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    uint64_t b = 0;
    std::memcpy(&b, &x, sizeof(T));
    w.slot[lane] = b;
    emu_wait(w.bar);
    T y;
    std::memcpy(&y, &w.slot[src_lane & 31], sizeof(T));
    emu_wait(w.bar);
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
    emu_wait(w.bar);
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
    emu_wait(w.bar);
}
#define KDA_EMU_MMA_TF32(c, a, b0, b1) emu_mma_tf32((c), (a), (b0), (b1))
#define KDA_SHFL_XOR(val, mask) emu_shfl((val), emu_lane() ^ (int)(mask))
#define KDA_SHFL(val, src) emu_shfl((val), (int)(src))
#define KDA_SYNCWARP() __syncwarp()
#define KDA_PREFETCH_L2(ptr) ((void)(ptr))
#define KDA_STORE_STREAM(ptr, val) (*(ptr) = (val))
#define KDA_GRID_DEPENDENCY 0
#define KDA_DEPENDENT_LAUNCH() ((void)0)

// (atomic as they stand: fibers switch only at barriers)
inline unsigned atomicOr(unsigned* p, unsigned v) {
    unsigned o = *p;
    *p = o | v;
    return o;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned o = *p;
    *p = o + v;
    return o;
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    unsigned o = *p;
    if (o == cmp) *p = v;
    return o;
}

// cp.async (kda_decode.cu's cp_async16 / cp_async_commit / cp_async_wait, which this part of
// the source does not include): each thread's copies are held back in their committed groups
// and made only when a wait lets them land, so a read of shared memory before its wait sees
// the poison of `emu_launch`'s `before`, not the data (the source must not change in between:
// the kernels copy only what an earlier launch wrote).
inline void cp_async16(void* dst, const void* src) { emu_block->copies[threadIdx.x].open.push_back({dst, src}); }
inline void cp_async_commit() {
    EmuCopies& c = emu_block->copies[threadIdx.x];
    c.groups.push_back(std::move(c.open));
    c.open.clear();
}
template <int N> inline void cp_async_wait() {
    auto& groups = emu_block->copies[threadIdx.x].groups;
    while (groups.size() > (size_t)N) {
        for (const EmuCopy& c : groups.front()) std::memcpy(c.dst, c.src, 16);
        groups.erase(groups.begin());
    }
}

// The dynamic shared memory of every kernel (`extern __shared__ __align__(16) float csm[]`:
// chunk_emu.sh drops the `__shared__ __align__(16)` of extern declarations).
alignas(16) inline float csm[1 << 16];

// The fibers' stacks, kept from one block to the next.
inline std::vector<std::unique_ptr<char[]>> emu_stacks;
constexpr size_t EMU_STACK = 1 << 20;
inline const std::function<void()>* emu_kernel = nullptr;

// A fiber's body: the kernel as thread `threadIdx.x`, then back to the scheduler for good.
inline void emu_fiber() {
    (*emu_kernel)();
    const EmuCopies& c = emu_block->copies[threadIdx.x];
    if (!c.open.empty() || !c.groups.empty()) {
        std::fprintf(stderr, "block %u thread %u ended with cp.async copies not waited for\n", blockIdx.x,
                     threadIdx.x);
        std::abort();
    }
    ++emu_block->progress;
    emu_block->ended[threadIdx.x] = true;
    emu_switch(&emu_block->fibers[threadIdx.x], &emu_block->scheduler);
}

// Runs `kernel` on a grid of `grid` blocks of `threads` threads, one block after the other,
// `before` ahead of each (poisoning the shared memory). A block's threads run as fibers in turn,
// each until it waits at a barrier or ends.
inline void emu_launch(unsigned grid, unsigned threads, const std::function<void()>& kernel,
                       const std::function<void()>& before) {
    while (emu_stacks.size() < threads) emu_stacks.emplace_back(new char[EMU_STACK]);
    emu_kernel = &kernel;
    blockDim = {threads, 1, 1};
    gridDim = {grid, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        before();
        EmuBlock blk(threads);
        emu_block = &blk;
        blockIdx = {b, 0, 0};
        blk.fibers.resize(threads);
        blk.ended.assign(threads, 0);
        for (unsigned t = 0; t < threads; ++t)
            emu_context_init(blk.fibers[t], emu_stacks[t].get(), EMU_STACK, emu_fiber);
        // A fiber back in the scheduler waits at a barrier (resumed on the next pass) or has
        // ended. A pass with no arrival and no end means no barrier can complete. Odd blocks
        // run their threads in the reverse order, so that a read of another thread's write
        // with no barrier between them sees it in some blocks and not in others.
        for (unsigned left = threads; left > 0;) {
            const uint64_t progress = blk.progress;
            for (unsigned i = 0; i < threads; ++i) {
                const unsigned t = b & 1 ? threads - 1 - i : i;
                if (blk.ended[t]) continue;
                threadIdx = {t, 0, 0};
                emu_switch(&blk.scheduler, &blk.fibers[t]);
                left -= blk.ended[t];
            }
            if (left > 0 && blk.progress == progress) {
                std::fprintf(stderr, "block %u: %u threads wait at barriers that cannot complete\n", b, left);
                std::abort();
            }
        }
    }
}
