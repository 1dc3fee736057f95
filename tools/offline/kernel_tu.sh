#!/usr/bin/env bash
#   tools/offline/kernel_tu.sh SRC_DIR STATE_TYPE INPUT_TYPE VFIRST [PADDED] > TU
# Prints one translation unit of the kernels in SRC_DIR (a copy of kernels/) as the registry
# builds a module (crates/kda-kernels/src/cuda/registry.rs, `source`): the compat and common
# headers inlined, the specialisation's defines (K = V = 128), then the decode, ring and
# chunked prefill sources. STATE_TYPE, INPUT_TYPE: float, kda_half or kda_bf16; VFIRST: 0 or 1;
# PADDED: 1 for the module of padded batches (KDA_PADDED; default 0, the plain one). Used by
# kernel_sass.sh (CUDA) and hip_check.sh (HIP).
set -euo pipefail
src=${1:?usage: kernel_tu.sh SRC_DIR STATE_TYPE INPUT_TYPE VFIRST}
st=${2:?} it=${3:?} vf=${4:?} padded=${5:-0}
bytes=2
[ "$st" = float ] && bytes=4
cat "$src/kda_compat.cuh"
grep -v '#include "kda_' "$src/kda_common.cuh"
printf '#define KDA_ST %s\n#define KDA_ST_BYTES %s\n#define KDA_IT %s\n#define KDA_K 128\n#define KDA_V 128\n#define KDA_VFIRST %s\n#define KDA_PADDED %s\n' \
    "$st" "$bytes" "$it" "$vf" "$padded"
for f in kda_decode.cu kda_ring.cu kda_ring_mma.cu kda_ring_delta.cu kda_chunk.cu; do
    grep -v '#include "kda_' "$src/$f" || : # (an empty file: a revision before the source)
done
