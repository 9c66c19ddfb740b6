#!/bin/bash
# On the GPU machine (run tool), in one call: build detattnd, the CLI, test_tp and bench_tp
# for sm_90; run the README's GPU example (ops_readme_gpu_example) and TP over two CUDA
# daemons on one device against one daemon, bitwise (tp_cuda_*); then bench_tp (one daemon
# vs TP over two on the same GPU, each mode's calls back to back, then interleaved). Logs
# under $OUT; a short summary last.
# Usage: bash tests/ops/run_gpu_ops.sh [all|bench] [bench iterations]
# TP_DEVICES=0,1: the ranks' devices (tp_cuda_* via DETATTN_TP_DEVICES, bench_tp --devices;
# the single daemon stays on device 0). Default: every daemon on device 0.
set -u
what=${1:-all}
iters=${2:-200}
OUT=${OUT:-/tmp/detattn-gpu-ops}
mkdir -p "$OUT"
if [ -f .devdeps/unpack.sh ]; then
  eval "$(bash .devdeps/unpack.sh)"
  sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
cmake -S . -B build-gpu-ops -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build-gpu-ops --target detattnd detattn_cli test_tp bench_tp -j16 > "$OUT/build.log" 2>&1 ||
  { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
rc=0
devs=""
if [ -n "${TP_DEVICES:-}" ]; then
  export DETATTN_TP_DEVICES=$TP_DEVICES
  devs="--devices 0,$TP_DEVICES"
fi
[ "$what" = bench ] || ctest --test-dir build-gpu-ops -L gpu -R "ops_readme_gpu_example|tp_cuda_" -V > "$OUT/ctest.log" 2>&1 || rc=1
grep -E "Test +#|tests passed|README example flags|staging|KV cache|device memory|rows compared|PASS|FAIL|Failed|skip" \
  "$OUT/ctest.log" | tail -30 | tee -a "$OUT/summary.txt"
for order in blocks interleaved; do
  build-gpu-ops/bin/bench_tp --backend cuda $devs --iters "$iters" --ctx 4096 --order $order > "$OUT/bench_tp_$order.md" \
    2> "$OUT/bench_tp.err" || rc=1
  tee -a "$OUT/summary.txt" < "$OUT/bench_tp_$order.md"
done
tail -5 "$OUT/bench_tp.err"
cat "$OUT/gpu.txt"
exit $rc
