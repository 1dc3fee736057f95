#!/usr/bin/env python3
"""Counts a kernel's SASS instructions by source region, offline (the static counts of the
seventy-first session's docs/performance.md).

  sass_region.py SASS KERNEL FIRST_LINE LAST_LINE [FIRST LAST ...]

SASS: `nvdisasm -gi -c CUBIN` of a cubin compiled with `-lineinfo` from a translation unit
of tools/offline/kernel_tu.sh (for example, with the CUDA wheels tools/offline/kernel_sass.sh
fetches:
  tools/offline/kernel_tu.sh SRC_DIR kda_bf16 kda_bf16 0 > tu.cu
  nvcc -cubin -arch=sm_90 -std=c++17 -lineinfo -I$CU/include -o tu.cubin tu.cu
  nvdisasm -gi -c tu.cubin > tu.sass).
Line numbers are those of tu.cu. An instruction counts where any line of its inlining chain
(the consecutive "//## File" lines before it, innermost first) falls in a range. Only the
kernel's body up to its last EXIT counts: after it, the compiler puts out-of-line paths (a
diverged warp's shuffles) that a converged warp never runs. Prints the count, the body's total
and the opcodes by count.
"""
import collections
import re
import sys


def main():
    if len(sys.argv) < 5 or len(sys.argv) % 2 == 0:
        sys.exit(__doc__)
    path, kernel = sys.argv[1], sys.argv[2]
    ranges = [(int(a), int(b)) for a, b in zip(sys.argv[3::2], sys.argv[4::2])]
    body, chain, after_file = [], [], False
    on = False
    for ln in open(path):
        if ln.startswith(".text."):
            on = ln.strip() == f".text.{kernel}:"
            continue
        if not on:
            continue
        m = re.match(r'\s*//## File ".*?", line (\d+)(.*)', ln)
        if m:
            lines = [int(m.group(1))] + [int(x) for x in re.findall(r"line (\d+)", m.group(2))]
            chain = chain + lines if after_file else lines
            after_file = True
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if m:
            after_file = False
            body.append((m.group(3).split(".")[0], chain))
    last_exit = max(i for i, (op, _) in enumerate(body) if op == "EXIT")
    body = body[: last_exit + 1]
    ops = collections.Counter(op for op, ch in body if any(lo <= l <= hi for l in ch for lo, hi in ranges))
    print(f"{sum(ops.values())} of {len(body)} instructions")
    for op, n in ops.most_common():
        print(f"{n:6d} {op}")


if __name__ == "__main__":
    main()
