#!/bin/bash
# doorbell_bench.sh — the same-host doorbell against nng on one CPU daemon (the README's
# "IPC overhead" model): detattn-ipc-bench (1-token Forward over nng, over the doorbell, and a
# bare nng ping of the nng Forward's sizes, taking turns) and detattn-step-bench layer calls
# (shm plane, doorbell off and on, alternating), RUNS times each; prints every run and the
# medians as a markdown table.
# usage: clients/ipcbench/doorbell_bench.sh BUILD_DIR [RUNS] [extra detattnd flags...]
set -u
B=${1:?usage: doorbell_bench.sh BUILD_DIR [RUNS] [detattnd flags...]}
RUNS=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
D=$(mktemp -d /tmp/detattn-doorbell.XXXXXX)
URL=ipc://$D/d.sock
"$B/bin/detattnd" --listen "$URL" --backend cpu --layers 4 --q-heads 8 --kv-heads 2 --head-dim 128 \
  --split-tokens 256 --threads 2 --kv-tokens 65536 "$@" 2>"$D/d.log" &
P=$!
for _ in $(seq 1 50); do grep -q listening "$D/d.log" && break; sleep 0.2; done
for r in $(seq 1 "$RUNS"); do
  "$B/bin/detattn-ipc-bench" --url "$URL" --seconds 5 --rounds 10 --json >"$D/ipc$r.json"
  for bl in "1 64" "8 1024"; do
    set -- $bl
    for bell in off on; do
      "$B/bin/detattn-step-bench" --url "$URL" --batch "$1" --context "$2" --steps 200 --warmup 10 \
        --data-plane shm --doorbell $bell --json "$D/step-$1-$2-$bell-$r.json" >/dev/null
    done
  done
done
kill -TERM $P
wait $P
python3 - "$D" "$RUNS" <<'PY'
import json, statistics as st, sys
d, runs = sys.argv[1], int(sys.argv[2])
ipc = [json.load(open(f"{d}/ipc{r}.json")) for r in range(1, runs + 1)]
for r, x in enumerate(ipc, 1):
    print(f"run {r}: ipc-bench p50/p99 us: nng {x['forward']['p50_us']:.1f}/{x['forward']['p99_us']:.1f}, "
          f"doorbell {x['forward_doorbell']['p50_us']:.1f}/{x['forward_doorbell']['p99_us']:.1f}, "
          f"ping {x['ping']['p50_us']:.1f}/{x['ping']['p99_us']:.1f}")
med = lambda k, s: st.median(x[k][s] for x in ipc)
print(f"\n| detattn-ipc-bench (median of {runs}) | p50 us | p99 us |")
print("|---|--:|--:|")
for k, name in (("forward", "Forward 1 token, nng"), ("forward_doorbell", "Forward 1 token, doorbell"),
                ("ping", f"bare nng ping, {ipc[0]['request_bytes']:.0f} B / {ipc[0]['reply_bytes']:.0f} B")):
    print(f"| {name} | {med(k, 'p50_us'):.1f} | {med(k, 'p99_us'):.1f} |")
print(f"\n| detattn-step-bench, shm (median of {runs}) | doorbell | layer call p50 us | p99 us | step p50 ms | decode tok/s |")
print("|---|---|--:|--:|--:|--:|")
for b, l in ((1, 64), (8, 1024)):
    for bell in ("off", "on"):
        xs = [json.load(open(f"{d}/step-{b}-{l}-{bell}-{r}.json")) for r in range(1, runs + 1)]
        assert all(x["doorbell"] == (bell == "on") for x in xs)
        m = lambda k: st.median(x[k] for x in xs)
        print(f"| --batch {b} --context {l} | {bell} | {m('layer_call_us_p50'):.1f} | {m('layer_call_us_p99'):.1f} | "
              f"{m('step_ms_p50'):.3f} | {m('decode_tokens_per_s'):.0f} |")
PY
rm -rf "$D"
