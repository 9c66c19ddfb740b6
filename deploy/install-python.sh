#!/bin/bash
# Installs the Python package detattn (clients/python) for Debian's /usr/bin/python3, with the
# libdetattn it loads copied beside it, so `/usr/bin/python3 -c 'import detattn'` works from
# any directory without environment variables. Idempotent. As root it installs into the
# system site directory (/usr/local/lib/python3.X/dist-packages), otherwise into the user's.
# Usage: deploy/install-python.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
py=/usr/bin/python3
lib=$(ls "$build"/lib/libdetattn.so.*.*.* 2>/dev/null | head -1 || true)
[ -n "$lib" ] || { echo "install-python: no $build/lib/libdetattn.so.* (build first)" >&2; exit 1; }
if [ "$(id -u)" -eq 0 ]; then
  site=$($py -c 'import site; print(site.getsitepackages()[0])')
else
  site=$($py -c 'import site; print(site.getusersitepackages())')
fi
mkdir -p "$site"
rm -rf "$site/detattn.tmp"
cp -r clients/python/detattn "$site/detattn.tmp"
find "$site/detattn.tmp" -name __pycache__ -prune -exec rm -rf {} +
cp "$lib" "$site/detattn.tmp/libdetattn.so.0"
rm -rf "$site/detattn"
mv "$site/detattn.tmp" "$site/detattn"
(cd / && $py -c 'import detattn, sys; print("detattn", detattn.__version__, "installed in", detattn.__path__[0])')
