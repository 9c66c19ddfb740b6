#!/bin/bash
# On the GPU machine: does a client hide the daemon round trip with two micro-batches?
# detattn-step-bench (shm plane) through detattnd --backend cuda, same model as
# gpu_stepbench.sh, with --micro-batches 1 and 2 at several simulated MLP times per layer.
# Usage: bash clients/stepbench/gpu_overlap.sh [BUILD_DIR]   (carry .devdeps; logs in $OUT;
# PLANE=shm|cuda, default shm)
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
cmake --build "$build" --target detattnd detattn_step_bench -j16 > "$OUT/build-overlap.log" 2>&1 ||
  { tail -20 "$OUT/build-overlap.log"; exit 1; }
dir=$(mktemp -d)
"$build/bin/detattnd" --listen "ipc://$dir/d.sock" --backend cuda --layers 4 --q-heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16 --kv-tokens 1200000 --max-seq-tokens 32768 --split-tokens 512 \
  --max-arena-bytes 8589934592 2> "$OUT/overlap-daemon.log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do grep -q "listening on" "$OUT/overlap-daemon.log" && break; sleep 0.1; done
echo "| B | L | MLP us/layer | micro-batches | layer call p50 us | step p50 ms | decode tokens/s |"
echo "|--:|--:|--:|--:|--:|--:|--:|"
for B in 8 64; do
  for mlp in 0 300 1000; do
    for m in 1 2; do
      f="$OUT/ov-$B-$mlp-$m.json"
      timeout 200 "$build/bin/detattn-step-bench" --url "ipc://$dir/d.sock" --batch $B --context 4096 --steps 40 \
        --warmup 5 --prefill-chunk 2048 --data-plane "${PLANE:-shm}" --micro-batches $m --mlp-us $mlp --json "$f" \
        > /dev/null 2>> "$OUT/overlap.err" || { echo "| $B | 4096 | $mlp | $m | failed | | |"; continue; }
      python3 -c "import json; j=json.load(open('$f')); print('| $B | 4096 | $mlp | $m | %.0f | %.3f | %.0f |' % (j['layer_call_us_p50'], j['step_ms_p50'], j['decode_tokens_per_s']))"
    done
  done
done
