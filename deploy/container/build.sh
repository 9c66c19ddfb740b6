#!/bin/bash
# Builds detattnd's OCI image on this machine without a registry, and smoke-tests it:
#  1. a Debian 12 minbase rootfs (debootstrap), imported once as localhost/debian:bookworm-minbase;
#  2. deploy/container/Containerfile with buildah (vfs storage), from the files git tracks or
#     sees (build directories and ignored files stay out);
#  3. the image's entrypoint runs from its rootfs (a chroot, as the image's user): --help, a
#     CPU daemon, `detattn hello` on its ipc socket, GET /readyz, and SIGTERM must drain it
#     to exit 0.
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
cleanup() { rm -rf "$work"; }
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
  # The toolkit at its own path too: some of its links are absolute (/usr/local/cuda-13.0/...).
  real=$(readlink -f /usr/local/cuda)
  args+=(--build-arg CUDA=ON -v "$real:/usr/local/cuda:ro")
  [ "$real" = /usr/local/cuda ] || args+=(-v "$real:$real:ro")
fi
echo "== buildah bud -t $tag"
t0=$(date +%s)
buildah "${st[@]}" bud --isolation chroot --network host --layers=false -f deploy/container/Containerfile "${args[@]}" -t "$tag" \
  "$work/ctx" > "$work/bud.log" 2>&1 || { tail -40 "$work/bud.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s: $(podman "${st[@]}" image inspect --format '{{.Id}} {{.Size}} bytes' "$tag")"

echo "== smoke test"
# The image's rootfs runs its entrypoint in a chroot as the image's user (podman run needs an
# OCI runtime with cgroups, which some build machines lack; buildah's chroot isolation does
# not). The entrypoint, user and environment are read from the image's config.
ctr=$(buildah "${st[@]}" from "$tag")
mnt=$(buildah "${st[@]}" mount "$ctr")
cleanup_smoke() {
  [ -n "${dpid:-}" ] && kill -KILL "$dpid" 2> /dev/null || true
  buildah "${st[@]}" umount "$ctr" > /dev/null 2>&1 || true
  buildah "${st[@]}" rm "$ctr" > /dev/null 2>&1 || true
}
trap 'cleanup_smoke; cleanup' EXIT
entry=$(buildah "${st[@]}" inspect --format '{{index .OCIv1.Config.Entrypoint 0}}' "$ctr")
user=$(buildah "${st[@]}" inspect --format '{{.OCIv1.Config.User}}' "$ctr")
ldpath=$(buildah "${st[@]}" inspect --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$ctr" |
  sed -n 's/^LD_LIBRARY_PATH=//p')
echo "entrypoint $entry, user $user, LD_LIBRARY_PATH $ldpath"
[ "$entry" = /usr/local/bin/detattnd ] && [ "$user" = 10001:10001 ] || { echo "FAIL: unexpected image config"; exit 1; }
in_image() { env -i LD_LIBRARY_PATH="$ldpath" PATH=/usr/local/bin:/usr/bin:/bin "$(command -v chroot)" --userspec="$user" "$mnt" "$@"; }
in_image "$entry" --help > "$work/help.txt"
head -2 "$work/help.txt"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Started directly (not through in_image) so that $! is the daemon itself: env and chroot exec.
env -i LD_LIBRARY_PATH="$ldpath" "$(command -v chroot)" --userspec="$user" "$mnt" "$entry" --backend cpu --layers 2 \
  --q-heads 4 --kv-heads 2 --head-dim 64 --kv-tokens 1024 --threads 1 --listen ipc:///run/detattn/detattnd.sock \
  --http-listen "http://127.0.0.1:$port" --log-format json 2> "$work/daemon.log" &
dpid=$!
for _ in $(seq 100); do
  grep -q '"event":"listening"' "$work/daemon.log" && break
  sleep 0.1
done
head -4 "$work/daemon.log"
in_image detattn --url ipc:///run/detattn/detattnd.sock hello > "$work/hello.txt" || { echo "FAIL: hello"; exit 1; }
head -3 "$work/hello.txt"
ready=$(exec 3<> "/dev/tcp/127.0.0.1/$port"; printf 'GET /readyz HTTP/1.0\r\n\r\n' >&3; cat <&3 | tr -d '\r')
echo "GET /readyz: $(echo "$ready" | head -1) / $(echo "$ready" | tail -1)"
echo "$ready" | grep -q '^ready$' || { echo "FAIL: /readyz"; exit 1; }
kill -TERM "$dpid"
code=0
wait "$dpid" || code=$?
dpid=
[ "$code" = 0 ] || { echo "FAIL: exit $code after SIGTERM"; tail -5 "$work/daemon.log"; exit 1; }
tail -1 "$work/daemon.log"
echo "PASS: the image's daemon serves, answers /readyz and drains on SIGTERM (exit 0)"
if [ -n "$archive" ]; then
  podman "${st[@]}" save --format oci-archive -o "$archive" "$tag"
  echo "saved $archive"
fi
