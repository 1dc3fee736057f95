#!/usr/bin/env bash
#   tools/device/ncu_source.sh BUILD KERNEL_REGEX TAG BENCH-ARGS...   (on the device)
# ncu's per-instruction source view (SASS, stall samples, executed instructions, shared-memory
# wavefronts) of one launch of a chunk kernel of $DEVBIN/BUILD (default .devbin/c75), with its
# details page: $OUT/q/TAG_sass.csv.gz and TAG_details.txt, packed into $OUT/q_TAG.tgz. (The
# seventieth session's regions and stall shares came from these.)
set -u
C=${DEVBIN:-.devbin/c75}; B=$1; KR=$2; TAG=$3; shift 3
O=$OUT/q; mkdir -p "$O"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
KDA_KERNEL_CACHE=$C/$B/kc LD_LIBRARY_PATH=$C/$B/lib timeout 200 "$ncu" --clock-control none -k "regex:$KR" -c 1 \
    --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
    --section InstructionStats --section MemoryWorkloadAnalysis_Tables --import-source no -f -o "$O/$TAG" \
    $C/$B/kda-pool bench --op prefill --replays 1 "$@" >"$O/$TAG.log" 2>&1
echo "ncu $TAG rc=$?"
"$ncu" --import "$O/$TAG.ncu-rep" --page details >"$O/${TAG}_details.txt" 2>&1
"$ncu" --import "$O/$TAG.ncu-rep" --page source --csv --print-source sass >"$O/${TAG}_sass.csv" 2>&1
gzip -f "$O/${TAG}_sass.csv"
rm -f "$O/$TAG.ncu-rep"; tar czf "$OUT/q_$TAG.tgz" -C "$OUT" q; ls -la "$O"
