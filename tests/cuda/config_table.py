#!/usr/bin/env python3
"""The table of `run_gpu.sh configs`: one row a case (decode B, L; causal prefill B, L, d),
one column a configuration (split size S and KV page tokens), each cell ours in ms and the
peers' time over ours (cuDNN / flash; > 1: ours faster), from the better of the
configuration's rounds.

Usage: config_table.py PEERS_CSV... -- LABEL=OURS_CSV[,OURS_CSV...] ...
PEERS_CSV: sdpa_peer.py --csv; OURS_CSV: detattn-bench --backend cuda rows.
"""
import csv
import sys


def case(r):
    """A row's case: (kind, B, L, d), decode rows at any causal (one query sees every key),
    prefill rows causal only (the contract's; the peers' non-causal rows have no ours)."""
    if r["kind"] == "prefill" and r["causal"] != "1":
        return None
    return (r["kind"], int(r["B"]), int(r["L"]), int(r["d"]))


def best_ms(paths):
    """case -> the least fixedS ms over the given bench CSVs."""
    best = {}
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                key = case(r)
                if key is None or not r["mode"].startswith("fixedS") or not r["ms"]:
                    continue
                ms = float(r["ms"])
                best[key] = min(ms, best.get(key, ms))
    return best


def main():
    if "--" not in sys.argv[1:]:
        sys.exit(__doc__)
    cut = sys.argv.index("--")
    peers = {}
    for path in sys.argv[1:cut]:
        with open(path) as f:
            for r in csv.DictReader(f):
                key = case(r)
                if key is not None and r["ms"]:
                    peers.setdefault(key, {})[r["peer"]] = float(r["ms"])
    cfgs = []
    for arg in sys.argv[cut + 1:]:
        label, _, paths = arg.partition("=")
        cfgs.append((label, best_ms(paths.split(","))))
    ours = {k for _, b in cfgs for k in b}
    print("| case | cuDNN ms | flash ms | " + " | ".join(f"S:page {c}" for c, _ in cfgs) + " |")
    print("|---" * (3 + len(cfgs)) + "|")
    for key in sorted(ours, key=lambda k: (k[0] != "decode", k[1:])):
        p = peers.get(key, {})
        name = f"decode B {key[1]} L {key[2]}" if key[0] == "decode" else f"prefill B {key[1]} L {key[2]} d {key[3]}"
        cells = [name] + [f"{p[n]:.4f}" if n in p else "-" for n in ("cudnn", "flash")]
        for _, b in cfgs:
            ms = b.get(key)
            x = " / ".join(f"{p[n] / ms:.3f}" if n in p and ms else "-" for n in ("cudnn", "flash"))
            cells.append("-" if ms is None else f"{ms:.4f} ({x})")
        print("| " + " | ".join(cells) + " |")
    print("cells: ours ms (x cuDNN / x flash), the better of the rounds; x > 1: ours faster")


if __name__ == "__main__":
    main()
