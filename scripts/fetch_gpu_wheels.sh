#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on the GPU machine (which has no
# network) into .whl/ (git-ignored; name it in the device tool's `carry` list), and
# check every file's sha256.
#
#   .whl/*.whl        the server's set, exactly as ../shared/reference/gpu-device-notes.md
#                     section 2 lists it (9 files, about 21 MB): lmcache 0.5.3 and only
#                     what its MP server imports beyond the device image.
#   .whl/extra/*.whl  optional, used only when the device lacks them (about 8 MB):
#                     * cuda-bindings 13.3.1: LMCache 0.5.3's RawCudaIPCWrapper.to_tensor
#                       assigns cudaIpcMemHandle_t.reserved, which cuda-bindings 13.4
#                       removed; if the device's bindings are newer, the server gets
#                       this one so the "raw" wrapper form can be tested at all.
#                     * pytest and its dependencies, to run tests/test_gpu_live.py.
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

download .whl lmcache==0.5.3 pyzmq==27.3.0 msgspec==0.23.0 blake3==1.0.11 \
  cryptography==50.0.2 cffi==2.1.1 cachetools==8.0.2 opentelemetry-api==1.40.0 \
  importlib-metadata==8.7.1
check .whl <<'EOF'
e7adfc5b4113e0bd626c692afbfe84c07abf895ab14638409f3ee426ce9bd288  lmcache-0.5.3-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
4061c0079120205fb760c58acab6443e217307dcf05e3702cf970e0689972856  cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl
858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798  pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl
33424c686b291c7682b5816fe9320466dbc0a457ef7e15c273c804a2d70fea70  blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
c08f294663135183bd633efd843645687285a445054a876c37506d4e9de7d80b  msgspec-0.23.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
c1453022f490d2459a11819d83ad1d586e9ff65a12ac3e705ffebd46d3685dcf  cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
82dd69331ae74b06f6a874704be0cfaa49a1650e1537d4a813b86ecef7d0ecf9  opentelemetry_api-1.40.0-py3-none-any.whl
5a1f80bf1daa489495071efbb095d75a634cf28a8bc299581244063b53176151  importlib_metadata-8.7.1-py3-none-any.whl
502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d  cachetools-8.0.2-py3-none-any.whl
EOF

if [ "$extra" = 1 ]; then
  download .whl/extra cuda-bindings==13.3.1 pytest==9.0.2 pluggy==1.6.0 iniconfig==2.1.0 \
    packaging==25.0 pygments==2.19.2
  check .whl/extra <<'EOF'
e32d08f71ebcdf00f0f41eab2eb37e8da94c8ed411cc9f7f7a019ce6b34abe3a  cuda_bindings-13.3.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
711ffd45bf766d5264d487b917733b453d917afd2b0ad65223959f59089f875b  pytest-9.0.2-py3-none-any.whl
e920276dd6813095e9377c0bc5566d94c932c33b27a3e3945d8389c374dd4746  pluggy-1.6.0-py3-none-any.whl
9deba5723312380e77435581c6bf4935c94cbfab9b1ed33ef8d238ea168eb760  iniconfig-2.1.0-py3-none-any.whl
29572ef2b1f17581046b3a2227d5c611fb25ec70ca1ba8554b24b0e69331a484  packaging-25.0-py3-none-any.whl
86540386c03d588bb81d44bc3928634ff26449851e99741617ecb9037ee5ec0b  pygments-2.19.2-py3-none-any.whl
EOF
fi

total=$(du -cb .whl/*.whl .whl/extra/*.whl 2>/dev/null | tail -1 | cut -f1)
echo "fetch_gpu_wheels.sh: .whl/ ready ($(find .whl -type f -name '*.whl' | wc -l) wheels, $((total / 1048576)) MiB; carry limit 64 MiB)"
