// The few names that differ between CUDA and HIP, so one kernel source serves both.
//
// CUDA (NVRTC): the 2-byte element types are defined here as plain 16-bit wrappers with
// conversions through PTX `cvt` instructions, so a module needs no CUDA header at all (NVRTC
// has no built-in cuda_fp16.h). HIP: the types and conversions of hip_fp16.h / hip_bf16.h.
// Both sides provide: kda_half, kda_bf16, kda_half_to_float, kda_float_to_half (nearest even),
// kda_bf16_to_float, kda_float_to_bf16 (nearest even), the bit casts, and the warp shuffles.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bf16.h>
typedef __half kda_half;
typedef __hip_bfloat16 kda_bf16;
__device__ __forceinline__ float kda_half_to_float(kda_half h) { return __half2float(h); }
__device__ __forceinline__ kda_half kda_float_to_half(float f) { return __float2half(f); }
__device__ __forceinline__ float kda_bf16_to_float(kda_bf16 h) { return __bfloat162float(h); }
__device__ __forceinline__ kda_bf16 kda_float_to_bf16(float f) { return __float2bfloat16(f); }
#define KDA_HALF_FROM_BITS(b) __ushort_as_half((unsigned short)(b))
#define KDA_BF16_FROM_BITS(b) __ushort_as_bfloat16((unsigned short)(b))
#define KDA_HALF_BITS(h) __half_as_ushort(h)
#define KDA_BF16_BITS(h) __bfloat16_as_ushort(h)
// Warp-level code here works on groups of 32 lanes; `width` keeps wave64 shuffles inside one.
#define KDA_SHFL_XOR(x, m) __shfl_xor((x), (m), 32)
#define KDA_SHFL(x, src) __shfl((x), (src), 32)
#define KDA_SYNCWARP() __builtin_amdgcn_wave_barrier()
#define KDA_PREFETCH_L2(ptr) ((void)(ptr))
// A store that L2 may evict first (the state written back by the ring: not read again soon).
#define KDA_STORE_STREAM(ptr, val) (*(ptr) = (val))
#define KDA_GRID_DEPENDENCY 0
#define KDA_DEPENDENT_LAUNCH() ((void)0)
#else
struct __align__(2) kda_half {
    unsigned short bits;
};
struct __align__(2) kda_bf16 {
    unsigned short bits;
};
__device__ __forceinline__ float kda_half_to_float(kda_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ kda_half kda_float_to_half(float f) {
    kda_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
__device__ __forceinline__ float kda_bf16_to_float(kda_bf16 h) {
    return __uint_as_float(((unsigned int)h.bits) << 16);
}
__device__ __forceinline__ kda_bf16 kda_float_to_bf16(float f) {
    kda_bf16 h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x40u); // quiet NaN
    } else {
        h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
#endif
    return h;
}
#define KDA_HALF_FROM_BITS(b) (kda_half{(unsigned short)(b)})
#define KDA_BF16_FROM_BITS(b) (kda_bf16{(unsigned short)(b)})
#define KDA_HALF_BITS(h) ((h).bits)
#define KDA_BF16_BITS(h) ((h).bits)
#define KDA_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define KDA_SHFL(x, src) __shfl_sync(0xffffffffu, (x), (src))
#define KDA_SYNCWARP() __syncwarp()
// A hint: fetch the 128-byte line holding ptr into L2 (no register, no wait).
#define KDA_PREFETCH_L2(ptr) asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr))
// A store that L2 may evict first (st.global.cs).
#define KDA_STORE_STREAM(ptr, val) __stcs((ptr), (val))
// Programmatic dependent launch (sm_90): wait until the grid this one depends on has finished
// and its writes are visible, then let the next grid's CTAs be scheduled as this one's retire.
// Every kernel the backend launches with the PDL attribute runs it before any access that
// could see the other grid's writes (only L2 prefetches and host-written slots come before).
// KDA_GRID_DEPENDENCY: whether there is a wait, i.e. whether work before it can overlap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KDA_GRID_DEPENDENCY 1
#define KDA_DEPENDENT_LAUNCH() \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define KDA_GRID_DEPENDENCY 0
#define KDA_DEPENDENT_LAUNCH() ((void)0)
#endif
#endif
