#!/usr/bin/env bash
# aarch64 (GB10 / DGX Spark, Grace, Jetson) installability, without an aarch64 machine:
# build our wheel, check that it is pure Python (one wheel for every platform), then have
# pip resolve it and every runtime dependency, the [cuda] extra included, for
# linux aarch64 / CPython 3.12 from binary wheels only (--only-binary=:all:: nothing may
# need a compiler on the target). Resolved twice:
# * manylinux2014_aarch64 (glibc 2.17: any aarch64 distribution), the floor;
# * manylinux_2_28_aarch64 as well (glibc >= 2.28: DGX OS / Ubuntu 24.04, what GB10 runs),
#   which lets pip pick the newest wheels (cuda-bindings 13 for CUDA 13, numpy >= 2.3
#   publish aarch64 wheels for glibc 2.28 only), so both sets are proven to exist.
# Needs the package index; prints the resolved wheels and the time taken. Exit 1 on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/aarch64.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$PY" -m pip wheel -q --no-deps -w "$work/own" . >/dev/null
wheel=$(ls "$work"/own/lmcache_mp-*.whl)
"$PY" - "$wheel" <<'PYEOF'
import sys, zipfile
path = sys.argv[1]
name = path.rsplit("/", 1)[-1]
if not name.endswith("-py3-none-any.whl"):
    sys.exit(f"aarch64: our wheel {name} is not tagged py3-none-any")
with zipfile.ZipFile(path) as z:
    binaries = [n for n in z.namelist() if n.endswith((".so", ".pyd", ".dylib", ".c", ".pyx"))]
    wheel_meta = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
    purelib = "Root-Is-Purelib: true" in z.read(wheel_meta).decode()
if binaries or not purelib:
    sys.exit(f"aarch64: our wheel is not pure Python: binaries {binaries}, purelib {purelib}")
print(f"aarch64: {name} is pure Python (Root-Is-Purelib: true, no compiled files)")
PYEOF

for platform in manylinux2014_aarch64 manylinux_2_28_aarch64; do
  platforms=(--platform manylinux2014_aarch64)
  [ "$platform" = manylinux2014_aarch64 ] || platforms+=(--platform "$platform")
  dest="$work/$platform"
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    "${platforms[@]}" --python-version 3.12 --implementation cp --abi cp312 \
    -d "$dest" "$wheel[cuda]" 2> >(grep -v "is neither a file nor a directory" >&2)
  for dep in pyzmq msgspec blake3 numpy cuda_bindings cuda_python; do
    if ! ls "$dest" | grep -q "^${dep}-"; then
      echo "aarch64: $platform: no wheel for $dep was resolved" >&2; exit 1
    fi
  done
  if ls "$dest" | grep -qv '\.whl$'; then
    echo "aarch64: $platform: a non-wheel download: $(ls "$dest" | grep -v '\.whl$')" >&2; exit 1
  fi
  echo "aarch64: $platform / cp312 resolves from wheels only: $(ls "$dest" | sed 's/-cp312.*\|-py3-none.*//' | tr '\n' ' ')"
done
echo "aarch64: passed in $(( $(date +%s) - start )) s"
