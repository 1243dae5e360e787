#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on the GPU machine (which has no
# network) into .whl/ (git-ignored; name it in the device tool's `carry` list), check
# every file's sha256, and check that the whole carry fits the device's 64 MiB.
#
#   .whl/common/*.whl  what LMCache's MP server imports beyond the device image, the
#                      same for 0.5.3 and 0.5.6 (both import the same top-level modules;
#                      see ../shared/reference/gpu-device-notes.md section 1): 8 files
#   .whl/0.5.3/        lmcache 0.5.3 (cp312)
#   .whl/0.5.6/        lmcache 0.5.6 (cp312): its descriptor wrapper forms meet a GPU
#   .whl/extra/        optional: cuda-bindings 13.3.1. LMCache 0.5.3's
#                      RawCudaIPCWrapper.to_tensor assigns cudaIpcMemHandle_t.reserved,
#                      which cuda-bindings 13.4 removed; if the device's bindings are
#                      newer, the 0.5.3 server gets this one so its raw form is tested.
# pytest and its plugins are in the device image already (KINDS.md), so not carried.
#
# Usage: scripts/fetch_gpu_wheels.sh [--no-extra]     (PIP=... to choose pip)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
pip_cmd=${PIP:-}
if [ -z "$pip_cmd" ]; then
  if [ -x .venv/bin/pip ]; then pip_cmd=.venv/bin/pip; else pip_cmd="python3 -m pip"; fi
fi
extra=1
[ "${1:-}" = "--no-extra" ] && extra=0
limit_mib=64     # the device tool's carry limit (working tree + carried paths)
margin_mib=8     # kept free for the working tree's growth

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

download .whl/0.5.3 lmcache==0.5.3
check .whl/0.5.3 <<'EOF'
e7adfc5b4113e0bd626c692afbfe84c07abf895ab14638409f3ee426ce9bd288  lmcache-0.5.3-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
EOF

download .whl/0.5.6 lmcache==0.5.6
check .whl/0.5.6 <<'EOF'
c7892944ca91ec965c3448b2e30e0869f86a2499bdd01b70eb988e3436d71e4e  lmcache-0.5.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
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
wheels=$(find .whl -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s' 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
echo "fetch_gpu_wheels.sh: .whl/ ready ($(find .whl -type f -name '*.whl' | wc -l) wheels, $(mib "$wheels") MiB); with the working tree ($(mib "$tree") MiB) the carry is $(mib $((wheels + tree))) MiB of $limit_mib"
if (( wheels + tree > (limit_mib - margin_mib) * 1048576 )); then
  echo "fetch_gpu_wheels.sh: that leaves less than $margin_mib MiB under the device's $limit_mib MiB carry limit: run with --no-extra, or carry less" >&2
  exit 1
fi
