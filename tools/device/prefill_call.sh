#!/usr/bin/env bash
#   tools/device/prefill_call.sh TESTED[,TESTED...] BUILD...   (on the device, from the repository root)
# One device call for the GPU prefill: the GPU tests of each build .devbin/TESTED (TEST_FILTER,
# default prefill, empty for all; TEST_TIMEOUT seconds each, default 100), then `bench --op
# prefill` of every BUILD (H 12 and 32; 1 x 256, 32 x 256, 1 x 2048, 8 x 4096 at every dtype;
# 1 x 32768 fp16), fla-core's chunk_kda on the same shapes (tools/device/fla_prefill.py, from
# the wheel in .whl/; FLA_HEADS picks its heads, FLA_TIMEOUT its seconds, default 150), and
# ncu's view of the chunked kernels of the last TESTED at H 32, 8 x 4096, fp32 (NCU=0: none).
# Each build made here with tools/device/build_carry.sh NAME and carried with .whl. Writes
# $OUT/q.tgz (re-packed after each part, so a call cut short still returns what ran).
set -u
tested=${1:?usage: prefill_call.sh TESTED BUILD...}
shift
O=$OUT/q
mkdir -p "$O"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$O/times.txt"; }
pack() { tar czf "$OUT/q.tgz" -C "$OUT" q; }
nvidia-smi >"$O/smi.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl >"$O/pip.txt" 2>&1 && export PYTHONPATH=$PWD/.site
bench() { # BUILD TAG TIMEOUT ARGS...
    local b=$1 tag=$2 to=$3
    shift 3
    KDA_KERNEL_CACHE=.devbin/$b/kc LD_LIBRARY_PATH=.devbin/$b/lib timeout "$to" .devbin/$b/kda-pool bench \
        --op prefill --json "$O/${tag}_$b.json" "$@" >"$O/${tag}_$b.txt" 2>&1
    el "$tag $b rc=$?"
}
el start
for t in ${tested//,/ }; do
    KDA_KERNEL_CACHE=.devbin/$t/kc timeout "${TEST_TIMEOUT:-100}" .devbin/$t/cuda_backend --test-threads 1 "${TEST_FILTER-prefill}" \
        >"$O/t_prefill_$t.txt" 2>&1
    el "tests $t rc=$?"
done
tested=$t
for b in "$@"; do bench "$b" b 100 --heads 12,32 --prefill-lens 1x256,32x256,1x2048,8x4096 --replays 8; done
for b in "$@"; do bench "$b" bl 60 --heads 12,32 --states fp16 --prefill-lens 1x32768 --replays 4; done
pack
timeout "${FLA_TIMEOUT:-150}" python3 tools/device/fla_prefill.py chunk >"$O/fla_chunk.txt" 2>&1
el "fla chunk rc=$?"
pack
ncu=""
[ "${NCU:-1}" = 0 ] || ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$ncu" ]; then
    KDA_KERNEL_CACHE=.devbin/$tested/kc LD_LIBRARY_PATH=.devbin/$tested/lib timeout 60 "$ncu" --clock-control none \
        -k regex:kda_chunk -c 4 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats .devbin/$tested/kda-pool bench --op prefill --heads 32 --states fp32 \
        --prefill-lens 8x4096 --replays 1 >"$O/ncu_$tested.txt" 2>&1
    el "ncu $tested rc=$?"
fi
pack
el done
