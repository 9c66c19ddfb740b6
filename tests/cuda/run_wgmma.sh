#!/bin/bash
# On the GPU machine (sm_90, 16 cores): builds and runs the Hopper prefill work of issue 9 in
# one command, logs under $OUT, a short table last.
# Usage: bash tests/cuda/run_wgmma.sh [bits|test|bench|all|memcheck|profile]
#   bits      test_mma_bits: wgmma vs mma.sync fp32 bits (the question everything rests on)
#   test      test_wgmma (mma.sync vs both wgmma variants bit for bit, fp64 accuracy), then
#             the existing cuda_backend suite (test_cuda) twice: default, DA_CUDA_PREFILL=wgmma
#   bench     detattn-bench --prefill-only on mma.sync, wgmma-serial and wgmma, SDPA flash and
#             cuDNN, one table
#   all       bits, test, bench (under 5 minutes with the build)
#   memcheck  compute-sanitizer memcheck of test_wgmma's accuracy case
#   profile   ncu sections of one wgmma prefill launch (B 8 L 4k d 64)
# Every step runs under a timeout (a pipeline hang becomes a trap after 10 s in the kernel's
# barrier waits, and a timeout here), so one run always ends with the summary. Logs go to
# $LOGS; $OUT gets summary.txt, table.md, the two test outputs and logs.tgz (all logs).
set -u
what=${1:-all}
OUT=${OUT:-/tmp/detattn-wgmma}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/detattn-wgmma-logs.XXXXXX)
finish() {
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null
  for f in summary.txt table.md mma_bits.txt wgmma_test.txt; do [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"; done
}
trap finish EXIT
SUM="$LOGS/summary.txt"
: > "$SUM"
note() { echo "$*" | tee -a "$SUM"; }
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader > "$LOGS/gpu.txt" 2>&1
note "gpu: $(cat "$LOGS/gpu.txt")"
B=build-gpu
rm -f $B/CMakeCache.txt
cmake -S . -B $B -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
  > "$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log"; exit 1; }
grep "detattn: CUDA" "$LOGS/configure.log" | tee -a "$SUM"
tgts="da_cuda"
case $what in
  bits) tgts="test_mma_bits" ;;
  test|memcheck) tgts="test_wgmma test_cuda" ;;
  bench|profile) tgts="detattn-bench" ;;
  all) tgts="test_mma_bits test_wgmma test_cuda detattn-bench" ;;
esac
# Registers and spills of the sm_90a files, next to the build (another core).
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
( $NVCC -std=c++17 --fmad=false -O3 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -Ikernels/cuda -Ikernels \
    -Iplugin/include -c kernels/cuda/prefill_sm90.cu -o /dev/null > "$LOGS/ptxas.txt" 2>&1 ) &
t0=$(date +%s.%N)
cmake --build $B --target $tgts -j16 > "$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$LOGS/build.log" | head -40; exit 1; }
t1=$(date +%s.%N)
wait
note "build ($tgts, 16 jobs): $(python3 -c "print(round($t1 - $t0, 1))") s"
grep -E "Used|spill|C75" "$LOGS/ptxas.txt" | sed 's/ptxas info    : //' | sort | uniq -c | head -8 | tee -a "$SUM"
OBJ=$B/kernels/cuda/CMakeFiles/da_cuda_sm90a.dir/prefill_sm90.cu.o
if command -v cuobjdump > /dev/null && [ -f $OBJ ]; then
  cuobjdump -sass $OBJ > "$LOGS/prefill_sm90.sass" 2>&1
  note "sass prefill_sm90: $(grep -c HGMMA "$LOGS/prefill_sm90.sass") HGMMA, $(grep -c 'UTMALDG' "$LOGS/prefill_sm90.sass") UTMALDG, $(grep -cE 'LDL|STL' "$LOGS/prefill_sm90.sass") LDL/STL, $(grep -c 'USETMAXREG' "$LOGS/prefill_sm90.sass") USETMAXREG, $(grep -c 'HMMA' "$LOGS/prefill_sm90.sass") HMMA"
fi
rc=0
step() { # name timeout_s command...: runs, records status and seconds
  local name=$1 to=$2; shift 2
  local s0=$(date +%s.%N)
  timeout "$to" "$@" > "$LOGS/$name.txt" 2>&1
  local r=$?
  local dt=$(python3 -c "print(round($(date +%s.%N) - $s0, 1))")
  if [ $r -eq 0 ]; then note "$name: PASS ($dt s)"; else note "$name: FAIL rc=$r ($dt s; 124 = timeout)"; rc=1; fi
  return $r
}

if [ "$what" = bits ] || [ "$what" = all ]; then
  step mma_bits 150 $B/bin/test_mma_bits
  grep -vE "^    " "$LOGS/mma_bits.txt" | tail -45
  grep -E "^    " "$LOGS/mma_bits.txt" | head -12
fi
if [ "$what" = test ] || [ "$what" = all ]; then
  step wgmma_test 240 env CK_FORK=no $B/bin/test_wgmma
  grep -E "DIFFER|accuracy|Checks|seed|skipped|Error|error|failed" "$LOGS/wgmma_test.txt" | head -40
  grep -c " equal " "$LOGS/wgmma_test.txt" | sed 's/^/wgmma_test: comparisons equal: /' | tee -a "$SUM"
  step cuda_backend_default 180 env CK_FORK=no $B/bin/test_cuda
  grep -E "Checks|Error|error|failed" "$LOGS/cuda_backend_default.txt" | head -10
  step cuda_backend_wgmma 180 env CK_FORK=no DA_CUDA_PREFILL=wgmma $B/bin/test_cuda
  grep -E "Checks|Error|error|failed" "$LOGS/cuda_backend_wgmma.txt" | head -10
fi
if [ "$what" = memcheck ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  step memcheck 280 env CK_FORK=no CK_RUN_CASE=accuracy $SAN --tool memcheck --error-exitcode 1 $B/bin/test_wgmma
  grep -E "ERROR|Invalid|Checks|error" "$LOGS/memcheck.txt" | head -20
fi
if [ "$what" = profile ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  DA_CUDA_PREFILL=wgmma timeout 280 $NCU --kernel-name regex:prefill_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section InstructionStats \
    $B/bin/detattn-bench --backend cuda --quick --prefill-only > "$LOGS/ncu-wgmma.txt" 2>&1
  grep -vE "^==PROF==|^ +-+$" "$LOGS/ncu-wgmma.txt" | grep -E "[0-9]" | head -90
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  BENCH="$B/bin/detattn-bench --backend cuda --prefill-only"
  step bench_mma 150 $BENCH
  mv "$LOGS/bench_mma.txt" "$LOGS/bench_mma.log"
  grep -E "^kind|^prefill" "$LOGS/bench_mma.log" > "$LOGS/mma.csv"
  step bench_serial 150 env DA_CUDA_PREFILL=wgmma-serial $BENCH
  mv "$LOGS/bench_serial.txt" "$LOGS/bench_serial.log"
  grep -E "^kind|^prefill" "$LOGS/bench_serial.log" > "$LOGS/serial.csv"
  step bench_wgmma 150 env DA_CUDA_PREFILL=wgmma $BENCH
  mv "$LOGS/bench_wgmma.txt" "$LOGS/bench_wgmma.log"
  grep -E "^kind|^prefill" "$LOGS/bench_wgmma.log" > "$LOGS/wgmma.csv"
  grep -h "prefill path" "$LOGS"/bench_*.log | sed 's/.*prefill path/prefill path/' | sort | uniq -c | tee -a "$SUM"
  step peers 200 python3 clients/bench/sdpa_peer.py --prefill-only --csv "$LOGS/peers.csv"
  python3 tests/cuda/wgmma_table.py "$LOGS/mma.csv" "$LOGS/serial.csv" "$LOGS/wgmma.csv" "$LOGS/peers.csv" \
    > "$LOGS/table.md"
fi
echo "---- summary (logs: $OUT/logs.tgz) ----"
cat "$SUM"
[ -f "$LOGS/table.md" ] && cat "$LOGS/table.md"
exit $rc
