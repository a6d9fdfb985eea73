#!/usr/bin/env python3
"""Time by kernel from an ncu run that read only each kernel's duration.

Input: the output of
    ncu --clock-control none --metrics gpu__time_duration.sum --csv PROGRAM ...
(lines before the CSV header, the program's own output, are skipped). ncu runs the
kernels one at a time, so the durations add up to more than a pipelined run's wall time
but each kernel's own time is its real one.

Prints, for each kernel name (template arguments cut unless --full; with --by-grid each
name, grid and block apart), its launches, total time, share of the total and mean time,
largest first; where the run also read dram__bytes_read.sum and dram__bytes_write.sum,
the DRAM traffic and its rate too; where it read sm__warps_active.avg.pct_of_peak_sustained_active
and launch__registers_per_thread, the achieved occupancy (each launch weighted by its time) and
the registers a thread. --top N prints only the N largest.
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
    ap.add_argument("--by-grid", action="store_true", help="one line a kernel name, grid and block")
    args = ap.parse_args()
    with open(args.csv, newline="", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{args.csv}: no ncu CSV header (\"ID\",...) found")
    rows = csv.DictReader(lines[start:])
    # one launch a kernel ID: its name, grid and block, duration (ms) and DRAM bytes when read
    launches = collections.OrderedDict()
    for r in rows:
        metric = r.get("Metric Name")
        if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", OCC, REGS):
            continue
        unit = r.get("Metric Unit", "")
        v = float(r["Metric Value"].replace(",", ""))
        l = launches.setdefault(r["ID"], {"name": r["Kernel Name"], "grid": r.get("Grid Size", ""),
                                          "block": r.get("Block Size", ""), "ms": 0.0, "bytes": None,
                                          "occ": None, "regs": None})
        if metric == OCC:
            l["occ"] = v
        elif metric == REGS:
            l["regs"] = int(v)
        elif metric == "gpu__time_duration.sum":
            scale = TIME_UNITS.get(unit)
            if scale is None:
                sys.exit(f"unknown unit {unit!r}")
            l["ms"] = v * scale
        else:
            scale = BYTE_UNITS.get(unit)
            if scale is None:
                sys.exit(f"unknown unit {unit!r}")
            l["bytes"] = (l["bytes"] or 0.0) + v * scale
    if not launches:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    total = collections.Counter()
    count = collections.Counter()
    nbytes = collections.Counter()
    occ_ms = collections.Counter()  # occupancy x time, over the launches that have both
    occ_time = collections.Counter()
    regs = collections.defaultdict(set)
    has_bytes = any(l["bytes"] is not None for l in launches.values())
    has_occ = any(l["occ"] is not None for l in launches.values())
    for l in launches.values():
        k = short(l["name"], args.full)
        if args.by_grid:
            k = f"{k} grid{l['grid']} block{l['block']}"
        total[k] += l["ms"]
        count[k] += 1
        nbytes[k] += l["bytes"] or 0.0
        if l["occ"] is not None:
            occ_ms[k] += l["occ"] * l["ms"]
            occ_time[k] += l["ms"]
        if l["regs"] is not None:
            regs[k].add(l["regs"])
    all_ms = sum(total.values())
    print(f"{sum(count.values())} launches, {all_ms:.3f} ms of kernel time"
          + (f", {sum(nbytes.values()) / 1e9:.1f} GB of DRAM traffic" if has_bytes else ""))
    print(f"{'ms':>9} {'share':>6} {'launches':>8} {'mean us':>9}" + (f" {'GB':>7} {'GB/s':>6}" if has_bytes else "")
          + (f" {'occ%':>5} {'regs':>7}" if has_occ else "") + "  kernel")
    for k, v in total.most_common(args.top):
        extra = ""
        if has_bytes:
            extra = f" {nbytes[k] / 1e9:7.2f} {nbytes[k] / 1e6 / v if v else 0:6.0f}"
        if has_occ:
            occ = f"{occ_ms[k] / occ_time[k]:5.1f}" if occ_time[k] > 0 else f"{'-':>5}"
            r = sorted(regs[k])
            rs = "-" if not r else str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}"
            extra += f" {occ} {rs:>7}"
        print(f"{v:9.3f} {100 * v / all_ms:5.1f}% {count[k]:8d} {1e3 * v / count[k]:9.1f}{extra}  {k}")


OCC = "sm__warps_active.avg.pct_of_peak_sustained_active"
REGS = "launch__registers_per_thread"
TIME_UNITS = {"nsecond": 1e-6, "ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "second": 1e3}
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


if __name__ == "__main__":
    main()
