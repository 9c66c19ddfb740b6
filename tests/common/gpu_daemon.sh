# shellcheck shell=bash
# gpu_daemon.sh — sourced by the scripts that run a real detattnd on the CUDA backend
# (tests/cuda/daemon_verify.sh, tests/ops/readme_gpu_example.sh): skip (exit 77) without a
# device, and wait for the started daemon to listen.

# Exits 77 unless nvidia-smi lists a device.
skip_without_cuda_device() {
  if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
    echo "skip: no CUDA device (nvidia-smi missing or failing)"
    exit 77
  fi
}

# Waits up to seconds for "listening on" in log from the daemon $pid (named what in
# messages). When the daemon exits first: exit 77 if its log says it found no usable device,
# else the caller's fail; $pid is emptied once the daemon is reaped.
# Usage: wait_listening <log> <seconds> <what>
wait_listening() {
  local log=$1 seconds=$2 what=$3 no_device="no usable device|not present|is not built in|built for sm_" rc
  for _ in $(seq 1 $((seconds * 10))); do
    grep -q "^listening on " "$log" && return 0
    if ! kill -0 "$pid" 2> /dev/null; then
      wait "$pid"
      rc=$?
      pid=
      if grep -qE "$no_device" "$log"; then
        echo "skip: $(grep -m1 -E "$no_device" "$log")"
        exit 77
      fi
      fail "$what exited $rc before listening"
    fi
    sleep 0.1
  done
  grep -q "^listening on " "$log" || fail "$what did not print 'listening on' within $seconds s"
}
