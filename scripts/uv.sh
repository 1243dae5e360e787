# Sourced (not run) by the scripts that build virtualenvs: every venv of the project is
# built with uv (a pinned release, bootstrapped once into .tools/uv with pip), which
# resolves and installs in seconds where pip took a minute or more per venv, and links
# files from its cache instead of copying them (torch, ~0.7 GB, once on disk for all).
#
#   uv_bin                     path of the uv executable (installs it the first time)
#   uv_venv DIR                a fresh venv at DIR with the local torch 2.13.0 CPU wheel
#   uv_venv_bare DIR           a fresh venv at DIR, nothing installed
#   uv_install DIR ARGS...     uv pip install ARGS into the venv at DIR
#
# torch: this machine keeps a CPU build of torch 2.13.0 on disk (/opt/wheels); pip
# finds it through its config, uv does not, and a bare torch requirement from the index
# is a multi-GB CUDA build. uv_venv installs that file first (its dependencies from the
# index), and
# uv_install pins torch to it (find-links + a constraint), so no dependency can swap it.
# Env: LMCACHE_MP_UV (a uv to use instead), LMCACHE_MP_TORCH_WHEELS (/opt/wheels).

uv_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv_version=0.13.9
uv_torch_wheels=${LMCACHE_MP_TORCH_WHEELS:-/opt/wheels}
uv_constraints=$uv_repo/scripts/uv-constraints.txt

uv_bin() {
  if [ -n "${LMCACHE_MP_UV:-}" ]; then echo "$LMCACHE_MP_UV"; return 0; fi
  local tools=$uv_repo/.tools/uv
  if ! "$tools/bin/uv" --version 2>/dev/null | grep -qF "uv $uv_version"; then
    # One bootstrap at a time: several scripts may start side by side.
    (
      flock 9
      if ! "$tools/bin/uv" --version 2>/dev/null | grep -qF "uv $uv_version"; then
        rm -rf "$tools"
        python3 -m venv "$tools"
        "$tools/bin/pip" install -q --disable-pip-version-check "uv==$uv_version" 2>&1 \
          | grep -v "^WARNING: Location" >&2 || true
      fi
    ) 9>"$uv_repo/.tools.lock"
  fi
  echo "$tools/bin/uv"
}

uv_venv_bare() {
  rm -rf "$1"
  "$(uv_bin)" venv -q --seed --python "${PYTHON:-python3}" "$1"
}

uv_venv() {
  uv_venv_bare "$1"
  uv_install "$1" 'torch==2.13.0+cpu'  # and its few pure-Python dependencies
}

uv_install() {
  local dir=$1; shift
  # TMPDIR: uv (0.7.16 and later, astral-sh/uv#14385) leaves an empty
  # uv-setuptools-HASH.lock in the temp dir after building a package from source;
  # ours stay in .tools/uv-tmp, not the system's /tmp.
  mkdir -p "$uv_repo/.tools/uv-tmp"
  TMPDIR="$uv_repo/.tools/uv-tmp" "$(uv_bin)" pip install -q --python "$dir/bin/python" --find-links "$uv_torch_wheels" \
    --constraint "$uv_constraints" "$@"
}
