#!/bin/bash
# On the GPU machine (run tool): configure, build the CUDA targets, run the gpu-labelled
# tests and/or the benchmark with its SDPA peers. Logs under $OUT; a short summary last.
# Usage: bash tests/cuda/run_gpu.sh [tests|bench|all|configs|profile|profile-peer|profile-pages|profile-prefill|ceiling|chain|mergechain|trace|pages|pagesize] [--quick]
# SPLIT=N: the bench's fixed split size S (default 512, the daemon's default); PAGE=N: its KV
# page size in tokens (default 16, the daemon's default); TILE=128: the bench with 128-key
# tiles (default 64).
# profile: ncu sections of one decode launch (B=8 L=16k); profile-prefill: of one prefill
# launch (B=8 L=4k H=32 d=64, causal); profile-peer: one decode step of PB (32) x PL
# (16384), ours and cuDNN's (through sdpa_peer.py), their ncu sections side by side;
# profile-pages: one in-order decode step of PB (32) x PL (65536) at each page size of
# PAGE_SIZES (16 64), ncu's sections side by side and each one's per-SASS-line stall samples
# (ncu-pP-sass.csv under $OUT, summarised by tests/cuda/ncu_sass.py);
# ceiling: read and copy bandwidth, reads in page-sized chunks in order and shuffled, and
# the decode kernel's own TMA stream and cuDNN's load path (tests/cuda/readbw.cu; READBW=big:
# the stream forms only, over 8 GiB; READBW=release: the decode stream under the consumer's
# release rules; READBW=pages: that stream over pages of 8 to 256 tokens); chain: cycles of
# one warpgroup's serial tile chain (tests/cuda/tilechain.cu); mergechain: cycles of a step of the
# combine's lse chain (tests/cuda/mergechain.cu).
# pages: one decode step of each "B:L" in PAGE_SHAPES (8:16384 8:65536 32:16384 32:65536) on
# shuffled pages, pages in order (--contiguous) and interleaved (--interleaved), two rounds
# each, then cuDNN's (sdpa_peer.py, contiguous K/V); a table of ms and x cuDNN.
# configs: the decode shapes of CFG_SHAPES ("B:L ...", at most 8) at each split size and page
# size of CFGS ("S:page ...", default S 512 / 1024 / 2048 at pages of 16 and 256 tokens), two
# rounds each, against cuDNN and flash (sdpa_peer.py, contiguous K/V); a table of ms and ratios
# (tests/cuda/config_table.py); CFG_PREFILL=1: the bench's causal prefill rows too, one round.
# CFG_ENVS ("name:VAR=val[+VAR=val] ..."): each configuration runs under each of these
# environments too (column "S:page name"), e.g. the planner's DA_CUDA_PER_TAIL; the rounds
# go through every configuration and environment in turn.
# pagesize: one decode step of each "B:L" in PAGE_SHAPES at each KV page size of PAGE_SIZES
# (--page: 8 16 32 64 256 tokens), shuffled and in order, two rounds each, against cuDNN.
# trace: a timing build (-DDA_CUDA_TRACE, kernels/cuda/trace.cuh) times one decode step of
# TRACE_B (1) sequences of TRACE_L (1024) tokens at S SPLIT (512), in the serial and the
# default forms, and prints each one's timeline (tests/cuda/trace_timeline.py); TRACE_ARGS: more
# bench arguments (e.g. --contiguous: pages in order); TRACE_OLD=dir
# (e.g. .ab-old, carried) traces that tree too and prints the two side by side.
set -u
what=${1:-all}
quick=${2:-}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
if [ "$what" = ceiling ]; then
  nvcc -O3 -gencode arch=compute_90,code=sm_90 -Ikernels/cuda tests/cuda/readbw.cu -o "$OUT/readbw" && "$OUT/readbw" ${READBW:-} | tee "$OUT/ceiling.txt"
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = mergechain ]; then
  nvcc -std=c++17 --fmad=false -gencode arch=compute_90,code=sm_90 -Ikernels/cuda tests/cuda/mergechain.cu \
    -o "$OUT/mergechain" && "$OUT/mergechain" | tee "$OUT/mergechain.txt"
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = chain ]; then
  nvcc -std=c++17 --fmad=false --generate-code=arch=compute_90a,code=sm_90a -Ikernels/cuda -Ikernels \
    tests/cuda/tilechain.cu -o "$OUT/tilechain" && "$OUT/tilechain" | tee "$OUT/chain.txt"
  exit "${PIPESTATUS[0]}"
fi
eval "$(bash .devdeps/unpack.sh)"
# Some .pc files name /usr paths directly; point them at the unpacked tree too.
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if [ "$what" = trace ]; then
  bash tests/cuda/stale_build.sh . build-trace
  cmake -S . -B build-trace -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_FLAGS=-DDA_CUDA_TRACE > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build-trace --target detattn-bench -j16 > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -20; exit 1; }
  cat "$OUT/gpu.txt"
  for v in wgmma-serial ""; do # DA_CUDA_PREFILL: the serial form, then the default
    f="$OUT/trace-${v:-default}"
    DA_CUDA_PREFILL=$v build-trace/bin/detattn-bench --backend cuda --one-decode "${TRACE_B:-1}" "${TRACE_L:-1024}" \
      --split "${SPLIT:-512}" ${TRACE_ARGS:-} > "$f.csv" 2> "$f.txt" || { tail -5 "$f.txt"; exit 1; }
    echo "== ${v:-default}: $(grep fixedS "$f.csv" | cut -d, -f10-12,15) (ms, attn_ms, combine_ms, lat_ms; traced build)"
    python3 tests/cuda/trace_timeline.py "$f.txt" || exit 1
    python3 tests/cuda/trace_timeline.py --busy "$f.txt" > "$f.busy" &&
      echo "consumer busy us / wait us a tile slot (medians): $(tail -1 "$f.busy")"
    python3 tests/cuda/trace_timeline.py --end "$f.txt" > "$f.end" && tail -n +2 "$f.end"
  done
  if [ -n "${TRACE_OLD:-}" ]; then # another source tree (e.g. .ab-old): the same, then both side by side
    ln -sfn "$PWD/.devdeps" "$TRACE_OLD/.devdeps"
    (cd "$TRACE_OLD" && OUT="$OUT/old" TRACE_OLD= bash tests/cuda/run_gpu.sh trace > "$OUT/old.log" 2>&1) ||
      { tail -20 "$OUT/old.log"; exit 1; }
    grep "^==" "$OUT/old.log" | sed 's/^== /== old tree, /'
    for v in wgmma-serial default; do
      echo "== $v, this tree against $TRACE_OLD"
      python3 tests/cuda/trace_timeline.py --medians "$OUT/trace-$v.txt" "$OUT/old/trace-$v.txt" || exit 1
    done
  fi
  exit 0
fi
bash tests/cuda/stale_build.sh . build-gpu # a warm machine's build dir of another tree: from clean
rm -f build-gpu/CMakeCache.txt
cmake -S . -B build-gpu -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
t0=$(date +%s.%N)
cmake --build build-gpu --target da_cuda -j16 > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
t1=$(date +%s.%N)
# Everything for the tests (they use test binaries, the daemon, the CLI and tools); the
# bench and the profiles need only detattn-bench (below).
if [ "$what" = tests ] || [ "$what" = all ]; then
  cmake --build build-gpu -j16 >> "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
fi
echo "da_cuda build (16 jobs): $(python3 -c "print(round($t1 - $t0, 1))") s" | tee "$OUT/summary.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  ctest --test-dir build-gpu -L gpu -V > "$OUT/ctest.log" 2>&1 || rc=1
  grep -E "tests passed|Test +#|Failed|Skipped|Checks|seed|accuracy cfg" "$OUT/ctest.log" | tail -20 | tee -a "$OUT/summary.txt"
  [ $rc -ne 0 ] && grep -E "test_cuda.c:[0-9]+|ERROR|Invalid|error" "$OUT/ctest.log" | head -30
fi
if [ "$what" != tests ]; then
  cmake --build build-gpu --target detattn-bench -j16 >> "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -20; exit 1; }
  BENCH="build-gpu/bin/detattn-bench --backend cuda"
  bqs=""; [ "$quick" = --quick ] && bqs=--quick
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats"
  if [ "$what" = profile ]; then
    $BENCH --quick --decode-only --contiguous 2>&1 | tee "$OUT/contig.csv"
    $NCU --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 $NCU_SECTIONS \
      $BENCH --one-decode 8 16384 > "$OUT/ncu.txt" 2>&1
    grep -vE "^==PROF==|^ +-+$" "$OUT/ncu.txt" | grep -E "[0-9]" | head -80
    exit 0
  fi
  if [ "$what" = profile-peer ]; then # one decode step of PB x PL, ours and cuDNN's, side by side
    sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
    $NCU --kernel-name regex:prefill_kernel --launch-skip 3 --launch-count 1 $sec \
      $BENCH --one-decode "${PB:-32}" "${PL:-16384}" > "$OUT/ncu-ours.txt" 2>&1
    $NCU --kernel-name regex:'cudnn|fmha|sdpa|flash' --launch-skip 5 --launch-count 1 $sec \
      python3 clients/bench/sdpa_peer.py --one-decode "${PB:-32}" "${PL:-16384}" --peer cudnn > "$OUT/ncu-cudnn.txt" 2>&1
    python3 tests/cuda/ncu_side.py "$OUT/ncu-ours.txt" "$OUT/ncu-cudnn.txt"
    exit 0
  fi
  if [ "$what" = profile-pages ]; then # one in-order decode step of PB x PL at each page size of PAGE_SIZES
    sec="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters
      --section MemoryWorkloadAnalysis --section InstructionStats"
    reps=""
    for pg in ${PAGE_SIZES:-16 64}; do
      $NCU --kernel-name regex:prefill_kernel --launch-skip 3 --launch-count 1 $sec --export "$OUT/ncu-p$pg" -f \
        $BENCH --one-decode "${PB:-32}" "${PL:-65536}" --contiguous --page "$pg" > "$OUT/ncu-p$pg.log" 2>&1 ||
        { tail -5 "$OUT/ncu-p$pg.log"; exit 1; }
      $NCU -i "$OUT/ncu-p$pg.ncu-rep" --page details > "$OUT/ncu-p$pg.txt" 2>&1
      # Per SASS instruction: its stall samples (warp state at each sample), for the producer's loop.
      $NCU -i "$OUT/ncu-p$pg.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-p$pg-sass.csv" 2>&1
      reps="$reps $OUT/ncu-p$pg.txt"
    done
    python3 tests/cuda/ncu_side.py $reps
    TOP=8 python3 tests/cuda/ncu_sass.py "$OUT"/ncu-p*-sass.csv
    exit 0
  fi
  # Table helpers of pages and pagesize. two_rounds ARGS...: one decode step of the bench
  # twice; appends "t1 / t2 |" to $row and the better round to $best.
  two_rounds() {
    local t1 t2
    t1=$($BENCH "$@" 2>> "$OUT/pages.err" | grep fixedS | cut -d, -f10)
    t2=$($BENCH "$@" 2>> "$OUT/pages.err" | grep fixedS | cut -d, -f10)
    row="$row ${t1:--} / ${t2:--} |"
    best="$best $(printf "%s\n%s\n" "${t1:-nan}" "${t2:-nan}" | sort -g | head -1)"
  }
  cudnn_ms() { # B L: cuDNN's ms of that decode step (sdpa_peer.py, contiguous K/V)
    python3 clients/bench/sdpa_peer.py --one-decode "$1" "$2" --peer cudnn 2>&1 >/dev/null |
      grep "^# decode" | grep -Eo "[0-9.]+ ms" | cut -d' ' -f1
  }
  over() { # C T...: C / T for each T, three decimals
    python3 -c "import sys; c = float(sys.argv[1]); print(' / '.join(f'{c / float(v):.3f}' for v in sys.argv[2:]))" "$@"
  }
  if [ "$what" = pages ]; then
    : > "$OUT/pages.md"
    for sh in ${PAGE_SHAPES:-8:16384 8:65536 32:16384 32:65536}; do
      b=${sh%:*} l=${sh#*:} row="| $b, $l |" best=""
      for o in "" --contiguous --interleaved; do two_rounds --one-decode "$b" "$l" $o; done
      c=$(cudnn_ms "$b" "$l")
      echo "$row ${c:--} | $(over "${c:-nan}" $best) |" >> "$OUT/pages.md"
    done
    echo "| B, L | shuffled | in order | interleaved | cuDNN | x cuDNN (shuffled / in order / interleaved, best round) |"
    echo "|---|---|---|---|---|---|"
    cat "$OUT/pages.md"
    exit 0
  fi
  if [ "$what" = pagesize ]; then # each "B:L" of PAGE_SHAPES at each --page of PAGE_SIZES, two orders
    echo "| B, L | page tokens | shuffled (two rounds) | in order | cuDNN | x cuDNN (shuffled / in order, best round) |"
    echo "|---|---|---|---|---|---|"
    for sh in ${PAGE_SHAPES:-1:16384 1:65536 8:16384 8:65536 32:16384 32:65536}; do
      b=${sh%:*} l=${sh#*:}
      c=$(cudnn_ms "$b" "$l")
      for pg in ${PAGE_SIZES:-8 16 32 64 256}; do
        row="| $b, $l | $pg |" best=""
        for o in "" --contiguous; do two_rounds --one-decode "$b" "$l" --page "$pg" $o; done
        echo "$row ${c:--} | $(over "${c:-nan}" $best) |"
      done
    done
    exit 0
  fi
  if [ "$what" = configs ]; then # the decode shapes of CFG_SHAPES at each S:page of CFGS, against the peers
    shapes=${CFG_SHAPES:-1:1024 1:65536 8:4096 8:16384 8:65536 32:16384 32:65536 64:65536}
    one=""; for sh in $shapes; do one="$one --one-decode ${sh%:*} ${sh#*:}"; done
    d="$OUT/cfg"; mkdir -p "$d"
    python3 clients/bench/sdpa_peer.py $one --csv "$d/peers.csv" > /dev/null 2> "$d/peers.err" ||
      { tail -5 "$d/peers.err"; exit 1; }
    if [ -n "${CFG_PREFILL:-}" ]; then # the bench's causal prefill rows too (ours at each S:page)
      python3 clients/bench/sdpa_peer.py --prefill-only --csv "$d/peers-prefill.csv" > /dev/null 2>> "$d/peers.err" ||
        { tail -5 "$d/peers.err"; exit 1; }
    fi
    cfgs=${CFGS:-512:16 1024:16 2048:16 512:256 1024:256 2048:256}
    envs=":${CFG_ENVS:+ $CFG_ENVS}" # the plain environment first
    for r in 1 2; do # two rounds, each shape in one process, in the order given
      for cfg in $cfgs; do
        for e in $envs; do
          s=${cfg%:*} pg=${cfg#*:} name=${e%%:*} vars=${e#*:}
          env ${vars//+/ } $BENCH $one --split "$s" --page "$pg" > "$d/$s-$pg-$name-$r.csv" 2>> "$d/bench.err" ||
            { tail -5 "$d/bench.err"; exit 1; }
        done
      done
    done
    args=()
    for cfg in $cfgs; do
      for e in $envs; do
        s=${cfg%:*} pg=${cfg#*:} name=${e%%:*} vars=${e#*:}
        files="$d/$s-$pg-$name-1.csv,$d/$s-$pg-$name-2.csv"
        if [ -n "${CFG_PREFILL:-}" ]; then
          f="$d/$s-$pg-$name-prefill.csv"
          env ${vars//+/ } $BENCH --prefill-only --split "$s" --page "$pg" > "$f" 2>> "$d/bench.err" ||
            { tail -5 "$d/bench.err"; exit 1; }
          files="$files,$f"
        fi
        args+=("$cfg${name:+ $name}=$files")
      done
    done
    python3 tests/cuda/config_table.py "$d"/peers*.csv -- "${args[@]}" | tee "$OUT/configs.md"
    tar czf "$OUT/cfg.tgz" -C "$OUT" cfg && rm -rf "$d" # one file back, not one a run
    exit 0
  fi
  if [ "$what" = profile-prefill ]; then
    $NCU --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 $NCU_SECTIONS \
      $BENCH --quick --prefill-only > "$OUT/ncu-prefill.txt" 2>&1
    grep -vE "^==PROF==|^ +-+$" "$OUT/ncu-prefill.txt" | grep -E "[0-9]" | head -90
    exit 0
  fi
  $BENCH $bqs ${SPLIT:+--split $SPLIT} ${PAGE:+--page $PAGE} ${TILE:+--tile $TILE} > "$OUT/ours.csv" 2> "$OUT/bench.err" || { rc=1; tail -5 "$OUT/bench.err"; }
  python3 clients/bench/sdpa_peer.py $bqs --ours "$OUT/ours.csv" --csv "$OUT/peers.csv" \
    > "$OUT/table.md" 2> "$OUT/peers.err" || { rc=1; tail -5 "$OUT/peers.err"; }
  cat "$OUT/ours.csv"
  cat "$OUT/table.md"
fi
exit $rc
