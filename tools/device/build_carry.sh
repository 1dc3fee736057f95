#!/usr/bin/env bash
#   tools/device/build_carry.sh NAME
# Builds what a device call runs, here (the device has no Rust toolchain): the CLI and the GPU
# test binary with the `cuda` feature, stripped, into .devbin/NAME (keep .devbin/ out of git:
# .git/info/exclude), to name in the call's `carry`. On the device:
#   .devbin/NAME/cuda_backend --test-threads 1 [FILTER]     the GPU tests
#   LD_LIBRARY_PATH=.devbin/NAME/lib .devbin/NAME/kda-pool bench ...   the benchmark
# (both with KDA_KERNEL_CACHE=.devbin/NAME/kc where the build's bench modules were precompiled
# here, below, so the device loads them instead of compiling them).
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: tools/device/build_carry.sh NAME}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cudadev}"
cargo build --release --features cuda
test_bin=$(cargo test --release --features cuda -p kda-kernels --test cuda_backend --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_backend" and m.get("executable"):
        print(m["executable"])')
out=".devbin/$name"
mkdir -p "$out"
cp "$CARGO_TARGET_DIR/release/kda-pool" "$out/kda-pool"
cp "$test_bin" "$out/cuda_backend"
strip "$out/kda-pool" "$out/cuda_backend"
# The device lacks some of the CLI's shared libraries (libfontconfig and its dependencies, for
# plotters' `ttf` feature): carry them too, and run with LD_LIBRARY_PATH=.devbin/NAME/lib.
mkdir -p "$out/lib"
ldd "$out/kda-pool" | awk '$3 ~ /^\// {print $3}' |
    { grep -Ev '/(libc|libm|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' || true; } |
    xargs -r cp -L -t "$out/lib"
ls -l "$out"
# The bench's kernel modules (K = V = 128, K-first, bf16 inputs, every state dtype) and the fill
# module, compiled here for the H200 into $out/kc. The device finds them only where the file
# names match its own: NVRTC 13.0 here as there, and the same include option, which needs
# /usr/local/cuda/include/cuda_fp16.h here (the device's headers are there; a link to the CUDA
# wheel that tools/offline/kernel_sass.sh fetches will do). Otherwise the device compiles as
# before. NVRTC from KDA_NVRTC_LIB (default: where .ci/run puts it).
nvrtc_lib=${KDA_NVRTC_LIB:-${TMPDIR:-/tmp}/kda-ci-nvrtc/x/nvidia/cu13/lib}
if [ -e /usr/local/cuda/include/cuda_fp16.h ] && [ -d "$nvrtc_lib" ]; then
    env -u CUDA_PATH -u CUDA_HOME LD_LIBRARY_PATH="$nvrtc_lib" "$out/kda-pool" precompile \
        --arch sm_90 --cache "$out/kc" --states fp32,fp16,bf16 --layouts kfirst
else
    echo "no kernel modules precompiled: needs NVRTC in $nvrtc_lib and /usr/local/cuda/include/cuda_fp16.h"
fi
