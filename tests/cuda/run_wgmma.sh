#!/bin/bash
# On the GPU machine (sm_90, 16 cores): builds and runs the Hopper prefill work of issue 9 in
# one command, logs under $OUT, a short table last.
# Usage: bash tests/cuda/run_wgmma.sh [bits|test|bench|all|memcheck|profile]
#   bits      test_mma_bits: wgmma vs mma.sync fp32 bits (the question everything rests on)
#   test      test_wgmma (mma.sync vs the three wgmma variants bit for bit, fp64 accuracy),
#             then the cuda_backend suite (test_cuda) with the default prefill path (wgmma on
#             sm_90 for d 64/128 since kernel version 3), with DA_CUDA_PREFILL=mma and with
#             DA_CUDA_PREFILL=wgmma-pingpong
#   bench     detattn-bench --prefill-only on mma.sync and the wgmma variants serial,
#             pipelined, pingpong (persistent grids) and pipelined with one CTA per item;
#             SDPA flash and cuDNN; one table
#   all       bits, test, bench, then a short ncu profile of the default variant (under 5
#             minutes with the build)
#   memcheck  compute-sanitizer memcheck of test_wgmma's accuracy case
#   profile   ncu sections of one prefill launch per wgmma variant (B 8 L 4k d 64)
# Every step runs under a timeout (a pipeline hang becomes an illegal-address fault after 10 s
# in the kernel's barrier waits, and a timeout here), so one run always ends with the summary.
# Logs go to $LOGS; $OUT gets summary.txt, table.md, sass.txt, the two test outputs and
# logs.tgz (all logs).
set -u
what=${1:-all}
OUT=${OUT:-/tmp/detattn-wgmma}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/detattn-wgmma-logs.XXXXXX)
finish() {
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null
  for f in summary.txt table.md sass.txt mma_bits.txt wgmma_test.txt ncu-summary.txt; do
    [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"
  done
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
# Registers, spills and every ptxas C75xx performance note (C7511/C7514/C7515/C7517/C7518/
# C7519: a serialized or force-waited wgmma pipeline) of the sm_90a files, next to the build.
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
( $NVCC -std=c++17 --fmad=false -O3 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -Ikernels/cuda -Ikernels \
    -Iplugin/include -c kernels/cuda/prefill_sm90.cu -o /dev/null > "$LOGS/ptxas.txt" 2>&1 ) &
t0=$(date +%s.%N)
cmake --build $B --target $tgts -j16 > "$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$LOGS/build.log" | head -40; exit 1; }
t1=$(date +%s.%N)
wait
note "build ($tgts, 16 jobs): $(python3 -c "print(round($t1 - $t0, 1))") s"
grep -E "Used|spill" "$LOGS/ptxas.txt" | sed 's/ptxas info    : //' | sort | uniq -c | head -8 | tee -a "$SUM"
note "ptxas C75xx notes (want none): $(grep -c 'C75[0-9][0-9]' "$LOGS/ptxas.txt")"
grep -oE "\(C75[0-9]+\)[^']*'[^']*'" "$LOGS/ptxas.txt" | sed 's/_ZN[0-9]*_GLOBAL__N__[0-9a-f_]*prefill_sm90_cu_[0-9a-f]*//' | head -8 | tee -a "$SUM"
OBJ=$B/kernels/cuda/CMakeFiles/da_cuda_sm90a.dir/prefill_sm90.cu.o
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -x "$CUOBJDUMP" ] && [ -f $OBJ ]; then
  $CUOBJDUMP -sass $OBJ > "$LOGS/prefill_sm90.sass" 2>&1
  # Per kernel: instructions, HGMMA, warpgroup arrives (fences) and waits (DEPBAR), local
  # memory, setmaxnreg, the highest register named (> 167: the consumers use their setmaxnreg
  # budget), MUFU.EX2 and SHFL.
  python3 - "$LOGS/prefill_sm90.sass" > "$LOGS/sass.txt" << 'EOF'
import re, sys
cur, st = None, {}
order = []
for line in open(sys.argv[1]):
    m = re.search(r"Function : \S*prefill_kernelILi(\d+)ELb(\d)ELb(\d)E", line)
    if m:
        cur = "d%s %s %s" % (m.group(1), "bf16" if m.group(2) == "1" else "fp16", "pipelined" if m.group(3) == "1" else "serial")
        st[cur] = dict(instr=0, HGMMA=0, ARRIVE=0, DEPBAR=0, LDL_STL=0, USETMAXREG=0, EX2=0, SHFL=0, maxR=0)
        order.append(cur)
        continue
    if cur is None or not re.search(r"/\*[0-9a-f]{4,}\*/", line):
        continue
    s = st[cur]
    s["instr"] += 1
    s["HGMMA"] += "HGMMA" in line
    s["ARRIVE"] += "WARPGROUP.ARRIVE" in line
    s["DEPBAR"] += "WARPGROUP.DEPBAR" in line
    s["LDL_STL"] += bool(re.search(r"\b(LDL|STL)\b", line))
    s["USETMAXREG"] += "USETMAXREG" in line
    s["EX2"] += "MUFU.EX2" in line
    s["SHFL"] += "SHFL" in line
    for r in re.findall(r"\bR(\d+)\b", line):
        s["maxR"] = max(s["maxR"], int(r))
for k in order:
    print(k + ": " + ", ".join("%s %d" % (n, v) for n, v in st[k].items()))
EOF
  cat "$LOGS/sass.txt" | tee -a "$SUM"
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
  grep "VERDICT" "$LOGS/mma_bits.txt" | tee -a "$SUM"
  grep -E "DIFF|LAYOUT" "$LOGS/mma_bits.txt" | grep -v "ss-scale0 DIFF |" | head -8
fi
if [ "$what" = test ] || [ "$what" = all ]; then
  step wgmma_test 240 env CK_FORK=no $B/bin/test_wgmma
  grep -E "DIFFER|FAIL|Checks|seed|skipped|Error|error|failed" "$LOGS/wgmma_test.txt" | head -40
  grep -c " equal " "$LOGS/wgmma_test.txt" | sed 's/^/wgmma_test: comparisons equal: /' | tee -a "$SUM"
  grep -c "DIFFER" "$LOGS/wgmma_test.txt" | sed 's/^/wgmma_test: comparisons differing: /' | tee -a "$SUM"
  grep "accuracy" "$LOGS/wgmma_test.txt" | sed 's/ (.*)//' | head -18
  if grep -q "DIFFER" "$LOGS/wgmma_test.txt" || ! grep -q "^100%: Checks" "$LOGS/wgmma_test.txt"; then
    # Which variant fails, each in its own process (a fault kills the CUDA context for the rest).
    for w in 1 2 3; do
      step wgmma_test_path$w 120 env CK_FORK=no WGMMA_TEST_PATHS=$w $B/bin/test_wgmma
      grep -E "wgmma paths|DIFFER|Checks|Error|error|failed" "$LOGS/wgmma_test_path$w.txt" | head -8
    done
  fi
  step cuda_backend_default 180 env CK_FORK=no $B/bin/test_cuda
  grep -E "Checks|Error|error|failed" "$LOGS/cuda_backend_default.txt" | head -10
  step cuda_backend_mma 180 env CK_FORK=no DA_CUDA_PREFILL=mma $B/bin/test_cuda
  grep -E "Checks|Error|error|failed" "$LOGS/cuda_backend_mma.txt" | head -10
  step cuda_backend_pingpong 180 env CK_FORK=no DA_CUDA_PREFILL=wgmma-pingpong $B/bin/test_cuda
  grep -E "Checks|Error|error|failed" "$LOGS/cuda_backend_pingpong.txt" | head -10
fi
if [ "$what" = memcheck ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  step memcheck 280 env CK_FORK=no CK_RUN_CASE=accuracy $SAN --tool memcheck --error-exitcode 1 $B/bin/test_wgmma
  grep -E "ERROR|Invalid|Checks|error" "$LOGS/memcheck.txt" | head -20
fi
# name:DA_CUDA_PREFILL:DA_CUDA_SM90_GRID (empty: a persistent grid of one CTA per SM)
CONFIGS="mma:mma: wgmma-serial:wgmma-serial: wgmma-pipelined:wgmma-pipelined: wgmma-pingpong:wgmma-pingpong: pipelined-per-item:wgmma-pipelined:items"
if [ "$what" = bench ] || [ "$what" = all ]; then
  BENCH="$B/bin/detattn-bench --backend cuda --prefill-only"
  targs=""
  for c in $CONFIGS; do
    IFS=: read -r name pf grid <<< "$c"
    step bench_$name 150 env DA_CUDA_PREFILL=$pf DA_CUDA_SM90_GRID=$grid $BENCH
    mv "$LOGS/bench_$name.txt" "$LOGS/bench_$name.log"
    grep -E "^kind|^prefill" "$LOGS/bench_$name.log" > "$LOGS/$name.csv"
    targs="$targs $name=$LOGS/$name.csv"
  done
  grep -h "prefill path" "$LOGS"/bench_*.log | sed 's/.*prefill path/prefill path/' | sort | uniq -c | tee -a "$SUM"
  step peers 200 python3 clients/bench/sdpa_peer.py --prefill-only --csv "$LOGS/peers.csv"
  python3 tests/cuda/wgmma_table.py $targs "$LOGS/peers.csv" > "$LOGS/table.md"
fi
# ncu of one d-64 prefill launch (B 8 L 4k, the bench's first prefill shape): the pipe
# utilisations, issue and stall picture that say what limits the kernel now.
profile() { # variant timeout_s
  local v=$1 to=$2
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [ -x "$NCU" ] || { note "ncu: not found"; return; }
  DA_CUDA_PREFILL=$v timeout "$to" $NCU --kernel-name regex:prefill_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
    $B/bin/detattn-bench --backend cuda --quick --prefill-only > "$LOGS/ncu-$v.txt" 2>&1
  note "ncu $v: rc=$?"
  grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|Registers Per Thread|Executed Instructions  |L1/TEX Hit|L2 Hit Rate|DRAM Throughput|Shared Memory|Pipe|Stall" \
    "$LOGS/ncu-$v.txt" | grep -vE "^==PROF==" | sed "s/^/[$v] /" | head -40 | tee -a "$LOGS/ncu-summary.txt"
}
if [ "$what" = profile ]; then
  for v in wgmma-serial wgmma-pipelined wgmma-pingpong; do profile $v 120; done
fi
if [ "$what" = all ]; then
  profile wgmma-pipelined 90
fi
echo "---- summary (logs: $OUT/logs.tgz) ----"
cat "$SUM"
[ -f "$LOGS/table.md" ] && cat "$LOGS/table.md"
exit $rc
