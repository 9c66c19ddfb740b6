#!/bin/bash
# On the GPU machine, in one device call (about 8 minutes, build included; carry .devdeps):
#   bash clients/python/gpu_repro.sh [N]          (N target samples per path, default 1000)
# 1. builds detattnd and libdetattn with the CUDA backend;
# 2. --probe: does one decode row's output change with the batch size, per torch kernel
#    (SDPA flash, cuDNN, efficient, math; varlen_attn) and through detattnd, at the
#    experiment's context (2048 keys, model "small": 16 q / 8 kv heads, d 64)?
# 3. the cuda plane's GPU checks (tests/test_gpu_cuda_plane.py): CUDA tensors through cuda,
#    shm and copy give equal bits; in place; stream order; async keep-alive; the model;
# 4. the reproducibility experiment, stream workload: N copies of a 2048-token prompt, 32
#    greedy tokens each, among bursts of requests joining and leaving (batch 1-48 rows),
#    through detattnd (CUDA daemon; the cuda plane when offered, else shm) and torch's
#    serving-style decode (flash, cuDNN, varlen) in-process; two client processes and a
#    daemon restart for detattn. --time-budget keeps it inside the call: each path gets
#    an even share of what is left and reports how many samples it got.
# Everything lands in $OUT (logs, the daemons' logs, probe.json, cuda_plane.json, repro.json,
# repro.png); a summary is printed last. Environment: REPRO_DEADLINE (seconds from start by
# which the experiment must end, default 470), REPRO_PATHS.
set -uo pipefail
n=${1:-1000}
deadline=${REPRO_DEADLINE:-470}
paths=${REPRO_PATHS:-detattn,torch-flash,torch-cudnn,torch-varlen-decode}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)"; }

stage build
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
if ! { cmake -S . -B build-gpu -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
         > "$OUT/configure.log" 2>&1 &&
       cmake --build build-gpu --target detattnd detattn -j16 > "$OUT/build.log" 2>&1; }; then
  tail -30 "$OUT/configure.log" "$OUT/build.log"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn",
torch.backends.cudnn.version())' | tee -a "$OUT/gpu.txt"
export DETATTN_LIBRARY=$PWD/build-gpu/lib/libdetattn.so PYTHONPATH=$PWD/clients/python
python3 -c 'import detattn; print("libdetattn", detattn._lib.path, "cuda plane:",
detattn._lib.cuda_api() is not None)' | tee -a "$OUT/gpu.txt"
common=(--detattnd build-gpu/bin/detattnd --backend cuda --torch-device cuda --model small --prompt-len 2048)

stage probe
timeout 120 python3 -m detattn.repro --probe "${common[@]}" --json "$OUT/probe.json" \
  --daemon-log "$OUT/detattnd-probe.log" > "$OUT/probe.md" 2> "$OUT/probe.err"
echo "probe exit $?"; cat "$OUT/probe.md"; tail -5 "$OUT/probe.err"

stage "cuda plane checks"
timeout 120 python3 clients/python/tests/test_gpu_cuda_plane.py --detattnd build-gpu/bin/detattnd \
  --json "$OUT/cuda_plane.json" --daemon-log "$OUT/detattnd-plane.log" > "$OUT/cuda_plane.md" 2> "$OUT/cuda_plane.err"
echo "cuda plane checks exit $?"; cat "$OUT/cuda_plane.md"; tail -15 "$OUT/cuda_plane.err"

left=$((deadline - (SECONDS - t0)))
[ "$left" -lt 120 ] && left=120
stage "repro: $n samples per path, $left s"
timeout $((left + 45)) python3 -m detattn.repro "${common[@]}" --workload stream --max-new 32 --samples "$n" \
  --paths "$paths" --time-budget "$((left - 40))" --check-seconds 25 --json "$OUT/repro.json" \
  --plot "$OUT/repro.png" --daemon-log "$OUT/detattnd-repro.log" > "$OUT/repro.md" 2> "$OUT/repro.err"
rc=$?
echo "repro exit $rc"; tail -25 "$OUT/repro.err"

stage summary
echo "GPU: $(head -1 "$OUT/gpu.txt"); $(sed -n 2p "$OUT/gpu.txt"); $(sed -n 3p "$OUT/gpu.txt")"
grep -E '^\| (sdpa-flash|sdpa-cudnn|varlen|detattn) ' "$OUT/probe.md"
grep '^batch-variant' "$OUT/probe.md" || echo "probe: no result (see probe.err)"
grep -A8 '^| check' "$OUT/cuda_plane.md" || echo "cuda plane checks: no result (see cuda_plane.err)"
cat "$OUT/repro.md"
echo "total $((SECONDS - t0)) s"
exit $rc
