#!/bin/bash
# Builds the libFuzzer harnesses (Debian's clang with -fsanitize=fuzzer,address,undefined) and
# runs each for a bounded time from a generated seed corpus; fails on any crash, leak or
# timeout. Usage: tests/fuzz/run.sh [seconds per fuzzer, default 60] [work dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
work=${2:-$(mktemp -d /tmp/detattn-fuzz-XXXXXX)}
mkdir -p "$work/gen" "$work/corpus-request" "$work/corpus-reply"
protoc-c --c_out="$work/gen" -Iproto proto/detattn.proto
cc="clang -g -O1 -std=c11 -D_GNU_SOURCE -ffp-contract=off -fno-sanitize-recover=undefined"
inc="-Iserver -Ikernels -Iplugin -Iplugin/include -Iproto -I$work/gen"
san="-fsanitize=fuzzer,address,undefined"
pb="$work/gen/detattn.pb-c.c"
$cc $inc -o "$work/gen_corpus" tests/fuzz/gen_corpus.c "$pb" -lprotobuf-c
"$work/gen_corpus" "$work/corpus-request" "$work/corpus-reply"
$cc $san $inc -o "$work/fuzz_request" tests/fuzz/fuzz_request.c server/wire.c kernels/da.c "$pb" \
  -lprotobuf-c $(pkg-config --libs libxxhash) -lm
$cc $san $inc -fvisibility=hidden -o "$work/fuzz_reply" tests/fuzz/fuzz_reply.c plugin/ops.c plugin/client.c \
  plugin/plane_shm.c plugin/plane_cuda.c plugin/doorbell.c kernels/da.c "$pb" -lprotobuf-c -lnng \
  $(pkg-config --libs libxxhash) -lm -lpthread -ldl
rc=0
for f in request reply; do
  echo "fuzz_$f: ${secs} s"
  if ! ASAN_OPTIONS=detect_leaks=1 "$work/fuzz_$f" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$work/crash-$f-" "$work/corpus-$f" > "$work/fuzz_$f.log" 2>&1; then
    echo "fuzz_$f FAILED (artifacts under $work):"
    tail -40 "$work/fuzz_$f.log"
    rc=1
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss|cov:" "$work/fuzz_$f.log" | tail -3
  fi
done
exit $rc
