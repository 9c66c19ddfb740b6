#!/usr/bin/env python3
"""Prefill table of one run_wgmma.sh bench: detattn on attn.cu (mma.sync) and on prefill_sm90.cu
(its variants), torch SDPA flash and cuDNN, and the floor at 800 TFLOP/s, on the README's
causal shapes. "best" is the fastest wgmma column of the row.

Usage: python3 tests/cuda/wgmma_table.py NAME=ours.csv [NAME=ours.csv ...] peers.csv
(each ours.csv printed by `detattn-bench --backend cuda --prefill-only` under one
DA_CUDA_PREFILL setting, the first one mma.sync's; peers.csv by
`clients/bench/sdpa_peer.py --prefill-only --csv`).
"""
import csv
import sys

def rows(path):
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def flops(b, length, h, d):
    # Causal: query t sees t + 1 keys; q.k and p.v, 2 FLOPs per MAC each.
    return 4.0 * b * h * d * length * (length + 1) / 2.0


def main():
    named = [a.split("=", 1) for a in sys.argv[1:] if "=" in a]
    rest = [a for a in sys.argv[1:] if "=" not in a]
    NAMES = [n for n, _ in named]
    ours = [rows(p) for _, p in named]
    peers = rows(rest[0]) if rest else []
    by = [{(int(r["B"]), int(r["L"]), int(r["d"])): r for r in o if r.get("kind") == "prefill"} for o in ours]
    pk = {}
    for r in peers:
        if r["kind"] == "prefill" and r["causal"] == "1" and r["ms"]:
            pk[(int(r["B"]), int(r["L"]), int(r["d"]), r["peer"])] = float(r["ms"])
    head = ["B", "L", "d", "floor ms"] + [f"{n} ms (TFLOP/s)" for n in NAMES]
    head += ["best", "best / " + NAMES[0], "flash ms (TFLOP/s)", "best x flash", "cuDNN ms (TFLOP/s)", "best x cuDNN"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    keys = sorted(set().union(*[set(b) for b in by]), key=lambda k: (k[2], -k[0]))
    for key in keys:
        b, length, d = key
        src = next(x[key] for x in by if key in x)
        f = flops(b, length, int(src["Hq"]), d)

        def cell(ms):
            return "-" if ms is None else f"{ms:.3f} ({f / ms / 1e9:.0f})"

        ms = [float(x[key]["ms"]) if key in x else None for x in by]
        wg = [(m, NAMES[i]) for i, m in enumerate(ms) if i > 0 and m is not None]
        best, best_name = min(wg) if wg else (None, "-")
        fl = pk.get((b, length, d, "flash"))
        cu = pk.get((b, length, d, "cudnn"))
        ratio = lambda x, y: "-" if x is None or y is None else f"{x / y:.2f}"
        cells = [str(b), str(length), str(d), f"{f / 800e12 * 1e3:.3f}"] + [cell(m) for m in ms]
        cells += [best_name, ratio(ms[0], best), cell(fl), ratio(fl, best), cell(cu), ratio(cu, best)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
