#!/bin/bash
# overhead_bench.sh — detattnd's per-request overhead with a tiny model (the CPU backend
# costs ~nothing): 3 runs each of detattn-ipc-bench (closed-loop 1-token Forward against a
# raw nng ping of the same sizes, same run) and detattn-load (16 sequences in flight over
# 4 connections), one daemon for all of them; prints the medians.
# usage: clients/ipcbench/overhead_bench.sh BUILD_DIR [LABEL]
set -u
B=${1:?usage: overhead_bench.sh BUILD_DIR [LABEL]}
L=${2:-run}
D=$(mktemp -d /tmp/detattn-overhead.XXXXXX)
URL=ipc://$D/d.sock
"$B/bin/detattnd" --listen "$URL" --backend cpu --threads 1 --layers 1 --q-heads 1 --kv-heads 1 \
  --head-dim 64 --kv-tokens 65536 2>"$D/d.log" &
P=$!
for _ in $(seq 1 30); do grep -q listening "$D/d.log" && break; sleep 0.2; done
for r in 1 2 3; do
  "$B/bin/detattn-ipc-bench" --url "$URL" --seconds 3 --json >"$D/ipc$r.json"
  "$B/bin/detattn-load" --url "$URL" --concurrency 16 --connections 4 --prompt 16 --output 64 \
    --duration 5 --quiet --json "$D/load$r.json" >/dev/null 2>&1
done
kill -INT $P
wait $P
python3 - "$D" "$L" <<'PY'
import json, statistics as st, sys
d, label = sys.argv[1], sys.argv[2]
ipc = [json.load(open(f"{d}/ipc{r}.json")) for r in (1, 2, 3)]
lo = [json.load(open(f"{d}/load{r}.json")) for r in (1, 2, 3)]
med = lambda k, s: st.median(x[k][s] for x in ipc)
print(f"| {label} | {med('forward','p50_us'):.1f} | {med('forward','p99_us'):.1f} | "
      f"{med('forward','req_per_s'):.0f} | {med('ping','p50_us'):.1f} | {med('ping','p99_us'):.1f} | "
      f"{med('ping','req_per_s'):.0f} | {st.median(x['forwards_per_s'] for x in lo):.0f} | "
      f"{sum(x['mismatches'] + x['forward_errors'] for x in lo)} |")
PY
rm -rf "$D"
