#!/bin/bash
# The daemon's decode layer call, this tree against another (e.g. .ab-old: `git archive REV |
# tar x -C .ab-old`, carried), in one device call: builds detattnd and detattn-step-bench of
# both, then runs gpu_breakdown.sh for each "B:L" of SHAPES in the order old, new, new, old
# (two runs each, alternating, so drift over the call hits both), with torch's in-process
# SDPA on the same shapes first (sdpa_layer_peer.py). Prints one table row a run.
# Usage: OLD=.ab-old bash clients/stepbench/gpu_breakdown_ab.sh   (on the GPU machine; $OUT)
# Environment: OLD (.ab-old), SHAPES ("1:1024 8:4096 32:4096"), PLANES (cuda), and what
# gpu_breakdown.sh takes (STEPS, EXTRA_DAEMON_FLAGS, EXTRA_BENCH_FLAGS).
set -u
OLD=${OLD:-.ab-old}
SHAPES=${SHAPES:-1:1024 8:4096 32:4096}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
[ -d "$OLD" ] || { echo "no old tree at $OLD"; exit 1; }
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
ln -sfn "$PWD/.devdeps" "$OLD/.devdeps"
build() { # source dir, build dir, tag
  if ! cmake -S "$1" -B "$2" -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    > "$OUT/configure-$3.log" 2>&1; then
    tail -20 "$OUT/configure-$3.log"
    return 1
  fi
  if ! cmake --build "$2" --target detattnd detattn_step_bench -j8 > "$OUT/build-$3.log" 2>&1; then
    tail -20 "$OUT/build-$3.log"
    return 1
  fi
}
bash tests/cuda/stale_build.sh . build-gpu
bash tests/cuda/stale_build.sh "$OLD" "$OLD/build-gpu"
t0=$(date +%s)
build . build-gpu new & p1=$!
build "$OLD" "$OLD/build-gpu" old & p2=$!
wait $p1 && wait $p2 || exit 1
echo "builds: $(( $(date +%s) - t0 )) s"
peer=$(echo "$SHAPES" | sed 's/:/x/g; s/ /,/g')
python3 clients/stepbench/sdpa_layer_peer.py --shapes "$peer" > "$OUT/sdpa.csv" 2> "$OUT/sdpa.err" &&
  echo "torch in-process, us: $(tail -n +2 "$OUT/sdpa.csv" | tr '\n' ' ')"
export PLANES=${PLANES:-cuda}
for shape in $SHAPES; do
  export B=${shape%%:*} L=${shape##*:}
  for tree in old new new old; do
    bd=build-gpu
    [ "$tree" = old ] && bd="$OLD/build-gpu"
    sub="$OUT/ab-$tree-$B-$L"
    printf "%s " "$tree"
    OUT=$sub bash clients/stepbench/gpu_breakdown.sh "$bd" | tail -1
  done
done
