#!/usr/bin/env python3
"""Tables of a same-run A/B (tests/cuda/ab_gpu.sh): per case the minimum over rounds of the
old build, of the new one (and of each variant), the ratio new/old, and the noise: the
larger of the two builds' spreads between rounds (max / min - 1), so a ratio within it is
not a result; with peers.csv, each build's prefill ratio against PyTorch's flash and cuDNN
(peer ms / ours: above 1 is faster). Without an old build (ab_gpu.sh none) the variants are
compared with the new build's defaults.
Usage: ab_compare.py OUT_DIR"""
import collections
import csv
import glob
import os
import re
import sys


class Times(dict):
    """(kind, B, L, d, S) -> the minimum ms over rounds; .spread[key]: max / min - 1."""

    def __init__(self, rows):
        super().__init__({k: min(v) for k, v in rows.items()})
        self.spread = {k: max(v) / min(v) - 1.0 for k, v in rows.items()}


def load(out, pattern):
    """The fixed-split rows of the matching csv files (one per round)."""
    return load_paths(sorted(glob.glob(os.path.join(out, pattern))))


def load_paths(paths):
    """The fixed-split rows of these bench csv files (rounds, or several cases' runs)."""
    rows = collections.defaultdict(list)
    for path in paths:
        for r in csv.DictReader(open(path)):
            if not r.get("mode", "").startswith("fixedS"):
                continue
            key = (r["kind"], int(r["B"]), int(r["L"]), int(r["d"]), int(r["S"]))
            rows[key].append(float(r["ms"]))
    return Times(rows)


def table(title, old, new):
    print(f"## {title}")
    print(f"{'case (kind, B, L, d, S)':36s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'noise':>6s}")
    for k in sorted(old):
        if k in new:
            noise = max(old.spread[k], new.spread[k])
            print(f"{str(k):36s} {old[k]:9.4f} {new[k]:9.4f} {new[k] / old[k]:8.3f} {100 * noise:5.1f}%")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    names = {re.sub(r"^pre-(.*)-(x?[\dx]+)-\d+\.csv$", r"\1", os.path.basename(p))
             for p in glob.glob(os.path.join(out, "pre-*.csv"))}
    old = load(out, "pre-old-*.csv")
    base = old or load(out, "pre-new-*.csv")  # without an old tree: the new build's defaults
    if old:
        table("prefill", old, load(out, "pre-new-*.csv"))
    if base:
        for v in sorted(names - {"old", "new"}):
            table(f"prefill, {v}" + ("" if old else " (old: the new build's defaults)"), base,
                  load(out, f"pre-{v}-*.csv"))
    dec_old = load(out, "dec-old-*.csv")
    dec_base = dec_old or load(out, "dec-new-*.csv")
    if dec_old:
        table("decode", dec_old, load(out, "dec-new-*.csv"))
    if dec_base:
        dec_names = {re.sub(r"^dec-(.*)-\d+-\d+\.csv$", r"\1", os.path.basename(p))
                     for p in glob.glob(os.path.join(out, "dec-*.csv"))}
        for v in sorted(dec_names - {"old", "new"}):
            table(f"decode, {v}" + ("" if dec_old else " (old: the new build's defaults)"), dec_base,
                  load(out, f"dec-{v}-*.csv"))
    peers_path = os.path.join(out, "peers.csv")
    if not os.path.exists(peers_path):
        return
    peers = {}
    for r in csv.DictReader(open(peers_path)):
        if r["ms"] and r["kind"] == "prefill" and r["causal"] == "1":
            peers[(r["kind"], int(r["B"]), int(r["L"]), int(r["d"]), r["peer"])] = float(r["ms"])
    new = load(out, "pre-new-*.csv")
    print(f"{'prefill case':36s} {'flash':>8s} {'cudnn':>8s} {'old/fl':>7s} {'new/fl':>7s} {'old/cu':>7s} {'new/cu':>7s}")
    for k in sorted(new):
        fl, cu = peers.get(k[:4] + ("flash",)), peers.get(k[:4] + ("cudnn",))
        if fl is None or cu is None or k not in old:
            continue
        print(f"{str(k):36s} {fl:8.3f} {cu:8.3f} {fl / old[k]:7.2f} {fl / new[k]:7.2f} {cu / old[k]:7.2f} {cu / new[k]:7.2f}")


if __name__ == "__main__":
    main()
