#!/usr/bin/env bash
#   BASE=B NEW=N1[,N2...] tools/device/compare_call.sh   (on the device, from the repository root)
# One device call comparing kernel builds (each made here by tools/device/build_carry.sh
# c75/NAME into $DEVBIN/NAME, default .devbin/c75): a guarded probe bench of each NEW (40 s;
# PROBE_STATE, default fp32), its GPU prefill tests (TEST_FILTER, default prefill;
# TEST_TIMEOUT), then ROUNDS (default 3) of `bench --op prefill` of BASE and each NEW in turn
# (12 heads 1 x 256, 1 x 2048, 8 x 4096; 32 heads 1 x 2048; 12 heads fp16 1 x 32768; FULL=1:
# 12 and 32 heads 1 x 256, 32 x 256, 1 x 2048, 8 x 4096 and fp16 1 x 32768), with FLA=1
# fla-core's chunk_kda (tools/device/fla_prefill.py, the wheel in .whl/), then ncu's time per
# chunk kernel of each build (NCU_CASES, NCU=0: none). Writes $OUT/q.tgz, packed again after
# each part, so that a call cut short still returns what ran.
set -u
C=${DEVBIN:-.devbin/c75}
BASE=${BASE:?BASE=build}; NEW=${NEW:?NEW=build[,build...]}
O=$OUT/q; mkdir -p "$O"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$O/times.txt"; }
pack() { tar czf "$OUT/q.tgz" -C "$OUT" q; }
nvidia-smi >"$O/smi.txt" 2>&1
bench() { # BUILD TAG TIMEOUT ARGS...
    local b=$1 tag=$2 to=$3; shift 3
    KDA_KERNEL_CACHE=$C/$b/kc LD_LIBRARY_PATH=$C/$b/lib timeout "$to" $C/$b/kda-pool bench \
        --op prefill --json "$O/${tag}_$b.json" "$@" >"$O/${tag}_$b.txt" 2>&1
    local rc=$?; el "$tag $b rc=$rc"; return $rc
}
el start
for b in ${NEW//,/ }; do
    bench "$b" probe 40 --heads 12 --states ${PROBE_STATE:-fp32} --prefill-lens 1x2048 --replays 2 || { pack; el "probe failed"; exit 3; }
done
pack
for b in ${NEW//,/ }; do
    KDA_KERNEL_CACHE=$C/$b/kc timeout "${TEST_TIMEOUT:-120}" $C/$b/cuda_backend --test-threads 1 "${TEST_FILTER-prefill}" \
        >"$O/t_prefill_$b.txt" 2>&1
    el "tests $b rc=$?"
done
pack
for r in $(seq "${ROUNDS:-3}"); do
    for b in $BASE ${NEW//,/ }; do
        if [ "${FULL:-0}" = 1 ]; then
            bench "$b" b$r 100 --heads 12,32 --prefill-lens 1x256,32x256,1x2048,8x4096 --replays 8
            bench "$b" l$r 60 --heads 12,32 --states fp16 --prefill-lens 1x32768 --replays 4
        else
            bench "$b" b$r 100 --heads 12 --prefill-lens 1x256,1x2048,8x4096 --replays 8
            bench "$b" w$r 60 --heads 32 --prefill-lens 1x2048 --replays 8
            bench "$b" l$r 60 --heads 12 --states fp16 --prefill-lens 1x32768 --replays 4
        fi
    done
    pack
done
if [ "${FLA:-0}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl >"$O/pip.txt" 2>&1 && export PYTHONPATH=$PWD/.site
    timeout "${FLA_TIMEOUT:-200}" python3 tools/device/fla_prefill.py chunk >"$O/fla_chunk.txt" 2>&1
    el "fla chunk rc=$?"
    pack
fi
ncu=""
[ "${NCU:-1}" = 0 ] || ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$ncu" ]; then
    for b in $BASE ${NEW//,/ }; do
        for sh in ${NCU_CASES:-12_fp32_1x2048 12_fp16_1x32768 12_fp32_1x256}; do
            set -- ${sh//_/ }
            KDA_KERNEL_CACHE=$C/$b/kc LD_LIBRARY_PATH=$C/$b/lib timeout 60 "$ncu" --clock-control none \
                -k regex:kda_chunk -c 32 --metrics gpu__time_duration.sum --csv \
                $C/$b/kda-pool bench --op prefill --heads $1 --states $2 --prefill-lens $3 --replays 1 \
                >"$O/ncu_${b}_$1H_$2_$3.csv" 2>&1
            el "ncu $b $1 $2 $3 rc=$?"
        done
    done
fi
pack
el done
