#!/usr/bin/env python3
"""Prefill table of one run_wgmma.sh bench: detattn on attn.cu (mma.sync) and on prefill_sm90.cu
(wgmma-serial and wgmma), torch SDPA flash and cuDNN, and the floor at 800 TFLOP/s, on the
README's causal shapes.

Usage: python3 tests/cuda/wgmma_table.py mma.csv serial.csv wgmma.csv peers.csv
(the first three printed by `detattn-bench --backend cuda --prefill-only` without
DA_CUDA_PREFILL, with =wgmma-serial and with =wgmma; the last by
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
    ours = [rows(p) for p in sys.argv[1:4]]
    peers = rows(sys.argv[4]) if len(sys.argv) > 4 else []
    by = [{(int(r["B"]), int(r["L"]), int(r["d"])): r for r in o if r.get("kind") == "prefill"} for o in ours]
    pk = {}
    for r in peers:
        if r["kind"] == "prefill" and r["causal"] == "1" and r["ms"]:
            pk[(int(r["B"]), int(r["L"]), int(r["d"]), r["peer"])] = float(r["ms"])
    print("| B | L | d | floor ms | mma.sync ms (TFLOP/s) | wgmma-serial ms (TFLOP/s) | wgmma ms (TFLOP/s) "
          "| wgmma / mma.sync | flash ms (TFLOP/s) | wgmma x flash | cuDNN ms (TFLOP/s) | wgmma x cuDNN |")
    print("|---" * 12 + "|")
    keys = sorted(set(by[0]) | set(by[1]) | set(by[2]), key=lambda k: (k[2], -k[0]))
    for key in keys:
        b, length, d = key
        h = int((by[0].get(key) or by[1].get(key) or by[2].get(key))["Hq"])
        f = flops(b, length, h, d)

        def cell(ms):
            return "-" if ms is None else f"{ms:.3f} ({f / ms / 1e9:.0f})"

        m = float(by[0][key]["ms"]) if key in by[0] else None
        se = float(by[1][key]["ms"]) if key in by[1] else None
        w = float(by[2][key]["ms"]) if key in by[2] else None
        fl = pk.get((b, length, d, "flash"))
        cu = pk.get((b, length, d, "cudnn"))
        ratio = lambda x, y: "-" if x is None or y is None else f"{x / y:.2f}"
        print(f"| {b} | {length} | {d} | {f / 800e12 * 1e3:.3f} | {cell(m)} | {cell(se)} | {cell(w)} | {ratio(m, w)} "
              f"| {cell(fl)} | {ratio(fl, w)} | {cell(cu)} | {ratio(cu, w)} |")


if __name__ == "__main__":
    main()
