#!/usr/bin/env python3
"""Reads what tools/device/compare_call.sh wrote (unpacked q.tgz: DIR holds the bench JSON
rows TAG_BUILD.json and ncu_BUILD_CASE.csv) and prints markdown for docs/performance.md:

  compare_report.py table DIR BASE NEW[,NEW...]   each prefill row: range of us over the rounds
                                                  per build, and BASE's best / NEW's best
  compare_report.py geomean DIR BASE NEW          geometric means of those ratios (all rows,
                                                  2-byte states, fp32), rows at or above 1
  compare_report.py ncu DIR BASE NEW[,NEW...]     per case and kernel, ncu's gpu__time_duration
                                                  summed over the first 8 launches, in us
"""
import collections
import csv
import glob
import io
import json
import math
import sys

SHAPES = ["1 x 256", "32 x 256", "1 x 2048", "8 x 4096", "1 x 32768"]
STATES = ["fp32", "bf16", "fp16"]


def prefill_rows(d, builds):
    rows = collections.OrderedDict()
    for b in builds:
        for f in sorted(glob.glob(f"{d}/[bwl][0-9]*_{b}.json")):
            for r in json.load(open(f)):
                if r["op"] == "prefill":
                    key = (r["H"], f"{r['N']} x {r['T']}", r["state"])
                    rows.setdefault(key, {}).setdefault(b, []).append(r["us"])
    return rows


def table(d, base, new):
    builds = [base] + new
    rows = prefill_rows(d, builds)
    print("| H | shape | state | " + " | ".join(builds) + " | " + " | ".join(f"{base} / {n}" for n in new) + " |")
    print("|" + "---|" * (3 + len(builds) + len(new)))
    order = lambda kv: (kv[0][0], SHAPES.index(kv[0][1]), STATES.index(kv[0][2]))
    for k, v in sorted(rows.items(), key=order):
        cells = [f"{min(v[b]):.1f}-{max(v[b]):.1f}" if b in v else "-" for b in builds]
        rat = [f"{min(v[base]) / min(v[n]):.3f}x" if n in v and base in v else "-" for n in new]
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " | " + " | ".join(rat) + " |")


def geomean(d, base, new):
    rows = prefill_rows(d, [base, new])
    rat = {k: min(v[base]) / min(v[new]) for k, v in rows.items() if base in v and new in v}
    for name, sel in [("all", lambda k: True), ("2-byte", lambda k: k[2] != "fp32"), ("fp32", lambda k: k[2] == "fp32")]:
        xs = [x for k, x in rat.items() if sel(k)]
        if xs:
            gm = math.exp(sum(map(math.log, xs)) / len(xs))
            print(f"{new} {name}: geomean {gm:.4f} over {len(xs)} rows, >= 1: {sum(x >= 1 for x in xs)}")


def ncu(d, base, new):
    res = collections.OrderedDict()
    for b in [base] + new:
        for f in sorted(glob.glob(f"{d}/ncu_{b}_*.csv")):
            case = f.split(f"ncu_{b}_")[1][:-4]
            txt = open(f).read()
            i = txt.find('"ID"')
            if i < 0:
                continue
            per = collections.defaultdict(list)
            for r in csv.DictReader(io.StringIO(txt[i:])):
                if r.get("Metric Name") != "gpu__time_duration.sum":
                    continue
                v = float(r["Metric Value"].replace(",", ""))
                v *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(r["Metric Unit"], 1.0)
                per[r["Kernel Name"].split("(")[0]].append(v)
            for k, v in per.items():
                res.setdefault((case, k), {})[b] = (len(v[:8]), sum(v[:8]))
    print("| case | kernel | launches | " + " | ".join([base] + new) + " | " + " | ".join(f"{base} / {n}" for n in new) + " |")
    print("|" + "---|" * (3 + 1 + 2 * len(new)))
    for (case, k), v in res.items():
        cells = [f"{v[b][1]:.1f}" if b in v else "-" for b in [base] + new]
        rat = [f"{v[base][1] / v[n][1]:.3f}x" if n in v and base in v else "-" for n in new]
        first = v.get(base, next(iter(v.values())))[0]
        print(f"| {case.replace('_', ' ')} | `{k}` | {first} | " + " | ".join(cells) + " | " + " | ".join(rat) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in ("table", "geomean", "ncu"):
        sys.exit(__doc__)
    cmd, d, base, new = sys.argv[1:]
    if cmd == "table":
        table(d, base, new.split(","))
    elif cmd == "geomean":
        geomean(d, base, new)
    else:
        ncu(d, base, new.split(","))
