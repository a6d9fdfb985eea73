#!/usr/bin/env python3
"""Time by kernel from an ncu run that read only each kernel's duration.

Input: the output of
    ncu --clock-control none --metrics gpu__time_duration.sum --csv PROGRAM ...
(lines before the CSV header, the program's own output, are skipped). ncu runs the
kernels one at a time, so the durations add up to more than a pipelined run's wall time
but each kernel's own time is its real one.

Prints, for each kernel name (template arguments cut unless --full), its launches, total
time, share of the total and mean time, largest first; --skip N drops each name's first N
launches (warm-up), --top N prints only the N largest.
"""
import argparse
import collections
import csv
import re
import sys


def short(name, full):
    if full:
        return name
    name = re.sub(r"<.*>", "<>", name)  # template arguments
    return re.sub(r"\(.*\)$", "", name)  # parameter list


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu's CSV output (with the program's own lines before it)")
    ap.add_argument("--full", action="store_true", help="keep template arguments")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.csv, newline="", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{args.csv}: no ncu CSV header (\"ID\",...) found")
    rows = csv.DictReader(lines[start:])
    total = collections.Counter()
    count = collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-6, "ns": 1e-6, "us": 1e-3, "ms": 1.0, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit)
        if scale is None:
            sys.exit(f"unknown unit {unit!r}")
        k = short(r["Kernel Name"], args.full)
        total[k] += v * scale
        count[k] += 1
    if not total:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    all_ms = sum(total.values())
    print(f"{sum(count.values())} launches, {all_ms:.3f} ms of kernel time")
    print(f"{'ms':>9} {'share':>6} {'launches':>8} {'mean us':>9}  kernel")
    for k, v in total.most_common(args.top):
        print(f"{v:9.3f} {100 * v / all_ms:5.1f}% {count[k]:8d} {1e3 * v / count[k]:9.1f}  {k}")


if __name__ == "__main__":
    main()
