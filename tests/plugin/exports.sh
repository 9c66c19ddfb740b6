#!/bin/sh
# Checks that libdetattn.so exports the public API (detattn_*) and nothing else: no da_*
# internals and no generated protobuf code (detattn__v1__*).
# Usage: exports.sh path/to/libdetattn.so
set -eu
lib=$1
syms=$(nm -D --defined-only "$lib" | awk 'NF == 3 { print $3 }')
for want in detattn_connect detattn_close detattn_forward detattn_forward_start detattn_call_wait \
            detattn_hello detattn_stats_get detattn_seq_open detattn_errmsg detattn_status_name; do
  echo "$syms" | grep -qx "$want" || { echo "missing export: $want"; exit 1; }
done
extra=$(echo "$syms" | grep -v '^detattn_[a-z]' || true)
if [ -n "$extra" ]; then
  echo "unexpected exports:"; echo "$extra"; exit 1
fi
echo "exports ok: $(echo "$syms" | wc -l) detattn_ symbols"
