#!/usr/bin/env bash
#   tools/offline/hip_check.sh [ARCH] [usage]      (default gfx90a)
# Compiles the kernel sources with hipcc for an AMD GPU (device code, -O3), in the variants of
# kernel_sass.sh plus fp16 inputs and one module of padded batches (KDA_PADDED), to keep "one
# source for CUDA and HIP" (kernels/kda_compat.cuh) true: says per variant whether it
# compiles, with the first errors. A compile check only: no HIP backend loads or runs these
# modules yet, and nothing here checks what they compute (AMD's 64-lane waves included). Needs hipcc (Debian 12: `apt-get install hipcc`, ROCm 5.2; no GPU
# needed). Where the ROCm has no hip/hip_bf16.h (5.2 has none) a stand-in with the four names
# kda_compat.cuh uses is put on the include path (bit casts, and conversions that round to
# nearest even) and the output says so. With `usage`, each kernel's VGPRs, scratch (spilled)
# bytes per lane and waves per SIMD as the compiler reports them (a kernel whose body is
# compiled for CUDA only, such as the bulk pipe's, shows as empty).
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${1:-gfx90a}
usage=()
[ "${2:-}" = usage ] && usage=(-Rpass-analysis=kernel-resource-usage)
command -v hipcc >/dev/null || { echo "no hipcc (apt-get install hipcc)" >&2; exit 2; }
export HIP_PLATFORM=amd
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
inc=()
echo '#include <hip/hip_bf16.h>' >"$tmp/probe.hip"
if ! hipcc -E -x hip "$tmp/probe.hip" -o /dev/null 2>/dev/null; then
    mkdir -p "$tmp/inc/hip"
    cat >"$tmp/inc/hip/hip_bf16.h" <<'H'
#pragma once
struct __hip_bfloat16 { unsigned short data; };
__device__ inline float __bfloat162float(__hip_bfloat16 h) { return __uint_as_float(((unsigned)h.data) << 16); }
__device__ inline __hip_bfloat16 __float2bfloat16(float f) {
    unsigned u = __float_as_uint(f);
    __hip_bfloat16 h;
    h.data = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                              : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return h;
}
__device__ inline __hip_bfloat16 __ushort_as_bfloat16(unsigned short b) { __hip_bfloat16 h; h.data = b; return h; }
__device__ inline unsigned short __bfloat16_as_ushort(__hip_bfloat16 h) { return h.data; }
H
    inc=(-I"$tmp/inc")
    echo "note: this ROCm has no hip/hip_bf16.h; compiling with a stand-in for its four names"
fi
fails=0
for v in "float float 0" "kda_half kda_bf16 0" "kda_bf16 kda_bf16 0" "float float 1" "kda_half kda_bf16 1" \
    "kda_half kda_half 0" "kda_half kda_bf16 0 1"; do
    read -r st it vf padded <<<"$v"
    padded=${padded:-0}
    tu="$tmp/$st-$it-$vf-$padded.hip"
    tools/offline/kernel_tu.sh kernels "$st" "$it" "$vf" "$padded" >"$tu"
    tag="$st state, $it inputs, $([ "$vf" = 1 ] && echo V-first || echo K-first)$([ "$padded" = 1 ] && echo ", padded batches" || true)"
    if hipcc "${inc[@]}" --offload-arch="$arch" --offload-device-only -c -O3 -std=c++17 \
        -Wno-pragma-once-outside-header "${usage[@]}" -o "${tu%.hip}.o" "$tu" >"${tu%.hip}.log" 2>&1; then
        echo "$tag: compiles for $arch"
        [ ${#usage[@]} -eq 0 ] || awk '
            /remark: +Function Name:/ { split($0, a, "Function Name: "); split(a[2], b, " "); name = b[1] }
            /remark: +VGPRs:/ { split($0, a, "VGPRs: "); split(a[2], b, " "); vg = b[1] }
            /ScratchSize/ { split($0, a, "lane\\]: "); split(a[2], b, " "); sc = b[1] }
            /Occupancy/ { split($0, a, "SIMD\\]: "); split(a[2], b, " ");
                          printf "    %-24s %4s VGPRs %6s scratch bytes/lane %2s waves/SIMD\n", name, vg, sc, b[1] }
        ' "${tu%.hip}.log"
    else
        echo "$tag: FAILS for $arch"
        grep -m 5 'error:' "${tu%.hip}.log" || tail -5 "${tu%.hip}.log"
        fails=$((fails + 1))
    fi
done
[ "$fails" -eq 0 ]
