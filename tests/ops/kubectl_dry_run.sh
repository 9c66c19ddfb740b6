#!/bin/bash
# kubectl apply --dry-run=client --validate=false over deploy/k8s. kubectl maps documents to
# resources through API discovery even in a client dry run, so a stub API server on loopback
# (stub_apiserver.py: discovery only, every object absent) stands in for a cluster.
# Exit 0 pass, 1 fail, 77 skipped (no kubectl or python3).
# Usage: kubectl_dry_run.sh <repo root>
set -u
root=$1
command -v kubectl > /dev/null 2>&1 || { echo "skip: no kubectl"; exit 77; }
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3) || { echo "skip: no python3"; exit 77; }
dir=$(mktemp -d /tmp/detattn-kubectl-XXXXXX)
"$py" "$(dirname "$0")/stub_apiserver.py" "$dir/port" &
pid=$!
trap 'kill "$pid" 2> /dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do [ -s "$dir/port" ] && break; sleep 0.1; done
[ -s "$dir/port" ] || { echo "FAIL: the stub API server did not start"; exit 1; }
export KUBECONFIG=$dir/kubeconfig HOME=$dir
kubectl config set-cluster stub --server="http://127.0.0.1:$(cat "$dir/port")" > /dev/null
kubectl config set-context stub --cluster=stub > /dev/null
kubectl config use-context stub > /dev/null
out=$(kubectl apply --dry-run=client --validate=false -f "$root/deploy/k8s/namespace.yaml" \
  -f "$root/deploy/k8s/detattnd.yaml" -f "$root/deploy/k8s/serving-example.yaml" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: kubectl apply --dry-run=client exited $rc"; exit 1; }
n=$(echo "$out" | grep -c "(dry run)")
# namespace, configmap, 2 daemonsets, 1 deployment
[ "$n" -eq 5 ] || { echo "FAIL: $n objects in the dry run, expected 5"; exit 1; }
echo "PASS: kubectl accepts deploy/k8s ($n objects)"
