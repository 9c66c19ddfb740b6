#!/bin/bash
# Where a per-layer decode call's microseconds go, per data plane: detattn-step-bench's layer
# call (client side: the whole call, and the part spent building and sending it) next to the
# daemon's own view from /metrics (receipt to reply of a Forward, admission to its batch,
# the batch in the backend and of that the backend's submit: host staging and launches, and
# for the cuda plane the wait for the client's ready event).
# What neither side sees is the transport: nng (or the doorbell) and thread wake-ups.
# Usage: bash clients/stepbench/gpu_breakdown.sh [BUILD_DIR]   (on the GPU machine; $OUT)
# Environment: B (1), L (1024), PLANES ("shm cuda"), STEPS (200), BACKEND (cuda), EXTRA_DAEMON_FLAGS,
# DETATTND (the daemon binary; BUILD_DIR/bin/detattnd), EXTRA_BENCH_FLAGS, and any DETATTN_*
# variable for the client.
set -u
build=${1:-build-gpu}
OUT=${OUT:-/tmp/detattn-gpu}
B=${B:-1}
L=${L:-1024}
PLANES=${PLANES:-shm cuda}
STEPS=${STEPS:-200}
mkdir -p "$OUT"
. clients/stepbench/gpu_common.sh
kv=$(kv_tokens 1 "$B" "$L" $((STEPS + 20)))
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf "| plane | B | L | layer call p50 us | of it sending | daemon receipt to reply | queue | batch run | of it submit | event wait | transport and wake-ups |\n"
printf "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"
for plane in $PLANES; do
  log="$OUT/breakdown-daemon-$plane.log"
  : > "$log" # exists before the wait below greps it
  # shellcheck disable=SC2086
  # --phase-timing by its environment variable (a daemon too old to know it ignores it): the
  # decode Forwards' phases go to the log at exit
  DETATTND_PHASE_TIMING=${DETATTND_PHASE_TIMING:-1} "${DETATTND:-$build/bin/detattnd}" --listen "ipc://$dir/d.sock" --backend "${BACKEND:-cuda}" --layers 4 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --dtype bf16 --kv-tokens "$kv" --split-tokens 512 --http-listen http://127.0.0.1:9477 \
    ${EXTRA_DAEMON_FLAGS:-} 2> "$log" &
  pid=$!
  for _ in $(seq 600); do grep -q "listening on" "$log" && break; sleep 0.1; done
  # shellcheck disable=SC2086
  "$build/bin/detattn-step-bench" --url "ipc://$dir/d.sock" --batch "$B" --context "$L" --steps "$STEPS" \
    --warmup 20 --prefill-chunk 2048 --data-plane "$plane" ${EXTRA_BENCH_FLAGS:-} \
    --json "$OUT/breakdown-$plane.json" > /dev/null 2>> "$OUT/breakdown.err" ||
    { echo "| $plane | $B | $L | the step bench failed: $(tail -1 "$OUT/breakdown.err" | cut -c1-160) |"
      kill "$pid"; wait "$pid" 2> /dev/null; continue; }
  python3 -c "import urllib.request; open('$OUT/metrics-$plane.txt', 'wb').write(urllib.request.urlopen('http://127.0.0.1:9477/metrics').read())"
  kill "$pid"
  wait "$pid" 2> /dev/null
  python3 - "$OUT" "$plane" "$B" "$L" <<'PY'
import json, re, sys
out, plane, B, L = sys.argv[1:5]
j = json.load(open(f"{out}/breakdown-{plane}.json"))
buckets = {}
for line in open(f"{out}/metrics-{plane}.txt"):
    m = re.match(r'(detattn_\w+)_bucket\{(.*?)le="([^"]+)"\} (\S+)', line)
    if m:
        name = m.group(1) + ("{" + m.group(2).rstrip(",") + "}" if m.group(2) else "")
        buckets.setdefault(name, []).append((float("inf") if m.group(3) == "+Inf" else float(m.group(3)), float(m.group(4))))
def p50(name):
    b = sorted(buckets.get(name, []))
    if not b or b[-1][1] == 0:
        return None
    half, lo, prev = b[-1][1] / 2, 0.0, 0.0
    for le, c in b:  # linear inside the bucket holding the median
        if c >= half:
            return 1e6 * (lo + (le - lo) * (half - prev) / (c - prev) if c > prev and le != float("inf") else lo)
        lo, prev = le, c
fw = p50('detattn_request_duration_seconds{op="forward"}')
q, run, ev = p50("detattn_queue_seconds"), p50("detattn_batch_run_seconds"), p50("detattn_cuda_event_wait_seconds")
sub = p50("detattn_batch_submit_seconds")
call = j["layer_call_us_p50"]
f = lambda x: "-" if x is None else f"{x:.0f}"
print(f"| {plane} | {B} | {L} | {call:.0f} | {f(j.get('call_start_us_p50'))} | {f(fw)} | {f(q)} | {f(run)} | {f(sub)} | {f(ev)} | {f(call - fw if fw else None)} |")
PY
done
