#!/bin/bash
# On the GPU machine (run tool): configure a CUDA build, build the daemon, the CLI and the
# GPU test programs, and run every gpu-labelled ctest (cuda_async, cuda_backend,
# cuda_daemon_verify, then cuda_memcheck); bench: run() against submit/finish
# (bench_backend_async). Logs under $OUT; a short summary last.
# Usage: bash tests/cuda/run_gpu_daemon.sh [tests|bench|all] [ctest -R pattern]
set -u
what=${1:-tests}
pattern=${2:-}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
eval "$(bash .devdeps/unpack.sh)"
# Some .pc files name /usr paths directly; point them at the unpacked tree too.
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
rm -f build-gpu-daemon/CMakeCache.txt
cmake -S . -B build-gpu-daemon -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
t0=$(date +%s.%N)
cmake --build build-gpu-daemon --target detattnd detattn_cli test_cuda test_backend_async bench_backend_async -j16 > "$OUT/build.log" 2>&1 ||
  { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
t1=$(date +%s.%N)
echo "build detattnd detattn_cli test_cuda test_backend_async bench_backend_async (16 jobs): $(python3 -c "print(round($t1 - $t0, 1))") s" | tee "$OUT/summary.txt"
rc=0
if [ "$what" = bench ] || [ "$what" = all ]; then
  build-gpu-daemon/bin/bench_backend_async cuda 2>&1 | tee "$OUT/bench_async.md" || rc=1
fi
[ "$what" = bench ] && exit $rc
# memcheck last: it is the slow one.
args=(-L gpu -V)
[ -n "$pattern" ] && args+=(-R "$pattern")
ctest --test-dir build-gpu-daemon "${args[@]}" -E cuda_memcheck > "$OUT/ctest.log" 2>&1 || rc=1
if [ -z "$pattern" ]; then
  ctest --test-dir build-gpu-daemon -L gpu -V -R cuda_memcheck >> "$OUT/ctest.log" 2>&1 || rc=1
fi
grep -E "tests passed|Test +#|Failed|Skipped|Checks|seed|verify:|PASS|FAIL|outputs_compared|accuracy cfg" \
  "$OUT/ctest.log" | tail -30 | tee -a "$OUT/summary.txt"
[ $rc -ne 0 ] && grep -E "test_cuda.c:[0-9]+|ERROR|Invalid|error|FAIL" "$OUT/ctest.log" | head -30
exit $rc
