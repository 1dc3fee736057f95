#!/usr/bin/env bash
#   tools/device/gpu_suite_timed.sh NAME OUTDIR     (on the device)
# The GPU tests of build .devbin/NAME one process per test, each timed, so a call says where the
# suite's time goes (one `cuda_backend` run prints no per-test times). The first process fills
# a kernel cache (KDA_KERNEL_CACHE, this build's) with the suite's modules, which every later
# one loads: each test after the first then costs its own work plus about a second of start.
# Writes OUTDIR/suite_NAME.txt (each test's output and its wall time in ms) and prints a
# summary, slowest first.
set -u
name=${1:?usage: gpu_suite_timed.sh NAME OUTDIR}
out=${2:?usage: gpu_suite_timed.sh NAME OUTDIR}
bin=.devbin/$name/cuda_backend
export KDA_KERNEL_CACHE=${KDA_KERNEL_CACHE:-/tmp/kc_suite_$name}
log="$out/suite_$name.txt"
: >"$log"
summary=()
for t in $("$bin" --list 2>/dev/null | sed -n 's/: test$//p'); do
    s0=$(date +%s%N)
    "$bin" --test-threads 1 --exact "$t" >>"$log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - s0) / 1000000))
    echo "== $t rc=$rc wall_ms=$ms" >>"$log"
    summary+=("$ms $rc $t")
done
printf '%s\n' "${summary[@]}" | sort -rn | awk '{printf "%8d ms  rc=%s  %s\n", $1, $2, $3}' | tee -a "$log"
