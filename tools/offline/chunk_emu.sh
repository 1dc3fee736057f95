#!/usr/bin/env bash
#   tools/offline/chunk_emu.sh
# Runs the GPU's prefill kernels on the CPU: the chunked ones (kernels/kda_chunk.cu) and the
# token loop (kda_step, with the helpers before it: the part of kernels/kda_decode.cu up to its
# second kernel, and its bulk copies' stand-ins), with kernels/kda_common.cuh. g++ compiles the
# unchanged kernel source against tools/offline/chunk_emu/emu_shim.h (a host stand-in for the
# CUDA names: one thread per CUDA thread, barriers, warp shuffles) and
# tools/offline/chunk_emu/emu_main.cpp checks both prefills against a float64 token recurrence,
# on eager pools and on pools with a ring (pending entries folded first, a draft dropped), and
# windows of one chunk and the 16-column state pass against one window in 32 columns (the same
# bits; see there). Variants: every state dtype and layout, fp32 / bf16 / fp16 inputs, K x V of
# 32 x 48, 32 x 40 (a last block of half its columns), 48 x 48 (w and k exp(Gc_last - Gc) in
# padded rows; elsewhere swizzled, K % 32 == 0) and 128 x 128 (each input dtype, both layouts),
# stochastic rounding. About 5 minutes on one core.
# Needs g++ 12 (C++20, _Float16); no GPU. A check of what the kernels compute before they run
# on a device, not of their speed or of races the barriers do not order.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
variants=(
    "float float 0 32 48 0" "float float 1 32 48 0" "kda_half float 0 32 48 0" "kda_bf16 kda_bf16 1 32 48 0"
    "float float 0 32 40 0" "float float 0 48 48 0"
    "kda_half kda_bf16 0 32 48 1" "kda_bf16 float 0 32 48 1" "float kda_half 0 32 48 0"
    "float kda_bf16 0 128 128 0" "kda_bf16 kda_bf16 0 128 128 0" "kda_half kda_bf16 1 128 128 0"
    "float float 1 128 128 0" "kda_half kda_half 0 128 128 1"
)
# EMU_ONLY="ST IT VFIRST K V SR": that variant alone
[ -n "${EMU_ONLY:-}" ] && variants=("$EMU_ONLY")
fails=0
for v in "${variants[@]}"; do
    read -r st it vf k vd sr <<<"$v"
    tu="$tmp/$st-$it-$vf-$k-$vd-$sr.cpp"
    {
        echo '#include "emu_shim.h"'
        grep -v '#include "kda_' kernels/kda_common.cuh
        printf '#define KDA_ST %s\n#define KDA_IT %s\n#define KDA_K %s\n#define KDA_V %s\n#define KDA_VFIRST %s\n#define EMU_SR %s\n' \
            "$st" "$it" "$k" "$vd" "$vf" "$sr"
        awk '/^\/\/ Eager decode, pipelined/ { exit } { print }' kernels/kda_decode.cu | grep -v '#include "kda_'
        # the bulk copies' plain stand-ins (kda_chunk_state's STATE_BULK path)
        awk '/^\/\/ Bulk copies \(sm_90/ { on = 1 } on { print } on && /^#endif/ { exit }' kernels/kda_decode.cu
        grep -v '#include "kda_' kernels/kda_chunk.cu
        cat tools/offline/chunk_emu/emu_main.cpp
    } | sed 's/extern __shared__ __align__(16)/extern/; s/__shared__ __align__(16)/alignas(16) static/' >"$tu"
    g++ -std=c++20 -O2 -ffp-contract=off -pthread -w -Itools/offline/chunk_emu -o "${tu%.cpp}" "$tu"
    echo "== state $st, inputs $it, $([ "$vf" = 1 ] && echo V-first || echo K-first), K $k V $vd$([ "$sr" = 1 ] && echo ", stochastic rounding")"
    "${tu%.cpp}" || fails=$((fails + 1))
done
[ "$fails" = 0 ] && echo "all variants ok" || { echo "$fails variants FAILED"; exit 1; }
