#!/bin/bash
# Builds detattnd's OCI image on this machine without a registry, and smoke-tests it:
#  1. a Debian 12 minbase rootfs (debootstrap), imported once as localhost/debian:bookworm-minbase;
#  2. deploy/container/Containerfile with buildah (vfs storage), from the files git tracks or
#     sees (build directories and ignored files stay out);
#  3. podman runs the image: --help, then a CPU daemon, `detattn hello` and GET /readyz from
#     inside the container, and SIGTERM must drain it to exit 0.
# Usage: deploy/container/build.sh [cpu|cuda] [tag] [oci-archive path]
#   cuda bind-mounts the host's /usr/local/cuda (nvcc 13) into the build stage.
set -euo pipefail
cd "$(dirname "$0")/../.."
variant=${1:-cpu}
tag=${2:-localhost/detattnd:$variant}
archive=${3:-}
st=(--storage-driver vfs)
base=localhost/debian:bookworm-minbase
work=$(mktemp -d /tmp/detattn-image-XXXXXX)
name=detattnd-smoke-$$
cleanup() {
  podman "${st[@]}" rm -f "$name" > /dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

if ! podman "${st[@]}" image exists "$base"; then
  command -v debootstrap > /dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
  echo "== debootstrap bookworm minbase"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian > "$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/rootfs" -c . | podman "${st[@]}" import - "$base" > /dev/null
  rm -rf "$work/rootfs"
fi

echo "== build context (git ls-files -co --exclude-standard)"
mkdir "$work/ctx"
git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C "$work/ctx"
args=(--build-arg "BASE=$base")
if [ "$variant" = cuda ]; then
  [ -x /usr/local/cuda/bin/nvcc ] || { echo "cuda: no nvcc at /usr/local/cuda"; exit 1; }
  args+=(--build-arg CUDA=ON -v /usr/local/cuda:/usr/local/cuda:ro)
fi
echo "== buildah bud -t $tag"
t0=$(date +%s)
buildah "${st[@]}" bud --network host --layers=false -f deploy/container/Containerfile "${args[@]}" -t "$tag" \
  "$work/ctx" > "$work/bud.log" 2>&1 || { tail -40 "$work/bud.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s: $(podman "${st[@]}" image inspect --format '{{.Id}} {{.Size}} bytes' "$tag")"

echo "== smoke test"
podman "${st[@]}" run --rm --network none "$tag" --help | head -2
podman "${st[@]}" run -d --name "$name" --network none "$tag" --backend cpu --layers 2 --q-heads 4 --kv-heads 2 \
  --head-dim 64 --kv-tokens 1024 --threads 1 --listen ipc:///run/detattn/detattnd.sock \
  --http-listen http://127.0.0.1:9400 --log-format json > /dev/null
for _ in $(seq 100); do
  podman "${st[@]}" logs "$name" 2>&1 | grep -q '"event":"listening"' && break
  sleep 0.1
done
podman "${st[@]}" logs "$name" 2>&1 | head -5
podman "${st[@]}" exec "$name" detattn --url ipc:///run/detattn/detattnd.sock hello | head -3
ready=$(podman "${st[@]}" exec "$name" bash -c 'exec 3<>/dev/tcp/127.0.0.1/9400; printf "GET /readyz HTTP/1.0\r\n\r\n" >&3; cat <&3' | tr -d '\r')
echo "$ready" | head -1
echo "$ready" | grep -q '^ready$' || { echo "FAIL: /readyz: $ready"; exit 1; }
podman "${st[@]}" stop -t 10 "$name" > /dev/null
code=$(podman "${st[@]}" inspect --format '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || { echo "FAIL: exit $code after SIGTERM"; podman "${st[@]}" logs "$name" | tail -5; exit 1; }
echo "PASS: the image serves, answers /readyz and drains on SIGTERM (exit 0)"
if [ -n "$archive" ]; then
  podman "${st[@]}" save --format oci-archive -o "$archive" "$tag"
  echo "saved $archive"
fi
