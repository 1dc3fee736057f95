// PROBE (not for landing): moves 2-byte 128 x 128 state heads in place, no arithmetic, in
// several ways, to compare with a same-size copy. See crates/kda-kernels/src/cuda/probe.rs.
typedef unsigned int u32;
typedef unsigned long long u64;
struct __align__(64) TMap {
    u64 v[16];
};
struct MoveP {
    u64 base, slots;
    u32 hv, mode, ops, pad;
};
__device__ __forceinline__ u32 saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

template <int MODE> __device__ __forceinline__ void probe_move(const MoveP& p, const TMap& tm) {
    extern __shared__ __align__(128) unsigned char dsm[];
    __shared__ u64 bar;
    unsigned char* buf = dsm + ((128u - (saddr(dsm) & 127u)) & 127u);
    const u32 item = blockIdx.x;
    const bool half = MODE == 2 || MODE == 4 || MODE == 5;
    const u32 hi = half ? item >> 1 : item;
    const u32 seq = hi / p.hv, h = hi - seq * p.hv;
    const u32 slot = reinterpret_cast<const u32*>(p.slots)[seq];
    const u64 row0 = ((u64)slot * p.hv + h) * 128u;
    unsigned char* head = reinterpret_cast<unsigned char*>(p.base) + row0 * 256u;
    if (MODE == 3) { // registers: blockDim.x threads, whole head
        const u32 n = 2048u / blockDim.x;
        uint4 w[16];
        uint4* g = reinterpret_cast<uint4*>(head);
#pragma unroll
        for (u32 u = 0; u < 16; ++u)
            if (u < n) w[u] = g[threadIdx.x + u * blockDim.x];
#pragma unroll
        for (u32 u = 0; u < 16; ++u)
            if (u < n) g[threadIdx.x + u * blockDim.x] = w[u];
        return;
    }
    if (MODE == 5) { // registers: half head as K-first columns (128 rows x 128 B)
        const u32 n = 1024u / blockDim.x;
        uint4 w[16];
        unsigned char* c0 = head + (item & 1u) * 128u;
#pragma unroll
        for (u32 u = 0; u < 16; ++u)
            if (u < n) {
                const u32 i = threadIdx.x + u * blockDim.x; // 8 words per row
                w[u] = *reinterpret_cast<uint4*>(c0 + (i >> 3) * 256u + (i & 7u) * 16u);
            }
#pragma unroll
        for (u32 u = 0; u < 16; ++u)
            if (u < n) {
                const u32 i = threadIdx.x + u * blockDim.x;
                *reinterpret_cast<uint4*>(c0 + (i >> 3) * 256u + (i & 7u) * 16u) = w[u];
            }
        return;
    }
    if (threadIdx.x != 0) return;
    const u32 bytes = half ? 16384u : 32768u;
    const u64 tmp = reinterpret_cast<u64>(&tm);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n" ::"r"(saddr(&bar))
                 : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(saddr(&bar)), "r"(bytes) : "memory");
    if (MODE == 0 || MODE == 4) {
        unsigned char* src = head + (MODE == 4 ? (item & 1u) * 16384u : 0u);
        const u32 chunk = bytes / p.ops;
        for (u32 o = 0; o < p.ops; ++o)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                             saddr(buf + o * chunk)),
                         "l"(src + o * chunk), "r"(chunk), "r"(saddr(&bar))
                         : "memory");
    } else {
        const int c0 = MODE == 2 ? (int)(item & 1u) * 64 : 0, c1 = (int)row0;
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                         saddr(buf)),
                     "l"(tmp), "r"(c0), "r"(c1), "r"(saddr(&bar))
                     : "memory");
    }
    u32 done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0;\n"
                     " selp.u32 %0, 1, 0, q;\n}\n"
                     : "=r"(done)
                     : "r"(saddr(&bar))
                     : "memory");
    }
    if (MODE == 0 || MODE == 4) {
        unsigned char* dst = head + (MODE == 4 ? (item & 1u) * 16384u : 0u);
        const u32 chunk = bytes / p.ops;
        for (u32 o = 0; o < p.ops; ++o)
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst + o * chunk),
                         "r"(saddr(buf + o * chunk)), "r"(chunk)
                         : "memory");
    } else {
        const int c0 = MODE == 2 ? (int)(item & 1u) * 64 : 0, c1 = (int)row0;
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(tmp), "r"(c0),
                     "r"(c1), "r"(saddr(buf))
                     : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n"
                 "cp.async.bulk.wait_group.read 0;\n" ::
                     : "memory");
}

extern "C" __global__ void kda_probe_move0(const MoveP p, const __grid_constant__ TMap tm) { probe_move<0>(p, tm); }
extern "C" __global__ void kda_probe_move1(const MoveP p, const __grid_constant__ TMap tm) { probe_move<1>(p, tm); }
extern "C" __global__ void kda_probe_move2(const MoveP p, const __grid_constant__ TMap tm) { probe_move<2>(p, tm); }
extern "C" __global__ void kda_probe_move3(const MoveP p, const __grid_constant__ TMap tm) { probe_move<3>(p, tm); }
extern "C" __global__ void kda_probe_move4(const MoveP p, const __grid_constant__ TMap tm) { probe_move<4>(p, tm); }
extern "C" __global__ void kda_probe_move5(const MoveP p, const __grid_constant__ TMap tm) { probe_move<5>(p, tm); }
