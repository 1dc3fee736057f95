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

// The copy ceiling: a grid-stride 16-byte vectorised device-to-device copy on the SMs (what a
// bandwidth-bound kernel can reach), `n16` 16-byte words.
extern "C" __global__ void kda_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, kda_u64 n16) {
    for (kda_u64 i = (kda_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16;
         i += (kda_u64)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
