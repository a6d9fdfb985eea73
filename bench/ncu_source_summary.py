#!/usr/bin/env python3
"""Summarise ncu's per-instruction source page of one kernel.

Input: the output of
    ncu --section SourceCounters --section WarpStateStats -k regex:KERNEL --launch-count 1 \\
        --page source --csv --print-source sass PROGRAM ...
(bench/cuda_device.sh srcstalls writes it to $OUT/ncu_source.csv). Lines before the CSV
header (the program's own output) are skipped.

Prints the kernel's executed warp instructions; for every stretch of SASS between two
block barriers (BAR.SYNC) or an EXIT, its share of the executed instructions and of the
warp-stall samples; the instruction mix; and the instructions with the most stall samples.
A stretch that holds many more stall samples than instructions waits on something (memory,
a barrier, a dependency); the top instructions say what.

With `--print-source cuda,sass` and a program built with -lineinfo (bench/cuda_device.sh
srclines), the page holds one section per source file, each source line followed by its SASS;
the summary is then per source line: its share of the stall samples and of the executed
instructions, and its three largest stall reasons (a barrier stall is counted at the line
after the barrier).
"""
import argparse
import collections
import csv
import sys

ADDR, SRC = "Address", "Source"
SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"


def read_rows(path):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"%s"' % ADDR)), None)
    if start is None:
        sys.exit(f"{path}: no ncu source-page header (a line starting with \"{ADDR}\")")
    rows = list(csv.reader(lines[start:]))
    header = rows[0]
    for col in (SRC, SAMPLES, EXECUTED):
        if col not in header:
            sys.exit(f"{path}: column '{col}' missing (collect SourceCounters and WarpStateStats)")
    idx = {name: header.index(name) for name in header}
    data = [r for r in rows[1:] if len(r) == len(header)]
    if not data:
        sys.exit(f"{path}: no instruction rows")
    return data, idx


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def source_lines(path):
    """Rows of the source lines of a `--print-source cuda,sass` page: (file, line, text,
    samples, executed, {stall reason: samples}); None if the page has no such sections."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    heads = [i for i, l in enumerate(lines) if l.startswith('"Line No"')]
    if not heads:
        return None
    out = []
    for k, h in enumerate(heads):
        fpath = next((l for l in reversed(lines[max(0, h - 3):h]) if l.startswith('"File Path"')),
                     '"File Path","?"')
        fname = next(csv.reader([fpath]))[-1].rsplit("/", 1)[-1]
        end = heads[k + 1] - 3 if k + 1 < len(heads) else len(lines)
        rows = list(csv.reader(lines[h:end]))
        header = rows[0]
        smp, exe = header.index(SAMPLES), header.index(EXECUTED)
        reasons = [(j, c[6:]) for j, c in enumerate(header)
                   if c.startswith("stall_") and "Not Issued" not in c]
        for r in rows[1:]:
            if len(r) != len(header) or not r[0]:
                continue  # a SASS row under its source line
            out.append((fname, r[0], r[1].strip(), num(r[smp]), num(r[exe]),
                        {name: num(r[j]) for j, name in reasons}))
    return out


def print_source_lines(rows, top):
    total_smp = sum(r[3] for r in rows) or 1.0
    total_exe = sum(r[4] for r in rows) or 1.0
    print(f"{total_exe:.4g} warp instructions executed; {total_smp:.0f} stall samples")
    print(f"\nthe {top} source lines with the most stall samples:")
    print(f"{'stalls %':>8s} {'instr %':>8s}  {'file:line':28s} top stall reasons   source")
    for fname, line, text, smp, exe, why in sorted(rows, key=lambda r: -r[3])[:top]:
        best = sorted(why.items(), key=lambda kv: -kv[1])[:3]
        reasons = " ".join(f"{n} {100 * v / smp:.0f}%" for n, v in best if smp and v)
        print(f"{100 * smp / total_smp:8.1f} {100 * exe / total_exe:8.1f}  "
              f"{fname + ':' + line:28s} {reasons:30s} {text[:70]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass (or cuda,sass) output")
    ap.add_argument("--top", type=int, default=20, help="stalled instructions (or lines) to list")
    ap.add_argument("--blocks", type=int, default=0,
                    help="thread blocks of the launch (prints instructions per block)")
    args = ap.parse_args()
    per_line = source_lines(args.csv)
    if per_line is not None:
        print_source_lines(per_line, args.top)
        return
    data, idx = read_rows(args.csv)
    src, smp, exe = idx[SRC], idx[SAMPLES], idx[EXECUTED]
    nis = idx.get(NOT_ISSUED)
    total_exe = sum(num(r[exe]) for r in data) or 1.0
    total_smp = sum(num(r[smp]) for r in data) or 1.0

    print(f"{len(data)} SASS instructions; {total_exe:.4g} warp instructions executed; "
          f"{total_smp:.0f} stall samples")
    if args.blocks > 0:
        print(f"{total_exe / args.blocks:.0f} warp instructions per block")

    print("\nstretches between barriers (line numbers are SASS instruction indices):")
    print(f"{'from':>6s} {'to':>6s} {'instr %':>8s} {'stalls %':>9s}  ends with")
    first, acc_e, acc_s = 0, 0.0, 0.0
    for k, r in enumerate(data):
        acc_e += num(r[exe])
        acc_s += num(r[smp])
        text = r[src].strip()
        if "BAR.SYNC" in text or text.endswith("EXIT") or k == len(data) - 1:
            print(f"{first:6d} {k:6d} {100 * acc_e / total_exe:8.1f} {100 * acc_s / total_smp:9.1f}"
                  f"  {text[:48]}")
            first, acc_e, acc_s = k + 1, 0.0, 0.0

    mix = collections.Counter()
    for r in data:
        ops = [t for t in r[src].split() if not t.startswith("@")]
        if ops:
            mix[ops[0].split(".")[0]] += num(r[exe])
    print("\ninstruction mix (share of executed warp instructions):")
    print("  " + ", ".join(f"{op} {100 * n / total_exe:.1f}%" for op, n in mix.most_common(16)))

    print(f"\nthe {args.top} instructions with the most stall samples:")
    print(f"{'index':>6s} {'samples':>8s} {'not issued':>10s} {'executed':>10s}  instruction")
    top = sorted(range(len(data)), key=lambda k: -num(data[k][smp]))[: args.top]
    for k in top:
        r = data[k]
        ni = f"{num(r[nis]):.0f}" if nis is not None else "-"
        print(f"{k:6d} {num(r[smp]):8.0f} {ni:>10s} {num(r[exe]):10.0f}  {r[src].strip()[:60]}")


if __name__ == "__main__":
    main()
