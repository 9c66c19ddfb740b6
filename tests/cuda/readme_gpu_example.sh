#!/bin/bash
# readme_gpu_example.sh — the README's GPU example (32 layers, 32 q / 8 kv heads, d 128,
# S 512, page 16, 262144 KV tokens) starts on a CUDA daemon with no extra flags: the staging
# size is derived from the model and --max-batch-tokens and logged; the daemon answers
# hello and drains on SIGTERM.
# Exit 0 pass, 1 fail, 77 skipped (no CUDA device).
# Usage: readme_gpu_example.sh <detattnd> <detattn cli>
set -u
detattnd=$1
cli=$2
if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "skip: no CUDA device"
  exit 77
fi
dir=$(mktemp -d /tmp/detattn-readme-gpu-XXXXXX) || exit 1
trap 'kill -KILL $pid 2>/dev/null; rm -rf "$dir"' EXIT
url="ipc://$dir/d.sock"
"$detattnd" --listen "$url" --backend cuda --layers 32 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --dtype bf16 --page-tokens 16 --kv-tokens 262144 --split-tokens 512 2> "$dir/log" &
pid=$!
for _ in $(seq 600); do
  grep -q "listening on" "$dir/log" && break
  kill -0 $pid 2> /dev/null || { echo "FAIL: the README's GPU example exited:"; cat "$dir/log"; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$dir/log" || { echo "FAIL: not listening after 60 s"; cat "$dir/log"; exit 1; }
grep "staging" "$dir/log"
"$cli" --url "$url" hello > "$dir/hello" || { echo "FAIL: hello"; cat "$dir/log"; exit 1; }
grep -q "cuda" "$dir/hello" || { echo "FAIL: hello does not name the cuda backend"; cat "$dir/hello"; exit 1; }
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 0 ] || { echo "FAIL: exit status $rc after SIGTERM"; tail "$dir/log"; exit 1; }
echo "PASS: the README's GPU example started with derived staging and drained"
