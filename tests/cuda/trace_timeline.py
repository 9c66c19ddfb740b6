#!/usr/bin/env python3
"""Prints the timeline of a traced launch (kernels/cuda/trace.cuh): the "<tag> <block> <slot>
<ns>" lines a -DDA_CUDA_TRACE build writes to stderr at exit, in microseconds from the first
attention CTA's start. Slots of prefill_sm90.cu ("P"): 0 start, 38 block barrier passed, 39
the producer has its item, 3 its first page ids, 1 its first TMA, 41 consumer warpgroup 0
has its Q, 42 / 43 the producer / consumer warpgroup 0 past setmaxnreg, 4 + k tile
or slot k's data (consumer warpgroup 0), 20 + k tile or slot k done, 36 a ping-pong segment's
last P V done, 37 a split end done, 40 the item done. combine.cu ("C"): 0 start, 1 the
attention grid complete (griddepcontrol.wait returned), 4 + c chunk c's chain done, 20 + c
chunk c folded, 2 the row folded.
Usage: python3 tests/cuda/trace_timeline.py trace.txt [blocks to list, default 4]
       python3 tests/cuda/trace_timeline.py --medians a.txt b.txt ...: a table of the main
       points' median and last time over the traced CTAs, one column per file (two trees or
       forms side by side; run_gpu.sh trace with TRACE_OLD prints it).
       python3 tests/cuda/trace_timeline.py --busy a.txt ...: per tile slot, the consumer's
       median busy time and its wait for the next tile (run_gpu.sh trace prints it too).
       python3 tests/cuda/trace_timeline.py --end a.txt ...: the step's end, each traced
       pipe's last item's tiles in 4 us bins from the first pipe's end: busy and wait.
"""
import collections
import sys


def load(path):
    """The trace points of a file: ({block: {slot: ns}} of the attention, same of the
    combine, the first attention CTA's start)."""
    rows = {"P": collections.defaultdict(dict), "C": collections.defaultdict(dict)}
    for line in open(path):
        f = line.split()
        if len(f) == 4 and f[0] in rows and f[1].isdigit() and f[2].isdigit() and f[3].isdigit():
            rows[f[0]][int(f[1])][int(f[2])] = int(f[3])
    starts = [v[0] for v in rows["P"].values() if 0 in v]
    if not starts:
        sys.exit("no attention trace points in " + path)
    return rows["P"], rows["C"], min(starts)


MEDIAN_POINTS = [("P", 0, "start"), ("P", 38, "block barrier"), ("P", 39, "producer has its item"),
                 ("P", 3, "first page ids"), ("P", 1, "producer at its first TMA"), ("P", 41, "consumer has Q"),
                 ("P", 4, "tile 0 data"), ("P", 20, "tile 0 done"), ("P", 11, "tile 7 data"),
                 ("P", 37, "a split end done"), ("P", 40, "item done"), ("C", 1, "combine: grid complete"),
                 ("C", 2, "combine: row folded")]


def medians(paths):
    loaded = [load(p) for p in paths]
    print("point | " + " | ".join(paths) + "  (us from the first CTA's start: median / last)")
    for kind, slot, what in MEDIAN_POINTS:
        cells = []
        for P, C, t0 in loaded:
            xs = sorted((v[slot] - t0) / 1000.0 for v in (P if kind == "P" else C).values() if slot in v)
            cells.append("%.2f / %.2f" % (xs[len(xs) // 2], xs[-1]) if xs else "-")
        print(what + " | " + " | ".join(cells))


def busy(paths):
    """Per traced slot k (an item's first 16 tiles, consumer warpgroup 0): the median over the
    traced CTAs of the consumer's busy time (slot k's data to slot k done) and of its wait for
    the next tile (slot k done to slot k + 1's data), us; near-zero waits mean the consumer,
    not the memory, sets the pace."""
    for path in paths:
        P, _, _ = load(path)
        print("%s: slot | busy us (median) | wait us (median) | CTAs" % path)
        all_busy, all_wait = [], []
        for k in range(16):
            b = sorted((v[20 + k] - v[4 + k]) / 1000.0 for v in P.values() if 4 + k in v and 20 + k in v)
            w = sorted((v[5 + k] - v[20 + k]) / 1000.0 for v in P.values() if 20 + k in v and 5 + k in v and k < 15)
            if not b:
                continue
            all_busy += b
            all_wait += w
            print("%d | %.3f | %s | %d" % (k, b[len(b) // 2], "%.3f" % w[len(w) // 2] if w else "-", len(b)))
        if all_busy:
            all_busy.sort()
            all_wait.sort()
            print("all slots | %.3f | %s |" % (all_busy[len(all_busy) // 2],
                                               "%.3f" % all_wait[len(all_wait) // 2] if all_wait else "-"))


def end(paths, width=4.0):
    """The end of a step: each traced pipe's last item (its slots written within 20 us before
    the item's end; a one-split tail is 8 of them), binned by each tile's data time in bins of
    `width` us from the first traced pipe's end: the median busy time (data k to done k) and
    wait for the next tile (done k to data k + 1), us. A busy time that stays while the wait
    falls means the slot, not the memory, paces the last split (NOTES.md v5.27)."""
    for path in paths:
        P, _, t0 = load(path)
        dones = sorted((v[40] - t0) / 1000.0 for v in P.values() if 40 in v)
        if not dones:
            continue
        first = dones[0]
        bins = collections.defaultdict(lambda: ([], []))
        for v in P.values():
            if 40 not in v:
                continue
            done = (v[40] - t0) / 1000.0
            ks = [k for k in range(16) if 4 + k in v and 20 + k in v and (v[4 + k] - t0) / 1000.0 > done - 20]
            for k in ks:
                d = (v[4 + k] - t0) / 1000.0
                b = bins[int((d - first) // width)]
                b[0].append((v[20 + k] - v[4 + k]) / 1000.0)
                if k + 1 in ks:
                    b[1].append((v[5 + k] - v[20 + k]) / 1000.0)
        print("%s: pipes done first / median / last %.1f / %.1f / %.1f us" %
              (path, first, dones[len(dones) // 2], dones[-1]))
        print("us from first done | tiles | busy us (median) | wait us (median)")
        for i in sorted(bins):
            b, w = sorted(bins[i][0]), sorted(bins[i][1])
            print("%.0f to %.0f | %d | %.2f | %s" % (i * width, (i + 1) * width, len(b), b[len(b) // 2],
                                                    "%.2f" % w[len(w) // 2] if w else "-"))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--end":
        end(sys.argv[2:])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--medians":
        medians(sys.argv[2:])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--busy":
        busy(sys.argv[2:])
        return
    P, C, t0 = load(sys.argv[1])

    def us(v, k):
        return "%.2f" % ((v[k] - t0) / 1000.0) if k in v else "-"

    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    print("block | start | barrier | prod. setmaxnreg | cons. setmaxnreg | item | page ids | 1st TMA | Q | data k / done k ... | last PV | split end | done")
    for b in sorted(P)[:n]:
        v = P[b]
        tiles = " ".join(us(v, 4 + k) + "/" + us(v, 20 + k) for k in range(16) if 4 + k in v)
        print(b, us(v, 0), us(v, 38), us(v, 42), us(v, 43), us(v, 39), us(v, 3), us(v, 1), us(v, 41), tiles, us(v, 36), us(v, 37), us(v, 40))
    done = [v[40] for v in P.values() if 40 in v]
    if done:
        done.sort()
        print("attention: %d blocks traced, done first / 10th pct / median / last at %.2f / %.2f / %.2f / %.2f us"
              % (len(P), (done[0] - t0) / 1000.0, (done[len(done) // 10] - t0) / 1000.0,
                 (done[len(done) // 2] - t0) / 1000.0, (done[-1] - t0) / 1000.0))
    marks = [(0, "start"), (1, "attention grid complete")]
    marks += [(4 + c, "chunk %d chain done" % c) for c in range(16)] + [(20 + c, "chunk %d folded" % c) for c in range(16)]
    for k, what in marks + [(2, "row folded")]:
        ts = [v[k] for v in C.values() if k in v]
        if ts:
            print("combine %s: %.2f-%.2f us (%d blocks)" % (what, (min(ts) - t0) / 1000.0, (max(ts) - t0) / 1000.0,
                                                         len(ts)))


if __name__ == "__main__":
    main()
