#!/usr/bin/env python3
"""Record the KV-cache views vLLM's OWN allocator makes, for tests without vLLM.

    .venv-vllm/bin/python tools/gen_vllm_kv_layouts.py [--out fixtures/vllm/kv_layouts.json]

For each KV-cache layout vLLM 0.32 can resolve for attention (``LBHNC``, ``LBNHC``,
``BLHNC``, ``BLNHC``) and for an MLA spec, in a tiny geometry (``"geometry": "tiny"``,
the offline tests) and in ``scripts/gpu_check.py``'s (``"gpu_check"``: 8 layers, 8 KV
heads of 128, blocks of 16, bfloat16, the blocks its default sizes use; layer-compact
``LBNHC`` and blocks-first ``BLHNC``), this resolves the layout with vLLM's
``resolve_kv_cache_layout`` (``VLLM_KV_CACHE_LAYOUT`` set, as a user would), sizes the
cache with ``get_kv_cache_configs`` and allocates it with ``allocate_kv_cache`` on the
CPU, then writes what each per-layer view is: shape, strides and storage offset (in
elements), dtype, and the backing allocation's size. The offline CUDA tests build
their fake CUDA tensors from these (the same views vLLM hands a connector), and
``scripts/gpu_check.py`` rebuilds them on a GPU with ``torch.as_strided``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: name -> (layers, KV heads, head size, block size, blocks, MLA latent, dtype)
GEOMETRIES = {"tiny": (2, 2, 8, 16, 40, 24, "float16"),
              # gpu_check.py's defaults: sizes 256 and 4096 tokens -> 552 blocks of 16
              "gpu_check": (8, 8, 128, 16, 552, 576, "bfloat16")}


def _model_dir(layers: int, heads: int) -> str:
    path = Path(tempfile.gettempdir()) / f"lmcache_mp_vllm_layouts_model_{layers}_{heads}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "num_hidden_layers": layers, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 1024, "torch_dtype": "float16"}))
    return str(path)


def record(geometry: str, layout: str | None, mla: bool) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    layers, heads, head_size, block, blocks, latent, dtype_name = GEOMETRIES[geometry]
    dtype = getattr(torch, dtype_name)
    if layout is None:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    else:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    cfg = VllmConfig(
        model_config=ModelConfig(model=_model_dir(layers, heads), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=256),
        cache_config=CacheConfig(block_size=block, num_gpu_blocks_override=blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_model_len=256,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"))
    spec = (MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=latent,
                             dtype=dtype) if mla else
            FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size,
                              dtype=dtype))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    specs = {n: spec for n in names}
    every = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    with set_current_vllm_config(cfg):
        resolved = resolve_kv_cache_layout(cfg, [every], list(specs.values()))
        kcc = get_kv_cache_configs(cfg, [specs], [spec.page_size_bytes * blocks * layers])[0]
    views = allocate_kv_cache(kcc, torch.device("cpu"), resolved)
    base = views[names[0]].untyped_storage()
    return {
        "vllm": vllm.__version__, "geometry": geometry, "layout": resolved.name,
        "mla": mla, "num_blocks": kcc.num_blocks, "block_size": block,
        "heads": 1 if mla else heads, "head_size": latent if mla else head_size,
        "dtype": dtype_name, "alloc_bytes": base.nbytes(),
        "layers": [{"name": n, "shape": list(t.shape), "stride": list(t.stride()),
                    "storage_offset": t.storage_offset()} for n, t in views.items()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="fixtures/vllm/kv_layouts.json")
    args = ap.parse_args()
    out = [record("tiny", layout, False) for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")]
    out.append(record("tiny", None, True))
    out += [record("gpu_check", layout, False) for layout in ("LBNHC", "BLHNC")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} layouts to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
