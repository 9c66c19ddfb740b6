#!/usr/bin/env python3
"""Times PyTorch SDPA (flash and cuDNN backends, through torch.nn.attention.sdpa_kernel, as a
user calls them; timed as detattn-bench times ours: warm, then a CUDA graph of the calls) on
the shapes of `detattn-bench --backend cuda`, checks whether each peer is
batch-invariant on them (a row computed alone vs inside the batch, bitwise), and prints a
side-by-side table with detattn's numbers when given --ours (the CSV the bench printed).

Usage: python3 clients/bench/sdpa_peer.py [--quick] [--prefill-only] [--one-decode B L]...
  [--peer flash|cudnn] [--ours ours.csv] [--csv peers.csv]
"""
import argparse
import csv
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PEERS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
DECODE_B = [1, 8, 32, 64, 128]
DECODE_L = [1024, 4096, 16384, 65536]
WARM_MS = 250  # GPU time a case runs before it is timed (detattn-bench's WARM_MS)


def sdpa(backend, q, k, v, causal, gqa):
    with sdpa_kernel([backend]):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def elapsed_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def time_calls(fn, iters):
    """(ms, eager ms, timing): the GPU's time a call, from iters calls captured in one CUDA
    graph and replayed at once (no host launch inside: detattn-bench times its steps the same
    way), and from iters calls launched back to back, where short calls wait on Python and the
    dispatcher. timing is "graph", or "eager" when the call cannot be captured."""
    # Warm for WARM_MS of GPU time first (as detattn-bench does): clocks under sustained load.
    spent = 0.0
    for _ in range(10000):
        if spent >= WARM_MS:
            break
        spent += elapsed_ms(lambda: [fn() for _ in range(iters)])
    eager = elapsed_ms(lambda: [fn() for _ in range(iters)]) / iters
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # a warm call on a side stream before capture, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        ms = elapsed_ms(g.replay) / iters
        del g
        return ms, eager, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return eager, eager, "eager"


def run_peer(backend, q, k, v, causal, iters):
    """Returns (ms, how, invariant, eager ms): how says whether GQA ran natively or on
    expanded K/V and how the call was timed (time_calls)."""
    hq, hkv = q.shape[1], k.shape[1]
    attempts = [("gqa", k, v, hq != hkv)]
    if hq != hkv:
        attempts.append(("expanded", None, None, False))
    last = None
    for how, kk, vv, gqa in attempts:
        try:
            if kk is None:
                kk = k.repeat_interleave(hq // hkv, dim=1)
                vv = v.repeat_interleave(hq // hkv, dim=1)
            out = sdpa(backend, q, kk, vv, causal, gqa)
            ms, eager, timing = time_calls(lambda: sdpa(backend, q, kk, vv, causal, gqa), iters)
            # Batch invariance: row 0 alone vs row 0 inside the batch. A batch of one is
            # compared against itself inside a batch of four (three other random rows).
            if q.shape[0] > 1:
                alone = sdpa(backend, q[:1], kk[:1], vv[:1], causal, gqa)
                inv = torch.equal(alone[0], out[0])
            else:
                qb = torch.cat([q, torch.randn_like(q).repeat(3, 1, 1, 1)])
                kb = torch.cat([kk, torch.randn_like(kk).repeat(3, 1, 1, 1)])
                vb = torch.cat([vv, torch.randn_like(vv).repeat(3, 1, 1, 1)])
                inv = torch.equal(sdpa(backend, qb, kb, vb, causal, gqa)[0], out[0])
                del qb, kb, vb
            return ms, f"{how}+{timing}", inv, eager
        except (RuntimeError, torch.OutOfMemoryError) as e:  # backend refuses the shape
            last = str(e).splitlines()[0][:80]
        finally:
            torch.cuda.empty_cache()
    return None, last, None, None


def cases(quick, prefill_only=False):
    out = []
    for b in [] if prefill_only else DECODE_B:
        for length in DECODE_L:
            if quick and b > 8:
                continue
            out.append(("decode", b, length, 32, 8, 128, False, 1))
    for b, length, d in [(8, 4096, 64), (8, 4096, 128), (2, 16384, 128)]:
        for causal in ([True, False] if length == 4096 else [True]):
            if quick and (d != 64 or not causal):
                continue
            out.append(("prefill", b, length, 32, 32, d, causal, length))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help="time the prefill shapes only")
    ap.add_argument("--ours", help="CSV printed by detattn-bench --backend cuda")
    ap.add_argument("--csv", help="write the peer rows here")
    ap.add_argument("--one-decode", nargs=2, type=int, metavar=("B", "L"), action="append",
                    help="time this decode shape only (repeatable; e.g. under ncu: run_gpu.sh "
                         "profile-peer)")
    ap.add_argument("--peer", choices=list(PEERS), help="time this peer only")
    args = ap.parse_args()
    chosen = {args.peer: PEERS[args.peer]} if args.peer else PEERS
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    free = torch.cuda.mem_get_info()[0]
    rows = []
    todo = cases(args.quick, args.prefill_only)
    if args.one_decode:
        todo = [("decode", b, length, 32, 8, 128, False, 1) for b, length in args.one_decode]
    for kind, b, length, hq, hkv, d, causal, nq in todo:
        kv_bytes = b * length * hkv * d * 2 * 2
        if 2.5 * kv_bytes > free:
            for name in chosen:
                rows.append(dict(kind=kind, B=b, L=length, d=d, causal=int(causal), peer=name,
                                 ms="", how="skipped: memory", invariant="", eager_ms=""))
            continue
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        # Decode: one query sees every key (no mask). Prefill: causal or not.
        for name, backend in chosen.items():
            ms, how, inv, eager = run_peer(backend, q, k, v, causal and kind == "prefill",
                                           20 if kind == "decode" else 10)
            rows.append(dict(kind=kind, B=b, L=length, d=d, causal=int(causal), peer=name,
                             ms="" if ms is None else f"{ms:.4f}", how=how,
                             invariant="" if inv is None else int(inv),
                             eager_ms="" if eager is None else f"{eager:.4f}"))
            print(f"# {kind} B={b} L={length} d={d} causal={int(causal)} {name}: "
                  f"{'-' if ms is None else f'{ms:.4f} ms'} ({how}) invariant={inv}",
                  file=sys.stderr, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    ours = {}
    if args.ours:
        with open(args.ours) as f:
            for r in csv.DictReader(f):
                # A decode row at the end of its sequence sees every key: causal == full.
                key = (r["kind"], int(r["B"]), int(r["L"]), int(r["d"]),
                       0 if r["kind"] == "decode" else int(r["causal"]))
                ours.setdefault(key, {})[r["mode"].split("+")[0]] = r
    print(f"device: {dev}, torch {torch.__version__}")
    # ours ms and the peers' ms: the GPU's time a call (CUDA graphs, time_calls; "how" says
    # where a call ran eager); ours lat: one step from an idle stream, host launch included.
    print("| kind | B | L | d | causal | ours ms | ours TB/s | ours TFLOP/s | combine % "
          "| ours lat | occS ms | flash ms | x flash | flash inv | cudnn ms | x cudnn | cudnn inv |")
    print("|---" * 17 + "|")
    peers = {}
    for r in rows:
        peers.setdefault((r["kind"], r["B"], r["L"], r["d"], r["causal"]), {})[r["peer"]] = r
    for key, pr in peers.items():
        o = ours.get(key, {})
        fx = o.get("fixedS")
        oc = o.get("occupancyS")
        ms = float(fx["ms"]) if fx else None
        cells = [key[0], key[1], key[2], key[3], key[4],
                 f"{ms:.4f}" if ms else "-",
                 fx["kv_tbs"] if fx else "-", fx["tflops"] if fx else "-",
                 f"{100 * float(fx['combine_ms']) / ms:.1f}" if fx else "-",
                 fx.get("lat_ms") or "-" if fx else "-",
                 oc["ms"] if oc else "-"]
        for name in PEERS:
            p = pr.get(name, {})
            pms = float(p["ms"]) if p.get("ms") else None
            cells += [f"{pms:.4f}" if pms else (p.get("how") or "-")[:24],
                      f"{pms / ms:.2f}" if pms and ms else "-",
                      p.get("invariant", "")]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
