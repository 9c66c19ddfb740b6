#!/bin/bash
# On the GPU machine: detattn-step-bench through detattnd --backend cuda for every data plane
# next to PyTorch SDPA in-process (flash, cuDNN) on the same decode shapes, and prefill through
# the daemon next to the prefill kernel alone (detattn-bench), in one run; prints the ratio
# table with issue 8's targets: per-layer decode call <= 1.5x cuDNN at B >= 8, L >= 4k and
# <= 1.5x + 20 us at B = 1; prefill through the daemon >= 85 % (cuda) / 50 % (shm) of the
# kernel alone; p99 <= 2x p50. Model: 4 layers, 32 q / 8 kv heads, d 128, bf16, S 512.
# The copy plane runs the smaller shapes only (its prefill moves ~5k tokens/s: minutes at B 64).
# Usage: bash clients/stepbench/gpu_stepbench.sh [BUILD_DIR]   (carry .devdeps; logs in $OUT)
# Environment: PLANES (default "copy shm cuda"), BS (default "1 8 64"), LS (default
# "1024 4096 16384"), EXTRA_DAEMON_FLAGS, EXTRA_BENCH_FLAGS (e.g. a doorbell option).
set -u
build=${1:-build-gpu}
OUT=${OUT:-/tmp/detattn-gpu}
PLANES=${PLANES:-copy shm cuda}
BS=${BS:-1 8 64}
LS=${LS:-1024 4096 16384}
mkdir -p "$OUT"
if [ ! -x "$build/bin/detattnd" ]; then
  eval "$(bash .devdeps/unpack.sh)"
  sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  cmake -S . -B "$build" -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    > "$OUT/configure.log" 2>&1
fi
cmake --build "$build" --target detattnd detattn_step_bench detattn-bench -j16 > "$OUT/build-stepbench.log" 2>&1 ||
  { tail -20 "$OUT/build-stepbench.log"; exit 1; }
dir=$(mktemp -d)
# shellcheck disable=SC2086
"$build/bin/detattnd" --listen "ipc://$dir/d.sock" --backend cuda --layers 4 --q-heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16 --kv-tokens 1200000 --max-seq-tokens 32768 --split-tokens 512 \
  --max-arena-bytes 8589934592 ${EXTRA_DAEMON_FLAGS:-} 2> "$OUT/stepbench-daemon.log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do grep -q "listening on" "$OUT/stepbench-daemon.log" && break; sleep 0.1; done
echo "plane,B,L,call_p50_us,call_p99_us,step_p50_ms,prefill_tok_s" > "$OUT/stepbench.csv"
for B in $BS; do
  for L in $LS; do
    for plane in $PLANES; do
      [ "$plane" = copy ] && { [ "$B" -gt 8 ] || [ "$L" -gt 4096 ]; } && continue
      # shellcheck disable=SC2086
      timeout 240 "$build/bin/detattn-step-bench" --url "ipc://$dir/d.sock" --batch $B --context $L --steps 40 \
        --warmup 5 --prefill-chunk 2048 --data-plane $plane ${EXTRA_BENCH_FLAGS:-} \
        --json "$OUT/sb-$plane-$B-$L.json" > /dev/null 2>> "$OUT/stepbench.err" ||
        { echo "# $plane B $B L $L failed" >> "$OUT/stepbench.csv"; continue; }
      python3 -c "import json,sys; j=json.load(open('$OUT/sb-$plane-$B-$L.json')); print(','.join(str(x) for x in ['$plane',$B,$L,round(j['layer_call_us_p50'],1),round(j['layer_call_us_p99'],1),round(j['step_ms_p50'],3),round(j['prefill_tokens_per_s'])]))" >> "$OUT/stepbench.csv"
    done
  done
done
kill $pid 2> /dev/null
wait $pid 2> /dev/null
# The prefill kernel alone on the same work: B sequences of L tokens, causal, one layer.
echo "kind,B,L,Hq,Hkv,d,causal,mode,S,ms,attn_ms,combine_ms,kv_tbs,tflops,lat_ms,timing" > "$OUT/kernel.csv"
for B in $BS; do
  for L in $LS; do
    [ $((B * L)) -gt 262144 ] && continue # the bench stages all tokens at once
    "$build/bin/detattn-bench" --backend cuda --one-prefill "$B" "$L" 2>> "$OUT/kernel.err" |
      grep '^prefill' >> "$OUT/kernel.csv"
  done
done
python3 clients/stepbench/sdpa_layer_peer.py > "$OUT/sdpa.csv" 2> "$OUT/sdpa.err"
python3 - "$OUT" <<'PY'
import csv, sys
out = sys.argv[1]
sb = [r for r in csv.reader(open(out + "/stepbench.csv")) if r and not r[0].startswith("#")][1:]
peer = {}
for r in csv.reader(open(out + "/sdpa.csv")):
    if r and r[0] in ("flash", "cudnn"):
        peer[(r[0], int(r[1]), int(r[2]))] = float(r[3])
kern = {}
for r in csv.DictReader(open(out + "/kernel.csv")):
    kern[(int(r["B"]), int(r["L"]))] = int(r["B"]) * int(r["L"]) / (4 * float(r["ms"]) / 1e3)  # 4 layers
print("| B | L | plane | layer call p50 us | p99 us | p99/p50 | cuDNN us | flash us | x cuDNN | decode target | prefill tok/s | kernel alone tok/s | prefill share |")
print("|--:|--:|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|")
for plane, B, L, p50, p99, step, pre in sb:
    B, L, p50, p99, pre = int(B), int(L), float(p50), float(p99), float(pre)
    cu, fl = peer.get(("cudnn", B, L)), peer.get(("flash", B, L))
    ratio = p50 / cu if cu else float("nan")
    target = (p50 <= 1.5 * cu + 20) if (B == 1 and cu) else (p50 <= 1.5 * cu) if (cu and B >= 8 and L >= 4096) else None
    t = "-" if target is None else ("met" if target else "missed")
    k = kern.get((B, L))
    share = f"{100 * pre / k:.0f} %" if k else "-"
    print(f"| {B} | {L} | {plane} | {p50:.1f} | {p99:.1f} | {p99 / p50:.1f} | {cu or float('nan'):.1f} | {fl or float('nan'):.1f} | {ratio:.2f} | {t} | {int(pre)} | {int(k) if k else '-'} | {share} |")
PY
