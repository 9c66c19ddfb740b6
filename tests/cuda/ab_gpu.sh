#!/bin/bash
# Same-run A/B of the CUDA kernels, on the GPU machine: this tree ("new") against an older
# source tree ("old", default .ab-old) built beside it, benchmark rounds interleaved, minimum
# per case, ratios new/old. Timings from different calls or cards are not comparable; this
# is how every kernel change in kernels/cuda/NOTES.md is measured.
#
# Each tree times with its own bench: trees from before bc44d84 time a step from an idle
# stream (host launch inside), later ones as CUDA graphs after a warm-up, so compare a kernel
# change against HEAD (or another tree from after bc44d84), as below.
#
# Here:   rm -rf .ab-old && mkdir .ab-old && git archive HEAD | tar x -C .ab-old
# There:  run with carry [".devdeps", ".ab-old"] and the command `bash tests/cuda/ab_gpu.sh`
# Settings of one build only (DEC_VARIANTS, PRE_VARIANTS, VARIANTS against its defaults):
#         `bash tests/cuda/ab_gpu.sh none` builds no old tree; the tables' base is the new build.
#
# Environment (defaults in brackets):
#   ROUNDS [2]        interleaved rounds of every prefill case
#   SPLITS [512 2048] split sizes S of the prefill rounds
#   PREFILL [1]       0: no prefill rounds (a decode-only A/B)
#   DECODE [0]        1: decode rounds too (ROUNDS rounds per split of DEC_SPLITS [512]): the
#                     bench's decode table, or only DEC_SHAPES
#   DEC_SHAPES []     "B L,B L,...": those decode shapes (--one-decode) instead of the table;
#                     "B L ARGS" adds bench arguments (e.g. "32 65536 --contiguous --page 64"),
#                     the row's kind then names them (decode--contiguous--page64)
#   DEC_VARIANTS []   "name:VAR=val[+VAR=val] ...": environments of the new build run in the
#                     decode rounds as well, e.g. "ring:DA_CUDA_SM90_DECODE=1"
#   EXTRA  []         extra causal prefills of the 32/8-head d-128 model, "BxL ..."
#   VARIANTS []       DA_CUDA_PREFILL values run on the new build as well
#   PRE_VARIANTS []   "name:VAR=val[+VAR=val] ...": environments of the new build run in the
#                     prefill rounds as well (as DEC_VARIANTS in the decode rounds)
#   VFLAGS []         CMAKE_CUDA_FLAGS of a third build ("var"), e.g. -DSOME_MACRO=1, timed in
#                     the prefill and the decode rounds
#   VBUILDS []        "name:flags ...": more builds of this tree, each with its CMAKE_CUDA_FLAGS
#                     (several flags joined by +), timed as VFLAGS's is under their names, e.g.
#                     "defer:-DDA_EXP_DEFER nowrite:-DDA_EXP_NOWRITE" (VFLAGS=f is "var:f")
#   CTEST [1]         1: the gpu-labelled tests on the new build; quick: all but the MMA
#                     instruction-bit tests (cuda_mma_bits, cuda_wgmma: 50 s of the 130), for
#                     changes to the planner, the combine or the host
#   PEERS [0]         1: PyTorch SDPA prefill peers, ratios for old and new
# Results: $OUT/summary.txt (printed), every csv and log in $OUT/all.tgz.
set -u
OLD=${1:-.ab-old}
OUT=${OUT:-/tmp/detattn-ab}
mkdir -p "$OUT"
[ "$OLD" = none ] || [ -f "$OLD/CMakeLists.txt" ] || { echo "ab_gpu: no source tree at $OLD" >&2; exit 2; }
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/summary.txt"
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/summary.txt"; }
configure() { # source, build dir, name, extra cmake arguments
  bash tests/cuda/stale_build.sh "$1" "$2" # a warm machine's build dir of another tree: from clean
  cmake -S "$1" -B "$2" -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release "${@:4}" \
    > "$OUT/cfg-$3.log" 2>&1 || { tail -20 "$OUT/cfg-$3.log"; exit 1; }
}
configure . build-gpu new
pids=()
if [ "$OLD" != none ]; then
  configure "$OLD" build-ab-old old
  (cmake --build build-ab-old --target detattn-bench -j4 > "$OUT/build-old.log" 2>&1) &
  pids+=($!)
fi
VB="${VBUILDS:-}"
[ -n "${VFLAGS:-}" ] && VB="var:$(tr ' ' + <<< "$VFLAGS") $VB"
for vb in $VB; do # name:flags
  configure . "build-ab-${vb%%:*}" "${vb%%:*}" "-DCMAKE_CUDA_FLAGS=$(tr + ' ' <<< "${vb#*:}")"
  (cmake --build "build-ab-${vb%%:*}" --target detattn-bench -j4 > "$OUT/build-${vb%%:*}.log" 2>&1) &
  pids+=($!)
done
cmake --build build-gpu -j8 > "$OUT/build-new.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build-new.log" | head -30; exit 1; }
for p in "${pids[@]}"; do wait "$p" || { grep -E "error|FAILED" -A3 "$OUT"/build-*.log | head -30; exit 1; }; done
stamp built

NEW="build-gpu/bin/detattn-bench --backend cuda"
OLDB="build-ab-old/bin/detattn-bench --backend cuda"
[ "$OLD" = none ] && OLDB=: # no old tree: its rounds do nothing
for r in $(seq 1 "${ROUNDS:-2}"); do
  [ "${PREFILL:-1}" = 1 ] || break
  for S in ${SPLITS:-512 2048}; do
    [ "$OLD" = none ] || $OLDB --prefill-only --split "$S" > "$OUT/pre-old-$S-$r.csv" 2>> "$OUT/bench.err"
    $NEW --prefill-only --split "$S" > "$OUT/pre-new-$S-$r.csv" 2>> "$OUT/bench.err"
    for vb in $VB; do
      "build-ab-${vb%%:*}/bin/detattn-bench" --backend cuda --prefill-only --split "$S" \
        > "$OUT/pre-${vb%%:*}-$S-$r.csv" 2>> "$OUT/bench.err"
    done
    for v in ${VARIANTS:-}; do
      DA_CUDA_PREFILL=$v $NEW --prefill-only --split "$S" > "$OUT/pre-$v-$S-$r.csv" 2>> "$OUT/bench.err"
    done
    for v in ${PRE_VARIANTS:-}; do
      env $(tr + ' ' <<< "${v#*:}") $NEW --prefill-only --split "$S" > "$OUT/pre-${v%%:*}-$S-$r.csv" 2>> "$OUT/bench.err"
    done
  done
  for bl in ${EXTRA:-}; do
    [ "$OLD" = none ] || $OLDB --one-prefill "${bl%x*}" "${bl#*x}" > "$OUT/pre-old-x$bl-$r.csv" 2>> "$OUT/bench.err"
    $NEW --one-prefill "${bl%x*}" "${bl#*x}" > "$OUT/pre-new-x$bl-$r.csv" 2>> "$OUT/bench.err"
  done
done
stamp prefill rounds
# dec CSV COMMAND...: the decode rows at split S of one build into CSV (one header). Shapes
# without bench arguments of their own run in one process (up to 8 --one-decode cases), the
# others one process each.
dec() {
  local f=$1 b l plain=()
  shift
  if [ -z "${DEC_SHAPES:-}" ]; then
    "$@" --decode-only --split "$S" > "$f" 2>> "$OUT/bench.err"
    return
  fi
  : > "$f"
  while read -r b l rest; do
    [ -n "$b" ] && [ -z "$rest" ] && plain+=(--one-decode "$b" "$l")
    if [ ${#plain[@]} -eq 24 ] || { [ -z "$b" ] && [ ${#plain[@]} -gt 0 ]; }; then
      "$@" "${plain[@]}" --split "$S" 2>> "$OUT/bench.err" > "$f.one"
      if [ -s "$f" ]; then tail -n +2 "$f.one" >> "$f"; else cat "$f.one" > "$f"; fi
      plain=()
    fi
    [ -n "$b" ] && [ -n "$rest" ] || continue
    # More bench arguments after B L (e.g. --contiguous --page 64) name the row's kind.
    "$@" --one-decode "$b" "$l" --split "$S" $rest 2>> "$OUT/bench.err" |
      awk -F, -v OFS=, -v tag="$(tr -d ' ' <<< "$rest")" 'NR > 1 && tag != "" { $1 = $1 tag } 1' > "$f.one"
    if [ -s "$f" ]; then tail -n +2 "$f.one" >> "$f"; else cat "$f.one" > "$f"; fi
  done <<< "$(tr , '\n' <<< "$DEC_SHAPES")
" # the empty last line runs the plain shapes left
  rm -f "$f.one"
}
if [ "${DECODE:-0}" = 1 ]; then
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for S in ${DEC_SPLITS:-512}; do
      [ "$OLD" = none ] || dec "$OUT/dec-old-$S-$r.csv" $OLDB
      dec "$OUT/dec-new-$S-$r.csv" $NEW
      for vb in $VB; do
        dec "$OUT/dec-${vb%%:*}-$S-$r.csv" "build-ab-${vb%%:*}/bin/detattn-bench" --backend cuda
      done
      for v in ${DEC_VARIANTS:-}; do
        dec "$OUT/dec-${v%%:*}-$S-$r.csv" env $(tr + ' ' <<< "${v#*:}") $NEW
      done
    done
  done
  stamp decode rounds
fi
if [ "${CTEST:-1}" = 1 ] || [ "${CTEST:-1}" = quick ]; then
  skip=(); [ "${CTEST:-1}" = quick ] && skip=(-E "cuda_mma_bits|cuda_wgmma")
  timeout 300 ctest --test-dir build-gpu -L gpu "${skip[@]}" --timeout 240 --output-on-failure > "$OUT/ctest.log" 2>&1
  grep -E "tests passed|tests failed|\*\*\*Failed" "$OUT/ctest.log" | tail -12 | tee -a "$OUT/summary.txt"
  stamp ctest
fi
if [ "${PEERS:-0}" = 1 ]; then
  timeout 200 python3 clients/bench/sdpa_peer.py --prefill-only --csv "$OUT/peers.csv" \
    --ours "$OUT/pre-new-512-1.csv" > "$OUT/peers.md" 2> "$OUT/peers.err"
  stamp peers
fi
python3 tests/cuda/ab_compare.py "$OUT" | tee -a "$OUT/summary.txt"
# The device hands back only a few files: one archive and the summary.
tgz=$(mktemp /tmp/ab-all.XXXXXX)
tar czf "$tgz" -C "$OUT" --exclude summary.txt . && find "$OUT" -type f ! -name summary.txt -delete && mv "$tgz" "$OUT/all.tgz"
