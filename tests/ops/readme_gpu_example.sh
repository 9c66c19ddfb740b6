#!/bin/bash
# readme_gpu_example.sh — the README's detattnd example, exactly as the README writes it
# (only --listen moves to a temporary directory), must start on a GPU with no extra flag:
# staging is sized from --max-batch-tokens, the daemon answers hello and a short
# `detattn verify`, and SIGTERM drains it to exit 0.
# Exit 0 pass, 1 fail, 77 skipped (no CUDA device).
# Usage: readme_gpu_example.sh <README.md> <detattnd> <detattn cli>
set -u
readme=$1
detattnd=$2
cli=$3
. "$(dirname "${BASH_SOURCE[0]}")/../common/gpu_daemon.sh"

skip_without_cuda_device
# The example: the line starting "detattnd --listen ipc:///tmp/d.sock" and its continuations.
example=$(sed -n '/^detattnd --listen ipc:\/\/\/tmp\/d.sock/,/[^\\]$/p' "$readme" | tr -d '\\\n')
if [ -z "$example" ]; then
  echo "FAIL: no 'detattnd --listen ipc:///tmp/d.sock ...' example in $readme"
  exit 1
fi
read -r -a words <<< "$example"
args=()
for ((i = 1; i < ${#words[@]}; i++)); do
  if [ "${words[$i]}" = "--listen" ]; then i=$((i + 1)); continue; fi
  args+=("${words[$i]}")
done
echo "README example flags: ${args[*]}"

dir=$(mktemp -d /tmp/detattn-readme-gpu-XXXXXX) || exit 1
pid=
cleanup() {
  [ -n "$pid" ] && kill -KILL "$pid" 2> /dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  echo "--- detattnd log:"
  cat "$dir/detattnd.log"
  exit 1
}

url="ipc://$dir/d.sock"
"$detattnd" --listen "$url" "${args[@]}" 2> "$dir/detattnd.log" &
pid=$!
wait_listening "$dir/detattnd.log" 60 "the README example"
grep -q "backend cuda" "$dir/detattnd.log" || fail "the example did not open the cuda backend"
grep -q "sized from --max-batch-tokens" "$dir/detattnd.log" || fail "staging was not sized from --max-batch-tokens"
grep -E "backend|KV cache|device memory" "$dir/detattnd.log"

"$cli" --url "$url" hello > "$dir/hello.txt" 2>&1 || fail "detattn hello: $(cat "$dir/hello.txt")"
grep -E "model|fingerprint" "$dir/hello.txt"
"$cli" --url "$url" --timeout 60000 verify --clients 4 --seqs 8 --decode-steps 4 > "$dir/verify.txt" 2>&1
vrc=$?
tail -4 "$dir/verify.txt"
[ $vrc -eq 0 ] || fail "detattn verify exited $vrc"
grep -q "mismatches       0" "$dir/verify.txt" || fail "verify found mismatches"

kill -TERM "$pid"
wait "$pid"
rc=$?
pid=
[ $rc -eq 0 ] || fail "SIGTERM: exit $rc"
echo "PASS: the README's GPU example started with no extra flag, verified and drained"
