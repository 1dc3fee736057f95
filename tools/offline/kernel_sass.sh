#!/usr/bin/env bash
# Compiles the kernel modules offline for sm_90 with CUDA 13.0's nvcc (NVIDIA's Python wheels,
# fetched once into $KDA_CUDA_CACHE), prints each kernel's registers and spills, and with two
# git revisions says which kernels' SASS differ between them (a kernel change that leaves the
# SASS of the kernels in use identical needs no new measurement).
#   tools/offline/kernel_sass.sh regs [REV]          registers of REV (default: the working tree)
#   tools/offline/kernel_sass.sh cmp REV_A [REV_B]   SASS of every kernel, REV_A against REV_B (or the tree)
# NVRTC, the device's compiler, can refuse what nvcc compiles here: before a device call also run
# the registry's NVRTC test (`.ci/run` shows how to get NVRTC without CUDA). The registry loads
# NVRTC's CUBIN (CUDA 13.0's ptxas, as here), so the SASS here should be the SASS that runs;
# with KDA_CUDA_CODE=ptx the driver's JIT assembles it and may differ (it spilled where this
# did not).
# Variants: K = V = 128; fp32 / fp16 / bf16 K-first and fp32 / fp16 V-first states, bf16 inputs
# for 2-byte states (as the bench).
set -euo pipefail
cd "$(dirname "$0")/../.."
cache="${KDA_CUDA_CACHE:-${TMPDIR:-/tmp}/kda-cuda13}"
cu="$cache/x/nvidia/cu13"
if [ ! -x "$cu/nvvm/bin/cicc" ] || [ ! -x "$cu/bin/cuobjdump" ] || [ ! -x "$cu/bin/nvdisasm" ]; then
    mkdir -p "$cache/whl"
    for pkg in "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cuobjdump" "nvidia-cuda-nvdisasm"; do
        python3 -m pip download --quiet --no-deps "$pkg" -d "$cache/whl"
    done
    for w in "$cache"/whl/*.whl; do python3 -m zipfile -e "$w" "$cache/x"; done
    chmod +x "$cu"/bin/* "$cu/nvvm/bin/cicc"
fi
variants=("float float 0" "kda_half kda_bf16 0" "kda_bf16 kda_bf16 0" "float float 1" "kda_half kda_bf16 1")

# build REV OUTDIR: one cubin per variant (REV empty: the working tree)
build() {
    local rev=$1 out=$2 src="$2/src"
    mkdir -p "$src"
    for f in kda_compat.cuh kda_common.cuh kda_decode.cu kda_ring.cu kda_ring_mma.cu kda_ring_delta.cu kda_chunk.cu; do
        if [ -z "$rev" ]; then
            cp "kernels/$f" "$src/$f" 2>/dev/null || : >"$src/$f"
        else
            git show "$rev:kernels/$f" >"$src/$f" 2>/dev/null || : >"$src/$f"
        fi
    done
    for v in "${variants[@]}"; do
        read -r st it vf <<<"$v"
        local tu="$out/$st-$vf.cu"
        tools/offline/kernel_tu.sh "$src" "$st" "$it" "$vf" >"$tu"
        "$cu/bin/nvcc" -cubin -arch=sm_90 -std=c++17 -I"$cu/include" -Xptxas -v -diag-suppress 128 \
            -o "${tu%.cu}.cubin" "$tu" >"${tu%.cu}.log" 2>&1 || { cat "${tu%.cu}.log"; exit 1; }
    done
}

# sass CUBIN FUNC: the function's instructions without addresses and encodings
sass() { PATH="$cu/bin:$PATH" "$cu/bin/cuobjdump" -sass -fun "$2" "$1" | grep -E '^\s+/\*[0-9a-f]{4,}\*/' | sed -E 's@^\s+/\*[0-9a-f]+\*/@@; s@/\*.*@@'; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case "${1:-}" in
regs)
    build "${2:-}" "$tmp/a"
    for v in "${variants[@]}"; do
        read -r st _ vf <<<"$v"
        # per entry: its name, then (after any device function's properties) its spills and
        # registers; a device function's spill line alone is not an entry's
        awk -v tag="$st $([ "$vf" = 1 ] && echo V-first || echo K-first)" '
            /Compiling entry function/ { match($0, /\x27[a-z_]+\x27/); name = substr($0, RSTART + 1, RLENGTH - 2); spill = "?"; next }
            /Function properties for/ { props = $NF; next }
            /bytes spill stores/ { if (name != "" && props == name) spill = $5; next }
            /Used [0-9]+ registers/ && name != "" { print tag ": " name " " $5 " registers, " spill " bytes spilled"; name = "" }
        ' "$tmp/a/$st-$vf.log"
    done
    ;;
cmp)
    [ -n "${2:-}" ] || { echo "usage: $0 cmp REV_A [REV_B]" >&2; exit 2; }
    build "$2" "$tmp/a"
    build "${3:-}" "$tmp/b"
    for v in "${variants[@]}"; do
        read -r st _ vf <<<"$v"
        a="$tmp/a/$st-$vf.cubin" b="$tmp/b/$st-$vf.cubin"
        fa=$("$cu/bin/cuobjdump" -sass "$a" | awk '/Function :/ {print $3}' | sort)
        fb=$("$cu/bin/cuobjdump" -sass "$b" | awk '/Function :/ {print $3}' | sort)
        for fn in $(printf '%s\n%s\n' "$fa" "$fb" | sort -u); do
            if ! grep -qx "$fn" <<<"$fa"; then
                r="only in ${3:-the tree}"
            elif ! grep -qx "$fn" <<<"$fb"; then
                r="only in $2"
            elif [ "$(sass "$a" "$fn" | md5sum)" = "$(sass "$b" "$fn" | md5sum)" ]; then
                r=same
            else
                r=DIFFERENT
            fi
            echo "$st $([ "$vf" = 1 ] && echo V-first || echo K-first) $fn: $r"
        done
    done
    ;;
*)
    sed -n '2,11p' "$0"
    exit 2
    ;;
esac
