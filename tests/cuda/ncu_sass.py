#!/usr/bin/env python3
"""ncu_sass.py A.csv [B.csv ...]: summaries of ncu source pages (`ncu -i R.ncu-rep --page source
--csv --print-source sass`, plain or .gz): per report the share of stall samples by reason,
the samples on the TMA issue's lines (ELECT, R2UR, UTMALDG: v5.21 found the producer's
per-box cost there), and its TOP (12) SASS lines by samples with their two main reasons.
Used by `run_gpu.sh profile-pages`; NOTES v5.21 reads it."""
import collections
import csv
import gzip
import os
import sys

TOP = int(os.environ.get("TOP", "12"))
ISSUE_OPS = ("ELECT", "R2UR", "UTMALDG")


def load(path):
    """(header, rows) of the first kernel in a source-page CSV (line 1 names the kernel)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def num(s):
    try:
        return float(s)
    except ValueError:
        return 0.0


def summary(path):
    hdr, rows = load(path)
    col = {h: i for i, h in enumerate(hdr)}
    samples, execs, src = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = collections.Counter()
    for r in rows:
        for i in reasons:
            by_reason[hdr[i][6:]] += num(r[i])
    total = sum(by_reason.values()) or 1.0
    issue = sum(num(r[samples]) for r in rows if any(op in r[src] for op in ISSUE_OPS))
    print(f"== {path}: {total:.0f} samples, {sum(num(r[execs]) for r in rows):.0f} instructions executed")
    print("   by reason (% of samples): " + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in by_reason.most_common(10)))
    print(f"   TMA issue lines ({' / '.join(ISSUE_OPS)}): {issue:.0f} samples ({100 * issue / total:.1f} %)")
    base = int(rows[0][col["Address"]], 16) if rows else 0
    for r in sorted(rows, key=lambda r: -num(r[samples]))[:TOP]:
        top2 = sorted(((num(r[i]), hdr[i][6:]) for i in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {v:.0f}" for v, name in top2 if v > 0)
        print(f"   {int(r[col['Address']], 16) - base:06x} {num(r[samples]):8.0f} x{num(r[execs]):<10.0f} "
              f"{r[src].strip()[:64]:64s} {why}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        summary(path)


if __name__ == "__main__":
    main()
