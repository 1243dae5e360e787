#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh installs on the GPU machine (which has no network)
# in .whl/ (git-ignored; name it in the device tool's `carry` list): download, check
# every file's sha256, and check that the whole carry fits the device's 64 MiB with
# room to spare.
#
#   .whl/common/*.whl  what LMCache's MP server imports beyond the device image, the
#                      same for every release (see ../shared/reference/gpu-device-notes.md
#                      section 1): 8 files
#   .whl/<release>/lmcache-<release>-slim.tar.xz
#                      LMCache <release>'s wheel (0.5.3, 0.5.6, 0.5.7rc2), unpacked, less
#                      what an MP server with an L1 alone never imports (the redis and
#                      filesystem L2 clients' native modules, the cache simulator's docs,
#                      the controller frontends' images), repacked with xz: three
#                      releases' wheels are 50 MB, the bundles 20 MB, and the carry
#                      (with the 13 MiB working tree) would not fit 64 MiB otherwise.
#                      Deterministic (sorted names, fixed times, owner 0).
#   .whl/0.5.7rc2/*.whl what 0.5.7rc2's server also imports (pydantic, fastapi and their
#                      kin; gpu-results-2026-12-04.md), 8 files
#   .whl/extra/        only with --with-cuda-bindings: cuda-bindings 13.3.1. LMCache
#                      0.5.3's RawCudaIPCWrapper.to_tensor assigns
#                      cudaIpcMemHandle_t.reserved, which cuda-bindings 13.4 removed; the
#                      H200 image has 13.3.1 (2026-12-04), so it is not carried by default.
# pytest and its plugins are in the device image already (KINDS.md), so not carried.
#
# Usage: scripts/fetch_gpu_wheels.sh [--with-cuda-bindings]     (PIP=... to choose pip)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
pip_cmd=${PIP:-}
if [ -z "$pip_cmd" ]; then
  if [ -x .venv/bin/pip ]; then pip_cmd=.venv/bin/pip; else pip_cmd="python3 -m pip"; fi
fi
extra=0
[ "${1:-}" = "--with-cuda-bindings" ] && extra=1
limit_mib=64     # the device tool's carry limit (working tree + carried paths)
margin_mib=12    # kept free for the working tree's growth

platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download() {  # dir, requirements...
  local dir=$1; shift
  mkdir -p "$dir"
  $pip_cmd download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dir" "$@"
}

check() {  # dir, sha256 list on stdin
  local dir=$1 list
  list=$(cat)
  (cd "$dir" && sha256sum --quiet -c - <<<"$list") || {
    echo "fetch_gpu_wheels.sh: sha256 mismatch in $dir" >&2; exit 1; }
  local want have
  want=$(wc -l <<<"$list")
  have=$(find "$dir" -maxdepth 1 -type f -name '*.whl' | wc -l)
  if [ "$want" != "$have" ]; then
    echo "fetch_gpu_wheels.sh: $dir holds $have wheels, expected exactly $want" >&2
    find "$dir" -maxdepth 1 -type f -name '*.whl' -printf '  %f\n' >&2
    exit 1
  fi
}

# The earlier flat layout (.whl/*.whl) would travel too, unused: drop it.
rm -f .whl/*.whl .whl/extra/pytest-*.whl .whl/extra/pluggy-*.whl .whl/extra/iniconfig-*.whl \
  .whl/extra/packaging-*.whl .whl/extra/pygments-*.whl

download .whl/common pyzmq==27.3.0 msgspec==0.23.0 blake3==1.0.11 cryptography==50.0.2 \
  cffi==2.1.1 cachetools==8.0.2 opentelemetry-api==1.40.0 importlib-metadata==8.7.1
check .whl/common <<'EOF'
4061c0079120205fb760c58acab6443e217307dcf05e3702cf970e0689972856  cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl
858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798  pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl
33424c686b291c7682b5816fe9320466dbc0a457ef7e15c273c804a2d70fea70  blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
c08f294663135183bd633efd843645687285a445054a876c37506d4e9de7d80b  msgspec-0.23.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
c1453022f490d2459a11819d83ad1d586e9ff65a12ac3e705ffebd46d3685dcf  cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
82dd69331ae74b06f6a874704be0cfaa49a1650e1537d4a813b86ecef7d0ecf9  opentelemetry_api-1.40.0-py3-none-any.whl
5a1f80bf1daa489495071efbb095d75a634cf28a8bc299581244063b53176151  importlib_metadata-8.7.1-py3-none-any.whl
502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d  cachetools-8.0.2-py3-none-any.whl
EOF

slim_bundle() {  # release sha256: download, check, strip, repack as xz (deterministic)
  local rel=$1 sum=$2 tmp bundle=.whl/$1/lmcache-$1-slim.tar.xz
  mkdir -p ".whl/$rel"
  if [ -s "$bundle" ] && [ "$(cat ".whl/$rel.bundle-sha256" 2>/dev/null)" = "$sum" ]; then return 0; fi
  tmp=$(mktemp -d)
  download "$tmp" "lmcache==$rel"
  (cd "$tmp" && sha256sum --quiet -c - <<<"$sum  $(ls lmcache-*.whl)") || {
    echo "fetch_gpu_wheels.sh: sha256 mismatch for lmcache $rel" >&2; rm -rf "$tmp"; exit 1; }
  mkdir "$tmp/x"
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$tmp"/lmcache-*.whl "$tmp/x"
  rm -f "$tmp"/x/lmcache/lmcache_fs.*.so "$tmp"/x/lmcache/lmcache_redis.*.so
  rm -rf "$tmp"/x/lmcache/tools "$tmp"/x/lmcache/lmcache_frontend/static \
    "$tmp"/x/lmcache/v1/cache_controller/frontend/static \
    "$tmp"/x/lmcache/inprocess/v1/cache_controller/frontend/static
  tar -C "$tmp/x" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . \
    | xz -9 -T2 >"$bundle.tmp"
  mv "$bundle.tmp" "$bundle"
  # Beside the folder, not in it: what is in .whl/<release>/ is installed.
  echo "$sum" >".whl/$rel.bundle-sha256"
  rm -rf "$tmp"
}
rm -f .whl/0.5.3/*.whl .whl/0.5.6/*.whl .whl/0.5.7rc2/lmcache-*.whl  # the earlier, whole wheels
slim_bundle 0.5.3 e7adfc5b4113e0bd626c692afbfe84c07abf895ab14638409f3ee426ce9bd288
slim_bundle 0.5.6 c7892944ca91ec965c3448b2e30e0869f86a2499bdd01b70eb988e3436d71e4e
slim_bundle 0.5.7rc2 e7732d25de12baca3df89caadd8ac78620d4de539d6c75310dd1a9509bce6a45

download .whl/0.5.7rc2 pydantic==2.11.9 pydantic-core==2.33.2 annotated-types==0.8.0 \
  typing-inspection==0.4.5 fastapi==0.115.14 starlette==0.46.2 uvicorn==0.55.0 httpx==0.28.1
check .whl/0.5.7rc2 <<'EOF'
f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0  annotated_types-0.8.0-py3-none-any.whl
6c0c8bf9420bd58f565e585036d971872472b4f7d3f6c73b698e10cffdefb3ca  fastapi-0.115.14-py3-none-any.whl
d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad  httpx-0.28.1-py3-none-any.whl
c42dd626f5cfc1c6950ce6205ea58c93efa406da65f479dcb4029d5934857da2  pydantic-2.11.9-py3-none-any.whl
8f57a69461af2a5fa6e6bbd7a5f60d3b7e6cebb687f55106933188e79ad155c1  pydantic_core-2.33.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
595633ce89f8ffa71a015caed34a5b2dc1c0cdb3f0f1fbd1e69339cf2abeec35  starlette-0.46.2-py3-none-any.whl
bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39  typing_inspection-0.4.5-py3-none-any.whl
bee604c5af6e15fb0584913c632b222c09db1048c26fc05053203207c4b9e37d  uvicorn-0.55.0-py3-none-any.whl
EOF

if [ "$extra" = 1 ]; then
  download .whl/extra cuda-bindings==13.3.1
  check .whl/extra <<'EOF'
e32d08f71ebcdf00f0f41eab2eb37e8da94c8ed411cc9f7f7a019ce6b34abe3a  cuda_bindings-13.3.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
EOF
else
  rm -rf .whl/extra
fi

# Everything that travels: the wheels plus the tracked and untracked-not-ignored tree.
wheels=$(find .whl -type f \( -name '*.whl' -o -name '*.tar.xz' \) -printf '%s\n' | awk '{s += $1} END {print s + 0}')
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s' 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
echo "fetch_gpu_wheels.sh: .whl/ ready ($(find .whl -type f \( -name '*.whl' -o -name '*.tar.xz' \) | wc -l) files, $(mib "$wheels") MiB); with the working tree ($(mib "$tree") MiB) the carry is $(mib $((wheels + tree))) MiB of $limit_mib"
if (( wheels + tree > (limit_mib - margin_mib) * 1048576 )); then
  echo "fetch_gpu_wheels.sh: that leaves less than $margin_mib MiB under the device's $limit_mib MiB carry limit: carry less (without --with-cuda-bindings)" >&2
  exit 1
fi
