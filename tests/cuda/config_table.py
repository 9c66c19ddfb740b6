#!/usr/bin/env python3
"""The table of `run_gpu.sh configs`: one row a case (decode B, L; causal prefill B, L, d),
one column a configuration (split size S and KV page tokens), each cell ours in ms and the
peers' time over ours (cuDNN / flash; > 1: ours faster), from the better of the
configuration's rounds.

Usage: config_table.py PEERS_CSV... -- LABEL=OURS_CSV[,OURS_CSV...] ...
       config_table.py --self-test   (on made-up CSVs; a ctest, cuda_config_table)
PEERS_CSV: sdpa_peer.py --csv; OURS_CSV: detattn-bench --backend cuda rows.
"""
import csv
import sys

from ab_compare import load_paths  # this directory (the script's) is on sys.path


def case(r):
    """A row's case: (kind, B, L, d), decode rows at any causal (one query sees every key),
    prefill rows causal only (the contract's; the peers' non-causal rows have no ours)."""
    if r["kind"] == "prefill" and r["causal"] != "1":
        return None
    return (r["kind"], int(r["B"]), int(r["L"]), int(r["d"]))


def table(peer_paths, cfg_args):
    """The table's lines from the peers' CSVs and the "LABEL=CSV[,CSV...]" arguments."""
    peers = {}
    for path in peer_paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                key = case(r)
                if key is not None and r["ms"]:
                    peers.setdefault(key, {})[r["peer"]] = float(r["ms"])
    cfgs = []
    for arg in cfg_args:
        label, _, paths = arg.partition("=")
        # (kind, B, L, d, S) -> least ms over the rounds (ab_compare.py's loader); S is the label's
        cfgs.append((label, {k[:4]: ms for k, ms in load_paths(paths.split(",")).items()}))
    ours = {k for _, b in cfgs for k in b}
    lines = ["| case | cuDNN ms | flash ms | " + " | ".join(f"S:page {c}" for c, _ in cfgs) + " |",
             "|---" * (3 + len(cfgs)) + "|"]
    for key in sorted(ours, key=lambda k: (k[0] != "decode", k[1:])):
        p = peers.get(key, {})
        name = f"decode B {key[1]} L {key[2]}" if key[0] == "decode" else f"prefill B {key[1]} L {key[2]} d {key[3]}"
        cells = [name] + [f"{p[n]:.4f}" if n in p else "-" for n in ("cudnn", "flash")]
        for _, b in cfgs:
            ms = b.get(key)
            x = " / ".join(f"{p[n] / ms:.3f}" if n in p and ms else "-" for n in ("cudnn", "flash"))
            cells.append("-" if ms is None else f"{ms:.4f} ({x})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("cells: ours ms (x cuDNN / x flash), the better of the rounds; x > 1: ours faster")
    return lines


def self_test():
    """Made-up CSVs: the better round per configuration, both ratios, a shape a peer lacks,
    decode rows before prefill, the peers' non-causal prefill row left out."""
    import os
    import tempfile
    ours_hdr = "kind,B,L,Hq,Hkv,d,causal,mode,S,ms,attn_ms,combine_ms,kv_tbs,tflops,lat_ms,timing\n"
    files = {
        "peers.csv": "kind,B,L,d,causal,peer,ms,how,invariant,eager_ms\n"
                     "decode,8,65536,128,0,cudnn,0.4800,graph,0,\n"
                     "decode,8,65536,128,0,flash,0.6000,graph,0,\n"
                     "prefill,8,4096,128,1,cudnn,2.0000,graph,1,\n"
                     "prefill,8,4096,128,0,cudnn,3.0000,graph,1,\n",
        "a1.csv": ours_hdr + "prefill,8,4096,32,8,128,1,fixedS,512,2.5000,,,,400,,graph\n"
                             "decode,8,65536,32,8,128,1,fixedS+partial,512,0.5000,,,,,,graph\n",
        "a2.csv": ours_hdr + "decode,8,65536,32,8,128,1,fixedS+partial,512,0.4800,,,,,,graph\n"
                             "decode,1,1024,32,8,128,1,fixedS+inrow,512,0.0100,,,,,,graph\n",
        "b1.csv": ours_hdr + "decode,8,65536,32,8,128,1,fixedS+partial,2048,0.6000,,,,,,graph\n",
    }
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        j = lambda *n: ",".join(os.path.join(d, x) for x in n)
        lines = table([j("peers.csv")], ["512:16=" + j("a1.csv", "a2.csv"), "2048:256=" + j("b1.csv")])
    assert lines[0] == "| case | cuDNN ms | flash ms | S:page 512:16 | S:page 2048:256 |", lines[0]
    assert lines[2] == "| decode B 1 L 1024 | - | - | 0.0100 (- / -) | - |", lines[2]
    assert lines[3] == "| decode B 8 L 65536 | 0.4800 | 0.6000 | 0.4800 (1.000 / 1.250) | 0.6000 (0.800 / 1.000) |", lines[3]
    assert lines[4] == "| prefill B 8 L 4096 d 128 | 2.0000 | - | 2.5000 (0.800 / -) | - |", lines[4]
    assert len(lines) == 6, lines
    print("config_table self-test: ok")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    if "--" not in sys.argv[1:]:
        sys.exit(__doc__)
    cut = sys.argv.index("--")
    print("\n".join(table(sys.argv[1:cut], sys.argv[cut + 1:])))


if __name__ == "__main__":
    main()
