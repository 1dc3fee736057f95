// Fills a device buffer with reproducible pseudo-random values (uniform in [-scale, scale)),
// for benchmarks that must not run on zeros. dtype: 0 f32, 1 f16, 2 bf16.
#include "kda_common.cuh"

struct KdaFill {
    kda_u64 ptr, len;
    kda_u32 dtype, seed;
    float scale;
    kda_u32 pad;
};

extern "C" __global__ void kda_fill(const KdaFill f) {
    for (kda_u64 i = (kda_u64)blockIdx.x * blockDim.x + threadIdx.x; i < f.len;
         i += (kda_u64)gridDim.x * blockDim.x) {
        const kda_u32 r = kda_mix32((kda_u32)i ^ kda_mix32((kda_u32)(i >> 32) ^ f.seed));
        const float x = ((float)(r >> 8) * 5.9604644775390625e-08f * 2.0f - 1.0f) * f.scale;
        if (f.dtype == 0u) {
            reinterpret_cast<float*>(f.ptr)[i] = x;
        } else if (f.dtype == 1u) {
            reinterpret_cast<kda_half*>(f.ptr)[i] = kda_float_to_half(x);
        } else {
            reinterpret_cast<kda_bf16*>(f.ptr)[i] = kda_float_to_bf16(x);
        }
    }
}

// The copy ceiling: a 16-byte vectorised device-to-device copy on the SMs (what a
// bandwidth-bound kernel can reach), `n16` 16-byte words. Two forms, picked by the launch shape
// (uniform per launch, so no divergence):
// - a grid of at least `n16` threads: one word per thread, no loop. Measured the fastest on the
//   H200 (256 threads a block: 4.31 TB/s read + write over 1 GiB, against 3.94 for a grid-stride
//   loop over 16 blocks per SM and 4.10-4.15 for 4 words per thread): many short blocks keep
//   the memory system fuller than fewer threads with more words each;
// - a smaller grid: tiles of KDA_COPY_UNROLL x blockDim.x words, a block copying whole tiles
//   (grid-stride over tiles), each thread loading its KDA_COPY_UNROLL words (blockDim.x apart,
//   one coalesced 512-byte access per warp each) before storing any; the last, partial tile is
//   copied one word per thread by the whole grid.
// Correct for any grid and block size.
#define KDA_COPY_UNROLL 4

extern "C" __global__ void kda_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, kda_u64 n16) {
    const kda_u64 threads = (kda_u64)gridDim.x * blockDim.x;
    const kda_u64 id = (kda_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (threads >= n16) {
        if (id < n16) {
            dst[id] = src[id];
        }
        return;
    }
    const kda_u64 tile = (kda_u64)blockDim.x * KDA_COPY_UNROLL;
    const kda_u64 full = n16 / tile;
    for (kda_u64 b = blockIdx.x; b < full; b += gridDim.x) {
        const kda_u64 base = b * tile + threadIdx.x;
        uint4 w[KDA_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < KDA_COPY_UNROLL; ++u) {
            w[u] = src[base + (kda_u64)u * blockDim.x];
        }
#pragma unroll
        for (int u = 0; u < KDA_COPY_UNROLL; ++u) {
            dst[base + (kda_u64)u * blockDim.x] = w[u];
        }
    }
    for (kda_u64 i = full * tile + id; i < n16; i += threads) {
        dst[i] = src[i];
    }
}
