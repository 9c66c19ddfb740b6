#!/bin/bash
# daemon_verify.sh — `detattn verify` against a real detattnd on the CUDA backend: a small
# model (4 layers, 32 q / 8 kv heads, d 128, S 256) on an ipc:// socket in a mktemp dir;
# 8 concurrent clients must reproduce the one-at-a-time pass bit for bit (0 mismatches,
# outputs_compared > 0) and stay within the fp64 reference tolerance; SIGTERM must then
# drain the daemon to exit 0.
# Exit 0 pass, 1 fail, 77 skipped (no CUDA device: nvidia-smi missing or failing, or the
# daemon reports no usable device).
# Usage: daemon_verify.sh <detattnd> <detattn cli> [seed]; DETATTN_VERIFY_TILE=128 runs the
# daemon with 128-key tiles (default 64).
set -u
detattnd=$1
cli=$2
seed=${3:-${DETATTN_TEST_SEED:-$(( $(date +%s) % 100000 + 1 ))}}
tile=${DETATTN_VERIFY_TILE:-64}
. "$(dirname "${BASH_SOURCE[0]}")/../common/gpu_daemon.sh"

skip_without_cuda_device

dir=$(mktemp -d /tmp/detattn-cuda-verify-XXXXXX) || exit 1
pid=
cleanup() {
  [ -n "$pid" ] && kill -KILL "$pid" 2> /dev/null
  if [ -n "${DETATTN_TEST_KEEP:-}" ]; then echo "kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $* (seed $seed)"
  echo "--- detattnd log (last 30 lines):"
  tail -30 "$dir/detattnd.log"
  exit 1
}

url="ipc://$dir/d.sock"
"$detattnd" --listen "$url" --backend cuda --layers 4 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --split-tokens 256 --tile-tokens "$tile" --page-tokens 16 --kv-tokens 65536 --max-seqs 64 \
  --max-request-tokens 2048 --max-batch-tokens 4096 --log-level info 2> "$dir/detattnd.log" &
pid=$!

wait_listening "$dir/detattnd.log" 30 detattnd
grep -q "backend cuda" "$dir/detattnd.log" || fail "detattnd did not open the cuda backend"

"$cli" --url "$url" --timeout 30000 --json verify --clients 8 --check-ref --seed "$seed" \
  > "$dir/verify.json" 2> "$dir/verify.err"
vrc=$?
cat "$dir/verify.json"
[ -s "$dir/verify.err" ] && cat "$dir/verify.err"
[ $vrc -eq 0 ] || fail "detattn verify exited $vrc"
python3 - "$dir/verify.json" << 'EOF' || fail "verify JSON check"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["mismatches"] == 0, "mismatches: %s (first: %s)" % (j["mismatches"], j.get("first_mismatch"))
assert j["outputs_compared"] > 0, "no outputs compared"
assert j["max_rel_err"] <= j["tolerance"], "max_rel_err %g > tolerance %g" % (j["max_rel_err"], j["tolerance"])
assert j["result"] == "pass", "result " + j["result"]
print("verify: %d outputs compared, 0 mismatches, max rel. error %.3g" % (j["outputs_compared"], j["max_rel_err"]))
EOF

kill -TERM "$pid"
for _ in $(seq 1 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2> /dev/null; then fail "detattnd still running 10 s after SIGTERM"; fi
wait "$pid"
rc=$?
pid=
[ $rc -eq 0 ] || fail "detattnd exited $rc after SIGTERM, want 0"
echo "PASS (seed $seed)"
exit 0
