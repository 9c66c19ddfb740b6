#!/bin/bash
# On the GPU machine (run tool): builds detattnd (CUDA) and detattn-load, starts the daemon
# on an ipc:// socket in a temp dir, runs a closed-loop concurrency sweep and an A/B check
# (recorded alone, compared under load). Results under $OUT; a summary on stdout.
# Usage: bash clients/load/gpu_load.sh [sweep values, default 1,8,32,128] [seconds per point]
set -u
values=${1:-1,8,32,128}
secs=${2:-20}
OUT=${OUT:-/tmp/detattn-load-gpu}
mkdir -p "$OUT"
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
cmake -S . -B build-gpu-load -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="${GPU_LOAD_CFLAGS:-}" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cmake --build build-gpu-load --target detattnd detattn-load -j16 >> "$OUT/build.log" 2>&1 ||
  { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
dir=$(mktemp -d)
url="ipc://$dir/d.sock"
model=(--layers 8 --q-heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --page-tokens 16
       --kv-tokens 1048576 --split-tokens 512 --staging-mib 1024)
build-gpu-load/bin/detattnd --listen "$url" --backend cuda "${model[@]}" 2> "$OUT/detattnd.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 300); do
  grep -q "listening on" "$OUT/detattnd.log" && break
  kill -0 $pid 2>/dev/null || { cat "$OUT/detattnd.log"; exit 1; }
  sleep 0.1
done
L=build-gpu-load/bin/detattn-load
W=(--prompt 128:2048 --output 32:256 --prefill-chunk 512 --seed 3)
echo "model: ${model[*]}; workload: ${W[*]}" | tee -a "$OUT/summary.txt"
$L --url "$url" --quiet "${W[@]}" --sweep "concurrency=$values" --duration "$secs" --warmup 3 \
  --connections 4 --sweep-out "$OUT/sweep" --json "$OUT/sweep.json" | tee -a "$OUT/summary.txt"
# A/B: 48 sequences recorded alone, then compared at concurrency 48 with other chunking.
$L --url "$url" --quiet "${W[@]}" --requests 48 --concurrency 1 --record "$dir/base.rec" \
  > "$OUT/ab_record.txt"
$L --url "$url" --quiet --prompt 128:2048 --output 32:256 --prefill-chunk 200 --seed 3 \
  --requests 48 --concurrency 48 --connections 4 --compare "$dir/base.rec" --verify \
  --json "$OUT/ab.json" > "$OUT/ab_compare.txt"
echo "A/B exit status $?" | tee -a "$OUT/summary.txt"
tail -4 "$OUT/ab_compare.txt" | tee -a "$OUT/summary.txt"
grep -E "forward \(us\)|decode|prefill|ttft|tpot|throughput" "$OUT/ab_compare.txt" | tee -a "$OUT/summary.txt"
