#!/bin/bash
# On the GPU machine: detattn-step-bench through detattnd --backend cuda for every data plane
# next to PyTorch SDPA in-process (flash, cuDNN) on the same decode shapes, in one run, and
# the ratio table (issue 8's targets: per-layer call <= 1.5x cuDNN at B >= 8, L >= 4k;
# <= 1.5x + 20 us at B = 1). Model: 4 layers, 32 q / 8 kv heads, d 128, bf16, S 512.
# Usage: bash clients/stepbench/gpu_stepbench.sh [BUILD_DIR]   (carry .devdeps; logs in $OUT)
set -u
build=${1:-build-gpu}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
if [ ! -x "$build/bin/detattnd" ]; then
  eval "$(bash .devdeps/unpack.sh)"
  sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  cmake -S . -B "$build" -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    > "$OUT/configure.log" 2>&1
fi
cmake --build "$build" --target detattnd detattn_step_bench -j16 > "$OUT/build-stepbench.log" 2>&1 ||
  { tail -20 "$OUT/build-stepbench.log"; exit 1; }
dir=$(mktemp -d)
"$build/bin/detattnd" --listen "ipc://$dir/d.sock" --backend cuda --layers 4 --q-heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16 --kv-tokens 1200000 --max-seq-tokens 32768 --split-tokens 512 \
  --max-arena-bytes 8589934592 2> "$OUT/stepbench-daemon.log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do grep -q "listening on" "$OUT/stepbench-daemon.log" && break; sleep 0.1; done
echo "plane,B,L,call_p50_us,call_p99_us,step_p50_ms,prefill_tok_s" > "$OUT/stepbench.csv"
for B in 1 8 64; do
  for L in 1024 4096 16384; do
    for plane in copy shm; do
      timeout 240 "$build/bin/detattn-step-bench" --url "ipc://$dir/d.sock" --batch $B --context $L --steps 30 \
        --warmup 5 --prefill-chunk 2048 --data-plane $plane --json "$OUT/sb-$plane-$B-$L.json" > /dev/null 2>> "$OUT/stepbench.err" ||
        { echo "# $plane B $B L $L failed" >> "$OUT/stepbench.csv"; continue; }
      python3 -c "import json,sys; j=json.load(open('$OUT/sb-$plane-$B-$L.json')); print(','.join(str(x) for x in ['$plane',$B,$L,round(j['layer_call_us_p50'],1),round(j['layer_call_us_p99'],1),round(j['step_ms_p50'],3),round(j['prefill_tokens_per_s'])]))" >> "$OUT/stepbench.csv"
    done
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
print("| B | L | plane | layer call p50 us | p99 us | cuDNN us | flash us | x cuDNN | target | prefill tok/s |")
print("|--:|--:|---|--:|--:|--:|--:|--:|---|--:|")
for plane, B, L, p50, p99, step, pre in sb:
    B, L, p50, p99 = int(B), int(L), float(p50), float(p99)
    cu, fl = peer.get(("cudnn", B, L)), peer.get(("flash", B, L))
    ratio = p50 / cu if cu else float("nan")
    target = (p50 <= 1.5 * cu + 20) if B == 1 else (p50 <= 1.5 * cu) if (B >= 8 and L >= 4096) else None
    t = "-" if target is None or cu is None else ("met" if target else "missed")
    print(f"| {B} | {L} | {plane} | {p50:.1f} | {p99:.1f} | {cu or float('nan'):.1f} | {fl or float('nan'):.1f} | {ratio:.1f} | {t} | {int(pre)} |")
PY
