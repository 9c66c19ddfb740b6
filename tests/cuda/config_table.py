#!/usr/bin/env python3
"""The decode table of `run_gpu.sh configs`: one row a shape, one column a configuration
(split size S and KV page tokens), each cell ours / cuDNN and ours / flash as the peers'
time over ours (> 1: ours faster), from the better of each configuration's rounds.

Usage: config_table.py PEERS_CSV LABEL=OURS_CSV[,OURS_CSV...] ...
PEERS_CSV: sdpa_peer.py --csv; OURS_CSV: detattn-bench --backend cuda --one-decode ... rows.
"""
import csv
import sys


def best_ms(paths):
    """(B, L) -> the least fixedS ms over the given bench CSVs."""
    best = {}
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["kind"] != "decode" or not r["mode"].startswith("fixedS") or not r["ms"]:
                    continue
                key, ms = (int(r["B"]), int(r["L"])), float(r["ms"])
                best[key] = min(ms, best.get(key, ms))
    return best


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    peers = {}
    with open(sys.argv[1]) as f:
        for r in csv.DictReader(f):
            if r["kind"] == "decode" and r["ms"]:
                peers.setdefault((int(r["B"]), int(r["L"])), {})[r["peer"]] = float(r["ms"])
    cfgs = []
    for arg in sys.argv[2:]:
        label, _, paths = arg.partition("=")
        cfgs.append((label, best_ms(paths.split(","))))
    shapes = sorted(set(peers) | {k for _, b in cfgs for k in b})
    print("| B, L | cuDNN ms | flash ms | " + " | ".join(f"S:page {c}" for c, _ in cfgs) + " |")
    print("|---" * (3 + len(cfgs)) + "|")
    for key in shapes:
        p = peers.get(key, {})
        cells = [f"{key[0]}, {key[1]}", f"{p['cudnn']:.4f}" if "cudnn" in p else "-",
                 f"{p['flash']:.4f}" if "flash" in p else "-"]
        for _, b in cfgs:
            ms = b.get(key)
            if ms is None:
                cells.append("-")
                continue
            x = " / ".join(f"{p[n] / ms:.3f}" if n in p else "-" for n in ("cudnn", "flash"))
            cells.append(f"{ms:.4f} ({x})")
        print("| " + " | ".join(cells) + " |")
    print("cells: ours ms (x cuDNN / x flash), the better of the rounds; x > 1: ours faster")


if __name__ == "__main__":
    main()
