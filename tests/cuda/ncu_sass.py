#!/usr/bin/env python3
"""ncu_sass.py A.csv [B.csv ...]: summaries of ncu source pages (`ncu -i R.ncu-rep --page source
--csv --print-source sass`, plain or .gz): per report the share of stall samples by reason,
the samples on the TMA issue's lines (ELECT, R2UR, UTMALDG: v5.21 found the producer's
per-box cost there), and its TOP (12) SASS lines by samples with their two main reasons.
Used by `run_gpu.sh profile-pages`; NOTES v5.21 reads it. --self-test: on a made-up page."""
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


def summarize(path):
    """{total, executed, by_reason (Counter), issue (TMA issue lines' samples), top [(offset,
    samples, executed, source, why)]} of one source page."""
    hdr, rows = load(path)
    col = {h: i for i, h in enumerate(hdr)}
    samples, execs, src = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = collections.Counter()
    for r in rows:
        for i in reasons:
            by_reason[hdr[i][6:]] += num(r[i])
    base = int(rows[0][col["Address"]], 16) if rows else 0
    top = []
    for r in sorted(rows, key=lambda r: -num(r[samples]))[:TOP]:
        top2 = sorted(((num(r[i]), hdr[i][6:]) for i in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {v:.0f}" for v, name in top2 if v > 0)
        top.append((int(r[col["Address"]], 16) - base, num(r[samples]), num(r[execs]), r[src].strip(), why))
    return {"total": sum(by_reason.values()), "executed": sum(num(r[execs]) for r in rows),
            "by_reason": by_reason,
            "issue": sum(num(r[samples]) for r in rows if any(op in r[src] for op in ISSUE_OPS)), "top": top}


def show(path):
    s = summarize(path)
    total = s["total"] or 1.0
    print(f"== {path}: {s['total']:.0f} samples, {s['executed']:.0f} instructions executed")
    print("   by reason (% of samples): " +
          ", ".join(f"{k} {100 * v / total:.1f}" for k, v in s["by_reason"].most_common(10)))
    print(f"   TMA issue lines ({' / '.join(ISSUE_OPS)}): {s['issue']:.0f} samples ({100 * s['issue'] / total:.1f} %)")
    for off, n, x, source, why in s["top"]:
        print(f"   {off:06x} {n:8.0f} x{x:<10.0f} {source[:64]:64s} {why}")


def self_test():
    """A made-up two-line page, plain and gzipped: the sums, the issue lines and the order."""
    import tempfile
    text = ('"Kernel Name","k"\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait",'
            '"stall_long_sb","stall_wait (Not Issued)"\n'
            '"0x100","UTMALDG.2D desc[UR34], [UR20], [UR32]","5","8","2","3","9"\n'
            '"0x110","@P2 BRA 0x100","40","8","1","39","9"\n')
    with tempfile.TemporaryDirectory() as d:
        for name, opener in (("p.csv", open), ("p.csv.gz", gzip.open)):
            path = os.path.join(d, name)
            with opener(path, "wt") as f:
                f.write(text)
            s = summarize(path)
            assert s["total"] == 45 and s["executed"] == 16, s
            assert s["by_reason"] == {"wait": 3, "long_sb": 42}, s["by_reason"]
            assert s["issue"] == 5, s["issue"]
            assert [t[0] for t in s["top"]] == [0x10, 0x0] and s["top"][0][4] == "long_sb 39, wait 1", s["top"]
    print("ncu_sass self-test: ok")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--self-test":
        self_test()
        return
    for path in sys.argv[1:]:
        show(path)


if __name__ == "__main__":
    main()
