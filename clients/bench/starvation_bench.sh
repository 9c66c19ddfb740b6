#!/bin/bash
# Decode under prefill floods (issue 12, defect 7): a victim decodes at context 256 on one
# connection, alone and then next to FLOODS client processes (default 3), each sending
# 4096-token prefills from 16 sequences over 4 connections; prints the victim's decode
# latency and rate for both and the p99 ratio (goal <= 2x). Bounded in time (about 40 s);
# a CPU daemon on an ipc socket in a temporary directory.
# Usage: clients/bench/starvation_bench.sh [BUILD_DIR] [extra detattnd flags...]
# Environment: FLOODS (flood processes), JSON_OUT (copy the three reports there).
set -euo pipefail
build=${1:-build}
shift || true
bin=$build/bin
floods=${FLOODS:-3}
dir=$(mktemp -d)
url="ipc://$dir/d.sock"
"$bin/detattnd" --listen "$url" --backend cpu --layers 4 --q-heads 8 --kv-heads 2 --head-dim 128 \
  --split-tokens 256 --kv-tokens 1048576 --max-seq-tokens 65536 --max-seqs 4096 "$@" 2> "$dir/log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do grep -q "listening on" "$dir/log" && break; sleep 0.1; done
victim() { # $1: json path
  "$bin/detattn-load" --url "$url" --concurrency 1 --prompt 256 --output 200 --duration 8 --seed 7 \
    --timeout-ms 120000 --quiet --json "$1" > /dev/null
}
victim "$dir/alone.json"
fpids=()
for i in $(seq "$floods"); do
  "$bin/detattn-load" --url "$url" --concurrency 16 --connections 4 --prompt 4096 --output 1 --duration 12 \
    --seed $((100 + i)) --timeout-ms 300000 --quiet --json "$dir/flood$i.json" > /dev/null &
  fpids+=($!)
done
sleep 2
victim "$dir/flooded.json"
for p in "${fpids[@]}"; do wait "$p" || true; done
[ -n "${JSON_OUT:-}" ] && cp "$dir"/*.json "$JSON_OUT"/
/usr/bin/python3 - "$dir" "$floods" <<'PY'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
rows = [("alone", json.load(open(d + "/alone.json"))),
        ("next to %d flood processes" % n, json.load(open(d + "/flooded.json")))]
print("| victim decode (context 256) | calls | steps/s | p50 ms | p99 ms | p99.9 ms | max ms |")
print("|---|--:|--:|--:|--:|--:|--:|")
for name, r in rows:
    h = r["decode_latency_us"]
    print("| %s | %d | %.0f | %.2f | %.2f | %.2f | %.1f |" % (name, h["count"], h["count"] / r["elapsed_s"],
          h["p50"] / 1e3, h["p99"] / 1e3, h["p999"] / 1e3, h["max"] / 1e3))
tok = sum(json.load(open(d + "/flood%d.json" % i))["tokens_per_s"] for i in range(1, n + 1))
a, f = rows[0][1]["decode_latency_us"], rows[1][1]["decode_latency_us"]
print("p99 flooded/alone: %.1fx (goal <= 2x); flood throughput %.0f prefill tokens/s" % (f["p99"] / a["p99"], tok))
PY
