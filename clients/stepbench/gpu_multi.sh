#!/bin/bash
# Many serving clients on one daemon, under several daemon flag sets: for each N of NS, N
# detattn-step-bench processes decode at once (each its own sequences and seed, --mlp-us MLP
# of busy time between layer calls), against a fresh daemon per run; each variant's flags in
# order, then in reverse (a b b a), ROUNDS times. What a spinning loop or worker costs when
# every client computes between calls: the clients' layer call p50 and p99 (median and worst
# of the N), their decode tokens/s summed, the daemon's CPU time over the run's wall time, and from
# /metrics the worker's idle sleeps, the doorbell's eventfd wake-ups and the spins' late yields
# (loop / worker).
# Usage: VARIANTS="off=--doorbell-spin-max-us 0 --worker-spin-max-us 0;auto=" \
#          bash clients/stepbench/gpu_multi.sh [BUILD_DIR]   (on the GPU machine; $OUT)
# Environment: VARIANTS (required), NS ("1 4 8 16"), B (4), L (2048), MLP (400), STEPS (300),
# ROUNDS (1), PLANE (cuda), BACKEND (cuda). BUILD_DIR (build-gpu) without detattnd is built
# for sm_90 from .devdeps first (carry .devdeps), as gpu_flags_ab.sh does.
set -u
build=${1:-build-gpu}
OUT=${OUT:-/tmp/detattn-gpu}
NS=${NS:-1 4 8 16}
B=${B:-4}
L=${L:-2048}
MLP=${MLP:-400}
STEPS=${STEPS:-300}
ROUNDS=${ROUNDS:-1}
PLANE=${PLANE:-cuda}
[ -n "${VARIANTS:-}" ] || { echo "VARIANTS is required, e.g. \"off=--doorbell-spin-max-us 0;auto=\""; exit 2; }
mkdir -p "$OUT"
. clients/stepbench/gpu_common.sh
step_bench_build "$build" "$OUT" || exit 1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
IFS=';' read -r -a variants <<< "$VARIANTS"
mapfile -t order < <(ab_order ${#variants[@]})
res="$OUT/multi.txt"
: > "$res"
tick=$(getconf CLK_TCK)
for n in $NS; do
  for ((r = 0; r < ROUNDS; r++)); do
    for ((pos = 0; pos < ${#order[@]}; pos++)); do
      k=${order[$pos]}
      name=${variants[$k]%%=*} flags=${variants[$k]#*=}
      run="$OUT/run-$n-$name-$r-$pos"
      mkdir -p "$run"
      : > "$run/daemon.log"
      # shellcheck disable=SC2086
      "$build/bin/detattnd" --listen "ipc://$dir/d.sock" --backend "${BACKEND:-cuda}" --layers 4 --q-heads 32 \
        --kv-heads 8 --head-dim 128 --dtype bf16 --kv-tokens "$(kv_tokens "$n" "$B" "$L" $((STEPS + 20)))" \
        --split-tokens 512 --max-conn-per-peer 1000 --http-listen http://127.0.0.1:9478 $flags 2> "$run/daemon.log" &
      pid=$!
      for _ in $(seq 600); do grep -q "listening on" "$run/daemon.log" && break; sleep 0.1; done
      kill -0 "$pid" 2> /dev/null || { echo "detattnd exited:"; tail -5 "$run/daemon.log"; exit 1; }
      cpu0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
      t0=$(date +%s.%N)
      pids=()
      for ((i = 0; i < n; i++)); do
        "$build/bin/detattn-step-bench" --url "ipc://$dir/d.sock" --batch "$B" --context "$L" --steps "$STEPS" \
          --warmup 20 --prefill-chunk 2048 --data-plane "$PLANE" --mlp-us "$MLP" --seed $((i + 1)) \
          --json "$run/client-$i.json" > /dev/null 2>> "$run/clients.err" &
        pids+=($!)
      done
      wait "${pids[@]}"
      t1=$(date +%s.%N)
      cpu1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
      python3 -c "import urllib.request; open('$run/metrics.txt', 'wb').write(urllib.request.urlopen('http://127.0.0.1:9478/metrics').read())"
      kill "$pid"
      wait "$pid" 2> /dev/null
      row=$(python3 - "$run" "$n" "$cpu0" "$cpu1" "$tick" "$t0" "$t1" <<'PY'
import glob, json, re, sys
run, n, cpu0, cpu1, tick, t0, t1 = sys.argv[1:8]
js = [json.load(open(f)) for f in sorted(glob.glob(f"{run}/client-*.json"))]
if len(js) != int(n):
    print(f"| {len(js)} of {n} clients reported (see {run}/clients.err) |")
    sys.exit()
p50 = sorted(j["layer_call_us_p50"] for j in js)
p99 = sorted(j["layer_call_us_p99"] for j in js)
tps = sum(j["decode_tokens_per_s"] for j in js)
m = {}
for line in open(f"{run}/metrics.txt"):
    f = re.match(r"(detattn_worker_idle_sleeps_total|detattn_doorbell_wakeups_total|"
                 r'detattn_spin_late_yields_total\{thread="\w+"\}) (\S+)', line)
    if f:
        m[f.group(1)] = float(f.group(2))
late = "/".join("%.0f" % m.get('detattn_spin_late_yields_total{thread="%s"}' % t, float("nan")) for t in ("loop", "worker"))
cpu = (float(cpu1) - float(cpu0)) / float(tick) / (float(t1) - float(t0))
print(f"| {p50[len(p50) // 2]:.0f} | {p50[-1]:.0f} | {p99[len(p99) // 2]:.0f} | {p99[-1]:.0f} | {tps:.0f} | {cpu:.2f} | "
      f"{m.get('detattn_worker_idle_sleeps_total', float('nan')):.0f} | {m.get('detattn_doorbell_wakeups_total', float('nan')):.0f} | "
      f"{late} |")
PY
)
      echo "$n $name $row" | tee -a "$res"
    done
  done
done
echo "N clients (B $B, L $L, busy $MLP us between layer calls, $PLANE plane): layer call p50 us median / worst of" \
  "the clients, p99 us median / worst | decode tokens/s summed | daemon CPU s per s | worker idle sleeps | doorbell wake-ups | late yields" \
  "loop/worker"
python3 - "$res" "$VARIANTS" <<'PY'
import collections, sys
names = [v.split("=", 1)[0] for v in sys.argv[2].split(";")]
runs = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.split(None, 2)
    if len(f) == 3:
        runs.setdefault(f[0], collections.defaultdict(list))[f[1]].append(
            [c.strip() for c in f[2].strip().strip("|").split("|")])
print("| N | " + " | ".join(names) + " |")
print("|--:|" + "---|" * len(names))
for n, by in runs.items():
    cells = []
    for name in names:
        cells.append(" ; ".join("/".join(c[:2]) + " " + "/".join(c[2:4]) + " " + " ".join(c[4:])
                                for c in by.get(name, [])))
    print(f"| {n} | " + " | ".join(cells) + " |")
PY
