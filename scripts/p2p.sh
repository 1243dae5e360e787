#!/usr/bin/env bash
# What LMCache's P2P second tier needs to run here (tests/multinode/test_p2p.py): its
# `mooncake_te` transfer engine over TCP, from the package registries, under .tools/p2p:
#   * PyPI's mooncake-transfer-engine-non-cuda, its Python package only (--no-deps: what
#     it imports is lmcache's own), into .tools/p2p/site, for the 0.5.7rc2 oracle's python;
#   * the system libraries its extension links, Debian's libibverbs1, libnl-3-200 and
#     libnl-route-3-200, unpacked (apt-get download + dpkg -x, nothing installed) into
#     .tools/p2p/root. apt-get download needs apt's package lists: as root, it runs
#     `apt-get update` once if they are missing.
#
#   scripts/p2p.sh install   install once; prints two lines: the site dir (PYTHONPATH)
#                            and the library dirs (LD_LIBRARY_PATH)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/uv.sh"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=$repo/.tools/p2p
pin=mooncake-transfer-engine-non-cuda==0.3.13.post1
debs="libibverbs1 libnl-3-200 libnl-route-3-200"
libs=$dir/root/usr/lib/x86_64-linux-gnu:$dir/root/lib/x86_64-linux-gnu
[ "$(uname -m)" = aarch64 ] && libs=$dir/root/usr/lib/aarch64-linux-gnu:$dir/root/lib/aarch64-linux-gnu

install() {
  mkdir -p "$repo/.tools"
  (
    flock 9
    if [ ! -f "$dir/.installed" ] || [ "$(cat "$dir/.installed")" != "$pin $debs" ]; then
      rm -rf "$dir"; mkdir -p "$dir/debs" "$dir/root"
      python=$("$repo/scripts/lmcache-server.sh" install --version 0.5.7rc2)/bin/python
      "$(uv_bin)" pip install -q --no-deps --target "$dir/site" --python "$python" "$pin"
      if ! (cd "$dir/debs" && apt-get download $debs >/dev/null 2>&1); then
        [ "$(id -u)" = 0 ] || { echo "p2p.sh: apt-get download $debs failed (no package lists? run apt-get update as root)" >&2; exit 1; }
        apt-get update -qq >/dev/null
        (cd "$dir/debs" && apt-get download $debs >/dev/null 2>&1)
      fi
      for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir/root"; done
      echo "$pin $debs" >"$dir/.installed"
    fi
  ) 9>"$repo/.tools/.p2p-install.lock"
  echo "$dir/site"
  echo "$libs"
}

case ${1:-} in
  install) install ;;
  *) sed -n 2,13p "$0" >&2; exit 2 ;;
esac
