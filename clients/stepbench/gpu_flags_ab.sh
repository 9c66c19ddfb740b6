#!/bin/bash
# The daemon's decode layer call under several sets of daemon flags of one build, alternating
# in one device call (NOTES.md v5.27's calls 5-7 were done this way by hand): for each "B:L"
# of SHAPES and each client busy time of MLPS (the step bench's --mlp-us between layer
# calls), gpu_breakdown.sh runs once with each variant's flags in order and then once in the
# reverse order (a b b a), ROUNDS times, so drift over the call hits every variant. Prints
# gpu_breakdown.sh's row for each run, then the layer call p50s of each variant side by side.
# Usage: VARIANTS="old=--doorbell-spin-max-us 0;new=--doorbell-spin-max-us -1" \
#          bash clients/stepbench/gpu_flags_ab.sh [BUILD_DIR]   (on the GPU machine; $OUT)
# Environment: VARIANTS (required; "name=daemon flags;..."), SHAPES ("1:1024 8:4096 32:4096"),
# MLPS ("0 400"), ROUNDS (1), PLANES (cuda), and what gpu_breakdown.sh takes (BACKEND, STEPS,
# EXTRA_BENCH_FLAGS: added to --mlp-us). BUILD_DIR (build-gpu) without detattnd is configured
# and built for sm_90 from .devdeps first (carry .devdeps). With DA_CUDA_TIMING=1 the daemons
# time their batches' phases (cuda_backend.c) and each run's decode-batch line follows the
# table; every run's decode Forwards' phases in the daemon (--phase-timing) are printed too. A variant's flags that begin with @DIR run DIR/bin/detattnd (another build, e.g. of
# an older tree: `cd .ab-old && bash -c '. clients/stepbench/gpu_common.sh; step_bench_build
# build-gpu /tmp'`) with the rest of its flags, against this build's step bench.
set -u
build=${1:-build-gpu}
OUT=${OUT:-/tmp/detattn-gpu}
SHAPES=${SHAPES:-1:1024 8:4096 32:4096}
MLPS=${MLPS:-0 400}
ROUNDS=${ROUNDS:-1}
export PLANES=${PLANES:-cuda}
[ -n "${VARIANTS:-}" ] || { echo "VARIANTS is required, e.g. \"old=--doorbell-spin-max-us 0;new=\""; exit 2; }
mkdir -p "$OUT"
. clients/stepbench/gpu_common.sh
step_bench_build "$build" "$OUT" || exit 1
IFS=';' read -r -a variants <<< "$VARIANTS"
mapfile -t order < <(ab_order ${#variants[@]})
res="$OUT/flags_ab.txt"
: > "$res"
for shape in $SHAPES; do
  export B=${shape%%:*} L=${shape##*:}
  for mlp in $MLPS; do
    for ((r = 0; r < ROUNDS; r++)); do
      for ((pos = 0; pos < ${#order[@]}; pos++)); do
        k=${order[$pos]}
        name=${variants[$k]%%=*} flags=${variants[$k]#*=} daemon=$build/bin/detattnd
        if [ "${flags:0:1}" = @ ]; then
          read -r dir flags <<< "${flags:1}"
          daemon=$dir/bin/detattnd
        fi
        row=$(OUT="$OUT/run-$B-$L-$mlp-$name-$r-$pos" EXTRA_DAEMON_FLAGS="$flags" DETATTND="$daemon" \
          EXTRA_BENCH_FLAGS="--mlp-us $mlp ${EXTRA_BENCH_FLAGS:-}" bash clients/stepbench/gpu_breakdown.sh "$build" | tail -1)
        echo "$B $L $mlp $name $row" | tee -a "$res"
      done
    done
  done
done
echo "layer call p50 us, in run order (B, L, client busy us between calls):"
python3 - "$res" "$VARIANTS" <<'PY'
import collections, sys
names = [v.split("=", 1)[0] for v in sys.argv[2].split(";")]
runs = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.split(None, 4)
    if len(f) < 5:
        continue
    cells = [c.strip() for c in f[4].split("|")]
    call = cells[4] if len(cells) > 4 else "-"  # | plane | B | L | layer call p50 | ...
    if not call.replace(".", "", 1).isdigit():
        call = "failed"  # gpu_breakdown.sh's row for a run whose step bench failed
    runs.setdefault((f[0], f[1], f[2]), collections.defaultdict(list))[f[3]].append(call)
print("| B | L | busy us | " + " | ".join(names) + " |")
print("|--:|--:|--:|" + "---|" * len(names))
for (b, l, m), by in runs.items():
    print("| %s | %s | %s | %s |" % (b, l, m, " | ".join(" / ".join(by[n]) or "-" for n in names)))
PY
# each_run TITLE PATTERN: TITLE, then each run's daemon log line matching PATTERN, its numbers
each_run() {
  echo "$1"
  for log in "$OUT"/run-*/breakdown-daemon-*.log; do
    [ -f "$log" ] || continue
    line=$(grep -h "$2" "$log" | sed 's/.*us p50 \/ p90: //')
    echo "$(basename "$(dirname "$log")"): ${line:-no such line}"
  done
}
each_run "decode Forwards' phases in the daemon a run (--phase-timing), us p50 / p90:" "phase timing"
if [ "${DA_CUDA_TIMING:-0}" = 1 ]; then
  each_run "decode batches' phases a run (DA_CUDA_TIMING), us p50 / p90:" "cuda timing, decode batches"
fi
