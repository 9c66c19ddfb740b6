# Sourced by gpu_flags_ab.sh and gpu_multi.sh (on the GPU machine). step_bench_build BUILD OUT:
# puts .devdeps' libraries on the path (the binaries load them, built now or before) and
# builds detattnd and detattn-step-bench for sm_90 into BUILD if they are not there.
# ab_order N: the indices 0 .. N-1, then N-1 .. 0 (a b b a: drift over a call hits every
# variant alike).
# kv_tokens CLIENTS B L STEPS: a daemon's --kv-tokens for CLIENTS step benches of B sequences of
# L tokens and STEPS decode steps (warm-up included), each within the default per-client quota
# (the cache less an eighth); at least 600000.
step_bench_build() {
  local build=$1 out=$2
  if [ -f .devdeps/unpack.sh ]; then
    eval "$(bash .devdeps/unpack.sh)"
    sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  fi
  [ -x "$build/bin/detattnd" ] && [ -x "$build/bin/detattn-step-bench" ] && return 0
  [ -f .devdeps/unpack.sh ] || { echo "no $build/bin/detattnd and no .devdeps to build it"; return 1; }
  cmake -S . -B "$build" -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; return 1; }
  cmake --build "$build" --target detattnd detattn_step_bench -j16 > "$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; return 1; }
}

ab_order() {
  local n=$1 k
  for ((k = 0; k < n; k++)); do echo "$k"; done
  for ((k = n - 1; k >= 0; k--)); do echo "$k"; done
}

kv_tokens() {
  local kv=$((($1 * $2 * ($3 + $4 + 64) + 65536) * 8 / 7))
  echo $((kv < 600000 ? 600000 : kv))
}
