#!/bin/bash
# Usage: bash tests/cuda/stale_build.sh SRC BUILD
# Removes the build directory BUILD where it was built from other sources than the tree SRC
# holds now, so the next cmake builds from clean. On a warm GPU machine the build directories
# of the call before stay; when that call sent another tree, ninja can find its outputs newer
# than the sources sent now and rebuild nothing (NOTES.md v5.24: a table measured the wrong
# tree). The stamp is a hash of SRC's source, build and proto files (build directories,
# .ab-old, .devdeps and .git left out), kept in BUILD/.src-stamp.
set -eu
src=$1 build=$2
stamp=$(cd "$src" && find . \( -name build -o -name 'build-*' -o -name .ab-old -o -name .devdeps -o -name .git \) -prune -o -type f \
  \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cmake' -o -name CMakeLists.txt \
  -o -name '*.proto' -o -name '*.in' \) -print0 | sort -z | xargs -0 md5sum | md5sum | cut -d' ' -f1)
if [ -f "$build/.src-stamp" ] && [ "$(cat "$build/.src-stamp")" = "$stamp" ]; then
  exit 0
fi
[ -d "$build" ] && echo "stale_build: $build was built from other sources: removed" >&2
rm -rf "$build"
mkdir -p "$build"
echo "$stamp" > "$build/.src-stamp"
